"""The wire format: round trips through the incremental reader, and every header violation."""

import gc

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rudra_async import errors
from rudra_async.wire import (
    ALLOWED_DTYPES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_SEGMENTS,
    FrameReader,
    Limits,
    MsgType,
    decode_meta,
    encode_frame,
    encode_messages,
    parse_segments,
    unpack_header,
)


def feed(reader: FrameReader, data: bytes, chunks: list[int]):
    """Feed bytes in the given chunk sizes (cycled); return every frame produced."""
    out, pos, i = [], 0, 0
    while pos < len(data):
        buf = reader.get_buffer()
        n = min(len(buf), max(1, chunks[i % len(chunks)]), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos += n
        i += 1
        out += reader.advance(n)
    return out


def joined(parts) -> bytes:
    return b"".join(bytes(p) for p in parts)


small_shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from(sorted(ALLOWED_DTYPES))


@st.composite
def arrays(draw):
    dt = np.dtype(draw(dtypes))
    shape = draw(small_shapes)
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dt.itemsize, max_size=int(np.prod(shape)) * dt.itemsize))
    a = np.frombuffer(raw, dtype=np.uint8).view(dt).reshape(shape) if raw else np.zeros(shape, dt)
    return a.copy()


meta_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    msg_type=st.sampled_from(list(MsgType)),
    meta=st.dictionaries(st.text(max_size=10).filter(lambda k: k != "seg"), meta_values, max_size=5),
    arrs=st.lists(arrays(), max_size=4),
    chunks=st.lists(st.integers(1, 97), min_size=1, max_size=5),
)
def test_round_trip_small(msg_type, meta, arrs, chunks):
    data = joined(encode_frame(msg_type, meta, arrs))
    frames = feed(FrameReader(), data * 2, chunks)  # two frames back to back
    assert len(frames) == 2
    for f in frames:
        assert f.msg_type == msg_type and f.error is None
        assert {k: v for k, v in f.meta.items() if k != "seg"} == meta
        got = f.arrays
        assert len(got) == len(arrs)
        for a, b in zip(arrs, got):
            assert a.dtype.str == b.dtype.str and a.shape == b.shape
            assert a.tobytes() == b.tobytes()


BIG = 64 * 1024 * 1024 + 12  # > 64 MiB


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    sizes=st.lists(st.sampled_from([0, 1, 7, BIG]), min_size=1, max_size=2).filter(lambda s: BIG in s),
    dtype=st.sampled_from(["<f4", "|u1", "<f2"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_large_segments_into_preallocated_buffer(sizes, dtype, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    arrs = [rng.integers(0, 255, size=n // dt.itemsize * dt.itemsize, dtype=np.uint8).view(dt) for n in sizes]
    parts = encode_frame(MsgType.PUSH, {"timestamp": 1}, arrs)
    # encode_frame must not copy: the segment parts are views of the caller's arrays
    assert all(
        np.shares_memory(np.frombuffer(p, np.uint8), a) for p, a in zip(parts[1:], [a for a in arrs if a.nbytes])
    )
    target = bytearray(sum(a.nbytes for a in arrs))
    reader = FrameReader(allocate=lambda t, m, n: memoryview(target) if n == len(target) else None)
    frames = feed(reader, joined(parts), [1 << 22, 13, 1 << 20])
    assert len(frames) == 1
    for a, b in zip(arrs, frames[0].arrays):
        if a.nbytes:
            assert np.shares_memory(b, np.frombuffer(target, np.uint8))  # landed in our buffer
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


def header(magic=MAGIC, version=1, mtype=3, flags=0, meta_len=0, body_len=0) -> bytes:
    return HEADER.pack(magic, version, mtype, flags, meta_len, body_len)


@pytest.mark.parametrize(
    "raw, exc",
    [
        (header(magic=b"XXXX"), errors.BadMagic),
        (header(version=9), errors.BadVersion),
        (header(meta_len=2 << 20), errors.FrameTooLarge),
        (header(body_len=2**63), errors.FrameTooLarge),
    ],
)
def test_bad_headers_are_fatal(raw, exc):
    with pytest.raises(exc) as info:
        feed(FrameReader(), raw, [HEADER_SIZE])
    assert info.value.fatal


def test_limits_apply_to_writer_and_reader():
    big = np.zeros(2048, np.uint8)
    with pytest.raises(errors.FrameTooLarge):
        encode_frame(MsgType.PUSH, {}, [big], Limits(max_body=1024))
    with pytest.raises(errors.FrameTooLarge):
        unpack_header(header(body_len=2048), Limits(max_body=1024))


@pytest.mark.parametrize(
    "meta_bytes",
    [b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa3seg\x91\x92\xa3<f4\x91\x05"],  # bad msgpack, not a map, seg ≠ body
    ids=["invalid", "not-a-map", "segments-disagree"],
)
def test_bad_metadata_is_reported_and_skipped(meta_bytes):
    body = b"\x00" * 8
    bad = header(meta_len=len(meta_bytes), body_len=len(body)) + meta_bytes + body
    good = joined(encode_frame(MsgType.PULL, {"newer_than": 3}))
    frames = feed(FrameReader(), bad + good, [5])
    assert frames[0].error is not None and not frames[0].error.fatal
    assert frames[1].error is None and frames[1].meta == {"newer_than": 3}


def test_non_contiguous_and_unsupported_dtypes_are_refused():
    with pytest.raises(errors.MalformedFrame):
        encode_frame(MsgType.PUSH, {}, [np.zeros((4, 4), np.float32)[:, 1]])
    with pytest.raises(errors.MalformedFrame):
        encode_frame(MsgType.PUSH, {}, [np.zeros(3, np.complex64)])


def test_body_buffers_are_reused_after_release():
    reader = FrameReader()
    data = joined(encode_frame(MsgType.PUSH, {}, [np.ones(1000, np.float32)]))
    (first,) = feed(reader, data, [1 << 16])
    first_buf = first.body.obj
    first.release()
    (second,) = feed(reader, data, [1 << 16])
    assert second.body.obj is first_buf


def receive_messages(reader: FrameReader, messages) -> list:
    """Receive each message into exactly one get_buffer(), as a message-based transport does."""
    out = []
    for m in messages:
        buf = reader.get_buffer()
        assert len(buf) == len(m), "get_buffer() must be exactly the next message"
        buf[:] = bytes(m)
        out += reader.advance(len(m))
    return out


@settings(max_examples=60, deadline=None)
@given(
    arrs=st.lists(arrays(), max_size=4),
    meta=st.dictionaries(
        st.text(max_size=5).filter(lambda k: k != "seg"), st.integers(-(2**63), 2**64 - 1), max_size=3
    ),
)
def test_messages_mode_receives_one_message_per_get_buffer(arrs, meta):
    messages = encode_messages(MsgType.PUSH, meta, arrs)
    assert len(messages) == 2 + sum(1 for a in arrs if a.nbytes)  # header, metadata, each non-empty segment
    target = bytearray(sum(a.nbytes for a in arrs))
    reader = FrameReader(allocate=lambda t, m, n: memoryview(target), messages=True)
    (frame,) = receive_messages(reader, messages)
    assert {k: v for k, v in frame.meta.items() if k != "seg"} == meta
    for a, b in zip(arrs, frame.arrays):
        assert a.dtype.str == b.dtype.str and a.shape == b.shape and a.tobytes() == b.tobytes()
        if a.nbytes:
            assert np.shares_memory(b, np.frombuffer(target, np.uint8))  # zero-copy into the allocator's buffer
    assert len(receive_messages(reader, messages)) == 1  # and the next frame


def test_bad_metadata_before_a_body_is_fatal_in_messages_mode():
    meta_bytes = b"\xc1"
    raw = header(meta_len=1, body_len=8) + meta_bytes
    with pytest.raises(errors.MalformedFrame) as info:
        receive_messages(FrameReader(messages=True), [raw[:HEADER_SIZE], raw[HEADER_SIZE:]])
    assert info.value.fatal
    no_body = header(meta_len=1) + meta_bytes  # nothing to tell apart: reported, not fatal
    (frame,) = receive_messages(FrameReader(messages=True), [no_body[:HEADER_SIZE], no_body[HEADER_SIZE:]])
    assert frame.error is not None and not frame.error.fatal


def test_small_frames_cost_one_read_and_a_large_body_is_read_in_place():
    """Several small frames arriving together are parsed from one read; the bulk of a large
    body goes straight into the allocator's buffer, not through the staging buffer."""
    small = [joined(encode_frame(MsgType.PULL, {"newer_than": i})) for i in range(3)]
    reader = FrameReader()
    buf = reader.get_buffer()
    data = b"".join(small)
    assert len(buf) >= len(data)
    buf[: len(data)] = data
    assert [f.meta["newer_than"] for f in reader.advance(len(data))] == [0, 1, 2]

    big = np.arange(FrameReader.STAGE, dtype=np.float32)  # 4 × STAGE bytes
    target = bytearray(big.nbytes)
    reader = FrameReader(allocate=lambda t, m, n: memoryview(target))
    raw = joined(encode_frame(MsgType.PUSH, {"timestamp": 0}, [big]))
    first = reader.get_buffer()
    head = raw[: len(first)]  # the header, metadata and the body's first bytes arrive together
    first[: len(head)] = head
    assert reader.advance(len(head)) == []
    rest = reader.get_buffer()
    assert np.shares_memory(np.frombuffer(rest, np.uint8), np.frombuffer(target, np.uint8))
    (frame,) = feed(reader, raw[len(head) :], [1 << 20])
    assert np.array_equal(frame.arrays[0], big)


def test_frames_before_a_fatal_error_in_the_same_read_are_delivered_first():
    good = joined(encode_frame(MsgType.PULL, {"newer_than": 7}))
    reader = FrameReader()
    buf = reader.get_buffer()
    data = good + b"XXXX" + bytes(HEADER_SIZE)  # a frame, then a header with a bad magic
    buf[: len(data)] = data
    with pytest.raises(errors.BadMagic) as info:
        reader.advance(len(data))
    assert [f.meta["newer_than"] for f in info.value.finished] == [7]


def test_a_segment_list_longer_than_the_limit_is_refused_before_any_entry_is_read():
    """At most MAX_SEGMENTS segments a frame: a longer list is malformed at once, whatever
    its entries (here the first one would be refused too), so its cost does not grow with it."""
    assert len(parse_segments({"seg": [["<f4", [0]]] * MAX_SEGMENTS}, 0)) == MAX_SEGMENTS
    too_many = {"seg": [["O", [1]]] + [["<f4", [0]]] * MAX_SEGMENTS}
    with pytest.raises(errors.MalformedFrame, match=f"{MAX_SEGMENTS + 1} segments; a frame may have at most"):
        parse_segments(too_many, 0)


def test_large_metadata_is_decoded_with_the_garbage_collector_paused(monkeypatch):
    """1 MiB of small msgpack lists makes ~300,000 objects: decoded with the collector on,
    they set off collections of the whole heap as they are made (a stall of every learner
    ~7 times as long as the decode). Large metadata is decoded with it paused, and it is
    on again after, also when the metadata is refused; small metadata leaves it alone."""
    seen = []
    unpackb = msgpack.unpackb

    def watching(data, **kwargs):
        seen.append(gc.isenabled())
        return unpackb(data, **kwargs)

    monkeypatch.setattr(msgpack, "unpackb", watching)
    large = msgpack.packb({"seg": [["<f4", [0]]] * 40_000})
    assert len(decode_meta(large)["seg"]) == 40_000
    with pytest.raises(errors.MalformedFrame):
        decode_meta(large[:-1])  # cut short: not msgpack
    assert decode_meta(msgpack.packb({"seq": 1})) == {"seq": 1}
    assert seen == [False, False, True] and gc.isenabled()

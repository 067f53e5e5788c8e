"""Requests built to make the server's replies too large or its parsing too slow: every
request still gets exactly one reply, in order, and nothing is dropped silently."""

import asyncio
import contextlib
import logging
import struct

import msgpack
import numpy as np
import pytest
from helpers import initial_weights, run_server, small_layout

from rudra_async import schema, transports
from rudra_async.client import Client
from rudra_async.errors import PeerGone, RequestError
from rudra_async.layout import Layout
from rudra_async.server import session
from rudra_async.wire import MAX_SEGMENTS, Frame, FrameReader, Header, MsgType

LAYOUT = small_layout()
N = LAYOUT.size


def frame(msg_type: int, meta: dict | None = None, body: bytes = b"", meta_raw: bytes | None = None) -> bytes:
    packed = meta_raw if meta_raw is not None else msgpack.packb(meta or {}, use_bin_type=True)
    return Header(msg_type, 0, len(packed), len(body)).pack() + packed + body


def with_float32_seq(meta: dict, n: int = 120_000) -> bytes:
    """``meta`` plus a ``seq`` of ``n`` float32 values, encoded: 5 bytes each here, 9 in a
    reply (a float there is a float 64), so ~600 KB of request make ~1.08 MB of reply."""
    head = msgpack.packb(meta, use_bin_type=True)
    assert head[0] == 0x80 | len(meta)  # a fixmap: one more entry
    values = b"\xdd" + struct.pack(">I", n) + (b"\xca" + struct.pack(">f", 0.5)) * n
    return bytes([0x80 | (len(meta) + 1)]) + head[1:] + msgpack.packb("seq") + values


def with_long_seq(meta: dict) -> bytes:
    """``meta`` plus a string ``seq`` that brings the request just under the 1 MiB limit."""
    n = (1 << 20) - len(msgpack.packb({**meta, "seq": ""}, use_bin_type=True)) - 8
    return msgpack.packb({**meta, "seq": "s" * n}, use_bin_type=True)


SEQS = {"float32 list": with_float32_seq, "long string": with_long_seq}


def request(kind: str, clock: int) -> tuple[int, dict, bytes]:
    grad = np.full(N, 0.5, np.float32).tobytes()
    push = {"timestamp": clock, "seg": [["<f4", [N]]]}
    return {
        "PULL": (MsgType.PULL, {"newer_than": -1}, b""),
        "PUSH": (MsgType.PUSH, push, grad),
        "PUSH with pull": (MsgType.PUSH, {**push, "pull": True}, grad),
        "unknown type": (77, {}, b""),
    }[kind]


class Raw:
    """A raw connection to a server: frames out as bytes, replies in order (one reader
    for all of them: a reply may arrive in the same read as the one before)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = FrameReader()
        self.ready: list[Frame] = []

    @classmethod
    async def open(cls, ps) -> "Raw":
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def recv(self, timeout: float = 10.0) -> Frame:
        while not self.ready:
            buf = self.frames.get_buffer()
            data = await asyncio.wait_for(self.reader.read(len(buf)), timeout)
            if not data:
                raise EOFError("the server closed the connection")
            buf[: len(data)] = data
            self.ready += self.frames.advance(len(data))
        return self.ready.pop(0)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def raw(ps, hello: bool = True):
    """A :class:`Raw` connection to ``ps``; with ``hello``, registered (``ps`` then has weights)."""
    conn = await Raw.open(ps)
    try:
        if hello:
            meta = {"name": "raw", "layout": LAYOUT.to_wire(), "seg": [["<f4", [N]]]}
            conn.send(frame(MsgType.HELLO, meta, initial_weights(LAYOUT).tobytes()))
            assert (await conn.recv()).msg_type == MsgType.WELCOME
        yield conn
    finally:
        await conn.close()


def no_error_logged(caplog) -> bool:
    return not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("seq", list(SEQS))
@pytest.mark.parametrize("kind", ["PULL", "PUSH", "PUSH with pull", "unknown type"])
async def test_a_seq_a_reply_could_not_carry_is_refused_by_name_and_not_echoed(kind, seq, caplog):
    """A ``seq`` whose encoding in a reply would exceed 64 KiB (here ~1 MiB: a float32 list,
    which a reply re-encodes as float 64, or a long string) is refused with ``bad_request``
    naming it, in an ERROR without ``seq``; nothing of the request is done (a push is not
    applied, the express path too), and the next request gets the next reply."""
    async with run_server(kernel="numpy", momentum=0.0) as ps, raw(ps) as conn:
        msg_type, meta, body = request(kind, ps.clock)
        conn.send(frame(msg_type, body=body, meta_raw=SEQS[seq](meta)))
        conn.send(frame(MsgType.PULL, {"seq": "next"}))
        refused, answered = await conn.recv(), await conn.recv()
        assert refused.msg_type == MsgType.ERROR, refused.meta
        assert refused.meta["code"] == "bad_request" and "'seq'" in refused.meta["message"]
        assert refused.meta["fatal"] is False and "seq" not in refused.meta
        assert answered.msg_type == MsgType.WEIGHTS and answered.meta["seq"] == "next"
        assert ps.clock == 0  # not applied
    assert no_error_logged(caplog)


@pytest.mark.parametrize("kind", ["PULL", "PUSH", "PUSH with pull", "unknown type"])
async def test_a_reply_that_cannot_be_encoded_is_answered_with_an_error_without_seq(kind, monkeypatch, caplog):
    """The safeguard behind the ``seq`` bound: were a reply still too large to encode (here
    the bound is lifted), the request gets an ERROR ``reply_too_large`` without ``seq``
    instead, not fatal, and the next request its own reply; the request itself was handled
    (a push applied). Nothing is dropped in silence, nothing logged as an error."""
    monkeypatch.setattr(schema, "encoded_size", lambda value: 0)  # every seq "fits"
    async with run_server(kernel="numpy", momentum=0.0) as ps, raw(ps) as conn:
        msg_type, meta, body = request(kind, ps.clock)
        conn.send(frame(msg_type, body=body, meta_raw=with_float32_seq(meta)))
        conn.send(frame(MsgType.PULL, {"seq": "next"}))
        lost, answered = await conn.recv(), await conn.recv()
        assert lost.msg_type == MsgType.ERROR, lost.meta
        assert lost.meta["code"] == "reply_too_large" and lost.meta["fatal"] is False and "seq" not in lost.meta
        assert answered.msg_type == MsgType.WEIGHTS and answered.meta["seq"] == "next"
        assert ps.clock == (1 if kind.startswith("PUSH") else 0)
        assert ps.stats()["rejected"].get("reply_too_large") == 1
    assert no_error_logged(caplog)


def layout_taking(nbytes: int) -> list:
    """A layout of 16 values whose WELCOME echo (layout and no groups) takes ``nbytes``: empty
    tensors with names of 1,000 characters, then two whose names (of 256 to 1,024 characters,
    a str16 header: each entry takes its name's length + 6 bytes) make up the rest."""
    count = (nbytes - 1000) // 1006  # leaves 1,000 to 2,006 bytes for the last two
    filler = [[f"{i:06d}" + "x" * 994, [0]] for i in range(count)]
    shell = len(msgpack.packb([[*filler, ["a" * 300, [0]], ["b" * 300, [N]]], []])) - 600
    rest = nbytes - shell  # for the two names
    first = rest // 2
    layout = [*filler, ["a" * first, [0]], ["b" * (rest - first), [N]]]
    assert len(msgpack.packb([layout, []])) == nbytes and 256 <= first <= rest - first <= 1024, (nbytes, rest)
    return layout


@pytest.mark.parametrize("over", ["by one byte", "near the metadata limit"])
async def test_a_first_hello_whose_welcome_would_not_fit_is_refused_before_anything_is_initialised(over):
    """A first HELLO whose layout leaves a WELCOME less than 64 KiB (a seq) + 4 KiB of the
    1 MiB limit is refused with ``bad_layout``, and the server takes no weights from it; a
    layout that just fits is welcomed, and so is every later learner, with a seq of 64 KiB.
    (Near the limit the server used to take the weights and then welcome no one.)"""
    async with run_server(kernel="numpy") as ps:
        room = ps.limits.max_meta - session.WELCOME_RESERVE
        size = room + 1 if over == "by one byte" else ps.limits.max_meta - 1000
        w0 = np.zeros(N, np.float32).tobytes()
        fits = layout_taking(room)
        async with raw(ps, hello=False) as conn:
            conn.send(frame(MsgType.HELLO, {"layout": layout_taking(size), "seg": [["<f4", [N]]], "seq": 1}, w0))
            refused = await conn.recv()
            assert refused.msg_type == MsgType.ERROR and refused.meta["code"] == "bad_layout", refused.meta
            assert refused.meta["seq"] == 1 and refused.meta["fatal"] is False
            assert ps.core.store is None
            conn.send(frame(MsgType.HELLO, {"layout": fits, "seg": [["<f4", [N]]], "seq": 2}, w0))
            assert (await conn.recv()).msg_type == MsgType.WELCOME
        async with raw(ps, hello=False) as conn:
            longest = b"s" * (schema.MAX_SEQ_BYTES - 5)  # a bin 32: 5 bytes of header
            conn.send(frame(MsgType.HELLO, {"layout": fits, "seq": longest}))
            welcome = await conn.recv()
            assert welcome.msg_type == MsgType.WELCOME and welcome.meta["seq"] == longest


async def test_an_error_echoes_a_nil_seq():
    """``seq: nil`` is a seq like any other: a refusal echoes it, as a reply does."""
    async with run_server(kernel="numpy") as ps, raw(ps) as conn:
        for msg_type, meta in ((MsgType.PULL, {"newer_than": "x"}), (77, {}), (MsgType.PULL, {})):
            conn.send(frame(msg_type, {**meta, "seq": None}))
            reply = await conn.recv()
            assert "seq" in reply.meta and reply.meta["seq"] is None, reply.meta


async def test_a_frame_with_more_segments_than_a_layout_has_tensors_is_refused_unread():
    """A frame may list at most MAX_SEGMENTS segments (a layout's tensors at most): a PULL that
    lists one more is refused ``malformed`` (not fatal, its seq echoed), one that lists
    MAX_SEGMENTS empty ones is answered as usual."""
    async with run_server(kernel="numpy") as ps, raw(ps) as conn:
        for count, seq in ((MAX_SEGMENTS + 1, 1), (MAX_SEGMENTS, 2)):
            conn.send(frame(MsgType.PULL, {"seg": [["<f4", [0]]] * count, "seq": seq}))
            reply = await conn.recv()
            assert reply.meta["seq"] == seq
            if count > MAX_SEGMENTS:
                assert reply.msg_type == MsgType.ERROR and reply.meta["code"] == "malformed", reply.meta
                assert f"{count} segments" in reply.meta["message"] and reply.meta["fatal"] is False
            else:
                assert reply.msg_type == MsgType.WEIGHTS, reply.meta


async def test_a_layout_has_at_most_as_many_tensors_as_a_push_may_have_segments():
    """A layout of MAX_TENSORS + 1 tensors is refused (``bad_request`` naming ``layout``); with
    MAX_TENSORS a learner may push each tensor's gradient as its own segment."""
    async with run_server(kernel="numpy", lr=1.0, momentum=0.0) as ps:
        async with raw(ps, hello=False) as conn:
            conn.send(frame(MsgType.HELLO, {"layout": [["t", [1]]] * (MAX_SEGMENTS + 1)}))
            refused = await conn.recv()
            assert refused.meta["code"] == "bad_request" and "'layout'" in refused.meta["message"], refused.meta
        layout = Layout.from_shapes((f"t{i}", (1,)) for i in range(MAX_SEGMENTS))
        client = await Client.connect(ps.addresses[0], layout, np.zeros(layout.size, np.float32))
        ack = await client.push([np.ones(1, np.float32)] * MAX_SEGMENTS, 0)
        assert ack.status == "applied" and ps.clock == 1
        await client.close()


async def test_a_hello_to_a_server_with_weights_does_not_build_its_arrays(monkeypatch):
    """A server that has weights ignores a HELLO's segment, so it does not build the arrays
    of its (possibly many) segments."""
    built: list[tuple[int, bool]] = []
    arrays = Frame.arrays

    def counting(frame: Frame) -> list[np.ndarray]:
        built.append((frame.msg_type, ps.core.store is not None))
        return arrays.fget(frame)

    monkeypatch.setattr(Frame, "arrays", property(counting))
    async with run_server(kernel="numpy") as ps:
        w0 = initial_weights(LAYOUT)
        first = await Client.connect(ps.addresses[0], LAYOUT, w0)
        second = await Client.connect(ps.addresses[0], LAYOUT, w0)  # brings weights too
        await first.close()
        await second.close()
    assert (MsgType.HELLO, False) in built  # the first one's: the initial weights
    assert (MsgType.HELLO, True) not in built


async def test_a_connection_handler_that_gives_up_with_an_error_is_logged(caplog):
    """A listener logs the RudraError a connection handler ended with (a warning), except
    that the connection merely ended (PeerGone, ConnectionClosed: debug)."""
    caplog.set_level(logging.DEBUG, logger="rudra_async.transports.base")

    async def gives_up(conn):
        frame = await conn.recv()
        if frame.msg_type == MsgType.PULL:
            raise RequestError("the handler's reason", code="bad_request")
        await conn.recv()  # the peer closes: PeerGone

    listener = await transports.listen("memory://", gives_up)
    try:
        for msg_type in (MsgType.PULL, MsgType.PUSH):
            conn = await transports.connect(listener.address)
            await conn.send(msg_type, {})
            if msg_type == MsgType.PUSH:
                await asyncio.sleep(0.05)
                conn.close()
            else:
                with pytest.raises(PeerGone):
                    await asyncio.wait_for(conn.recv(), 5)
                conn.close()
        await asyncio.sleep(0.1)
    finally:
        await listener.close()
    records = [r for r in caplog.records if r.name == "rudra_async.transports.base"]
    warned = [r for r in records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "[bad_request] the handler's reason" in warned[0].getMessage()
    assert any(r.levelno == logging.DEBUG and "ended" in r.getMessage() for r in records)

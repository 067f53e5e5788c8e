"""The I/O-free rules every connection follows (rudra_async.transports.core), without a
socket or an event loop: the asyncio and the blocking connections both keep one."""

import numpy as np
import pytest

from rudra_async.errors import ConnectionClosed, MalformedFrame, PeerGone, WireError
from rudra_async.transports.core import ConnectionCore
from rudra_async.wire import Frame, FrameReader, MsgType, encode_frame


def frame(n: int, released: list[int] | None = None) -> Frame:
    body = np.zeros(n, np.uint8).data.cast("B")
    out = Frame(MsgType.PUSH, {"n": n}, body)
    if released is not None:
        out._release = lambda: released.append(n)  # the reader's hook: where the body goes back
    return out


def test_frames_come_in_order_then_the_fatal_error_on_every_later_call() -> None:
    core = ConnectionCore()
    for n in (1, 2):
        assert core.queue(frame(n))
    error = MalformedFrame("garbage")
    assert core.queue(error) and core.fatal is error and not core.taking
    released: list[int] = []
    assert not core.queue(frame(3, released)) and released == [3]  # nothing after a fatal error
    assert [core.next().meta["n"] for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
    for _ in range(2):
        with pytest.raises(MalformedFrame) as raised:
            core.next()
        assert raised.value is not error and raised.value.__traceback__ is not None  # a fresh copy each time
    core.lose(PeerGone("the link closed"))  # once the peer is known gone: the error once more, then that
    with pytest.raises(MalformedFrame):
        core.next()
    with pytest.raises(PeerGone, match="the link closed"):
        core.next()


def test_the_peers_loss_comes_after_what_was_queued_and_a_close_releases_everything() -> None:
    core = ConnectionCore()
    core.queue(frame(1))
    core.lose(PeerGone("first"))
    core.lose(PeerGone("second"))  # the first reason stays
    assert core.ended and core.next().meta["n"] == 1  # type: ignore[union-attr]
    with pytest.raises(PeerGone, match="first"):
        core.next()
    released: list[int] = []
    other = ConnectionCore()
    other.queue(frame(5, released))
    assert other.next().meta["n"] == 5  # type: ignore[union-attr]  # taken: the taker releases it
    other.queue(frame(6, released))
    assert other.close() and not other.close()  # the first close only
    assert released == [6] and other.inbox_nbytes == 0
    with pytest.raises(ConnectionClosed):
        other.next()
    with pytest.raises(ConnectionClosed):
        other.check_open()


def test_the_inbox_is_full_at_its_frame_or_byte_limit_and_one_frame_always_fits() -> None:
    core = ConnectionCore(inbox_frames=3, inbox_bytes=100)
    core.queue(frame(500))
    assert core.full  # one large frame: full, but it was taken
    core.next()
    assert not core.full and core.inbox_nbytes == 0
    for _ in range(3):
        core.queue(frame(1))
    assert core.full


def test_reading_counts_bytes_and_returns_the_frames_before_a_framing_error() -> None:
    core = ConnectionCore()
    good = b"".join(bytes(p) for p in encode_frame(MsgType.PULL, {"newer_than": -1}))
    data = good + b"\xff" * 64  # then bytes that are no frame header
    reader, items, at = FrameReader(), [], 0
    while at < len(data) and not any(isinstance(i, WireError) for i in items):
        buf = reader.get_buffer()
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at : at + n]
        at += n
        items += core.read(reader, n)
    assert isinstance(items[0], Frame) and items[0].meta["newer_than"] == -1
    assert isinstance(items[-1], WireError) and core.bytes_in == at
    core.sending([b"abc", memoryview(b"de")])
    assert core.bytes_out == 5

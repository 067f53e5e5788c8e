"""Frames over an asyncio byte stream (TCP or a Unix socket) with ``BufferedProtocol``.

Incoming bytes go straight into the :class:`~rudra_async.wire.FrameReader`'s buffers (no
intermediate copy); outgoing frames go out with ``writelines`` over views of the caller's
arrays. The write-buffer high-water mark is 0, so ``send`` knows exactly when the OS has
taken every byte and the arrays may change again.
"""
from __future__ import annotations

import asyncio
import collections
import socket
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from ..errors import ConnectError, ConnectionClosed, PeerGone, WireError
from ..wire import Frame, FrameReader, Limits, encode_frame
from .base import Connection, OnConnection, ServingListener, format_host_port


MAX_QUEUED_FRAMES = 8  # pause reading beyond this many unconsumed frames
LINGER_S = 2.0  # after a fatal framing error, how long to drain input before closing


class _FrameProtocol(asyncio.BufferedProtocol):
    def __init__(self, limits: Limits) -> None:
        self.reader = FrameReader(limits)
        self.transport: asyncio.Transport | None = None
        self.frames: collections.deque[Frame | BaseException] = collections.deque()
        self.recv_waiter: asyncio.Future[None] | None = None
        self.drain_waiters: list[asyncio.Future[None]] = []
        self.lost: BaseException | None = None
        self.broken = False  # the byte stream can no longer be parsed
        self.reading_paused = False
        self._scratch = bytearray(65536)
        self.on_made: Any = None
        #: called with each complete frame before it is queued; True means "consumed"
        self.intercept: Callable[[Frame], bool] | None = None
        self.lost_future: asyncio.Future[None] | None = None

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.lost_future = asyncio.get_running_loop().create_future()
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.on_made is not None:
            self.on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.broken:
            return memoryview(self._scratch)
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self.broken:
            return
        try:
            frames = self.reader.advance(nbytes)
        except WireError as exc:
            self.broken = True  # from now on incoming bytes are read and discarded
            self._push(exc)
            return
        for f in frames:
            if self.intercept is None or not self.intercept(f):
                self._push(f)
        if len(self.frames) >= MAX_QUEUED_FRAMES and self.transport is not None and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reader.mid_frame and not self.broken:
            self.lost = PeerGone("connection lost in the middle of a frame")
        else:
            self.lost = PeerGone(f"connection closed by peer{': ' + str(exc) if exc else ''}")
        self._wake()
        for w in self.drain_waiters:
            if not w.done():
                w.set_result(None)
        self.drain_waiters.clear()
        if self.lost_future is not None and not self.lost_future.done():
            self.lost_future.set_result(None)

    def resume_writing(self) -> None:
        for w in self.drain_waiters:
            if not w.done():
                w.set_result(None)
        self.drain_waiters.clear()

    # -- helpers -------------------------------------------------------------------------
    def _push(self, item: Frame | BaseException) -> None:
        self.frames.append(item)
        self._wake()

    def _wake(self) -> None:
        if self.recv_waiter is not None and not self.recv_waiter.done():
            self.recv_waiter.set_result(None)


class StreamConnection(Connection):
    def __init__(self, proto: _FrameProtocol) -> None:
        self._proto = proto
        self._closed = False
        assert proto.transport is not None
        self.peer = describe_peer(proto.transport)

    @property
    def allocator(self):  # type: ignore[override]
        return self._proto.reader.allocate

    @allocator.setter
    def allocator(self, value) -> None:  # type: ignore[override]
        self._proto.reader.allocate = value

    @property
    def is_closed(self) -> bool:
        return self._closed or self._proto.lost is not None

    async def wait_lost(self) -> None:
        assert self._proto.lost_future is not None
        await asyncio.shield(self._proto.lost_future)

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        transport = self._proto.transport
        assert transport is not None
        transport.writelines(encode_frame(msg_type, meta, arrays, self._proto.reader.limits))
        while transport.get_write_buffer_size() > 0:
            self._check_open()
            waiter = asyncio.get_running_loop().create_future()
            self._proto.drain_waiters.append(waiter)
            await waiter
        self._check_open()

    async def recv(self) -> Frame:
        proto = self._proto
        while not proto.frames:
            self._check_open()
            proto.recv_waiter = asyncio.get_running_loop().create_future()
            try:
                await proto.recv_waiter
            finally:
                proto.recv_waiter = None
        item = proto.frames.popleft()
        if proto.reading_paused and len(proto.frames) < MAX_QUEUED_FRAMES // 2 and proto.transport is not None:
            proto.reading_paused = False
            proto.transport.resume_reading()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        transport = self._proto.transport
        if transport is not None:
            if self._proto.broken and self._proto.lost is None and transport.can_write_eof():
                # Closing with unread bytes would reset the connection and destroy the error
                # reply just sent; half-close instead, discard input, and close a bit later.
                transport.write_eof()
                if self._proto.reading_paused:
                    transport.resume_reading()
                asyncio.get_running_loop().call_later(LINGER_S, transport.close)
            else:
                transport.close()
        self._proto._wake()
        if self._proto.lost_future is not None and not self._proto.lost_future.done():
            self._proto.lost_future.set_result(None)

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("connection closed locally")
        if self._proto.lost is not None:
            raise self._proto.lost


class StreamListener(ServingListener):
    def __init__(self, on_connection: OnConnection) -> None:
        super().__init__(on_connection)
        self._server: asyncio.AbstractServer | None = None

    def _accepted(self, proto: _FrameProtocol) -> None:
        self._spawn(StreamConnection(proto))

    def _stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def describe_peer(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return format_host_port("tcp", peer[0], peer[1])
    return f"unix:{peer!r}" if peer else "unix:?"


def protocol_factory(limits: Limits, on_made: Any = None) -> Callable[[], _FrameProtocol]:
    def factory() -> _FrameProtocol:
        proto = _FrameProtocol(limits)
        proto.on_made = on_made
        return proto

    return factory


async def open_stream(opener: Awaitable[tuple[Any, _FrameProtocol]], url: str, timeout: float) -> StreamConnection:
    """Await a loop.create_*_connection call; map its failures to ConnectError."""
    try:
        _, proto = await asyncio.wait_for(opener, timeout)
    except asyncio.TimeoutError:
        raise ConnectError(f"cannot connect to {url}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise ConnectError(f"cannot connect to {url}: {exc.strerror or exc}") from None
    return StreamConnection(proto)


async def start_listener(server_opener: Callable[[Callable[[], _FrameProtocol]], Awaitable[asyncio.AbstractServer]],
                         url: str, on_connection: OnConnection, limits: Limits) -> StreamListener:
    """Start a server with ``server_opener(factory)``; map bind failures to ConnectError."""
    listener = StreamListener(on_connection)
    try:
        listener._server = await server_opener(protocol_factory(limits, listener._accepted))
    except OSError as exc:
        raise ConnectError(f"cannot listen on {url}: {exc.strerror or exc}") from None
    return listener

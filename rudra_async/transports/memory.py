"""In-process transport (``memory://NAME``): a connected pair of endpoints in one event loop.

Frames really go through the wire format (encoded, then parsed by a FrameReader that honours
the receiver's allocator), so it exercises the same code paths as a socket, minus the
kernel. For tests and for in-process simulations; ``memory://`` picks a fresh name.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
from typing import Any, Sequence
from urllib.parse import urlsplit

import numpy as np

from ..errors import ConfigError, ConnectError, ConnectionClosed, PeerGone
from ..wire import Frame, FrameReader, Limits, encode_frame
from .base import Connection, OnConnection, ServingListener, Transport

_listeners: dict[str, "MemoryListener"] = {}
_names = itertools.count()


class MemoryConnection(Connection):
    def __init__(self, limits: Limits, peer: str) -> None:
        self.reader = FrameReader(limits)
        self.peer = peer
        self.other: MemoryConnection | None = None
        self._frames: collections.deque[Frame] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._lost = asyncio.get_running_loop().create_future()
        self._closed = False
        self._peer_gone = False

    @property
    def allocator(self):  # type: ignore[override]
        return self.reader.allocate

    @allocator.setter
    def allocator(self, value) -> None:  # type: ignore[override]
        self.reader.allocate = value

    @property
    def is_closed(self) -> bool:
        return self._closed or self._peer_gone

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosed("connection closed locally")
        if self._peer_gone:
            raise PeerGone("connection closed by peer")

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        assert self.other is not None
        for part in encode_frame(msg_type, meta, arrays, self.reader.limits):
            self.other._deliver(memoryview(part).cast("B"))  # one copy: straight into the peer's reader
        self.other._wake()
        await asyncio.sleep(0)  # a send is a scheduling point, as on a socket

    def _deliver(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            buf = self.reader.get_buffer()
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            self._frames.extend(self.reader.advance(n))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def recv(self) -> Frame:
        while not self._frames:
            self._check_open()
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._frames.popleft()

    async def wait_lost(self) -> None:
        await asyncio.shield(self._lost)

    def _gone(self) -> None:
        self._peer_gone = True
        self._wake()
        if not self._lost.done():
            self._lost.set_result(None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        if not self._lost.done():
            self._lost.set_result(None)
        if self.other is not None:
            self.other._gone()


class MemoryListener(ServingListener):
    def __init__(self, name: str, on_connection: OnConnection, limits: Limits) -> None:
        super().__init__(on_connection)
        self.name = name
        self.address = f"memory://{name}"
        self.limits = limits

    def _stop_accepting(self) -> None:
        _listeners.pop(self.name, None)


def _name(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "memory":
        raise ConfigError(f"not a memory:// address: {url!r}")
    return (parts.netloc + parts.path).strip("/")


class MemoryTransport(Transport):
    scheme = "memory"
    in_process = True

    async def listen(self, url: str, on_connection: OnConnection, *, limits: Limits = Limits()) -> MemoryListener:
        name = _name(url) or f"auto-{next(_names)}"
        if name in _listeners:
            raise ConnectError(f"cannot listen on memory://{name}: address already in use")
        listener = _listeners[name] = MemoryListener(name, on_connection, limits)
        return listener

    async def connect(self, url: str, *, limits: Limits = Limits(), timeout: float = 10.0) -> MemoryConnection:
        name = _name(url)
        listener = _listeners.get(name)
        if listener is None:
            raise ConnectError(f"cannot connect to {url}: nothing listens there in this process")
        client = MemoryConnection(limits, f"memory://{name}")
        server = MemoryConnection(listener.limits, f"memory://{name}#client")
        client.other, server.other = server, client
        listener._spawn(server)
        return client


transport = MemoryTransport()

"""In-process transport (``memory://NAME``): a connected pair of endpoints in one event loop.

Frames really go through the wire format (encoded, then parsed by a FrameReader that honours
the receiver's allocator), so it exercises the same code paths as a socket, minus the
kernel. For tests and for in-process simulations; ``memory://`` picks a fresh name.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..errors import ConfigError, ConnectError, PeerGone, Unreachable
from ..wire import DEFAULT_TIMEOUT, FrameReader, Limits, encode_frame
from .base import Connection, OnAccept, OnConnection, ServingListener, Transport

_listeners: dict[str, MemoryListener] = {}
_names = itertools.count()


class MemoryConnection(Connection):
    """One end of an in-process pair. ``send`` copies each part of the frame straight into
    the peer's reader (one copy) and waits while the peer's inbox is full; the inbox is
    bounded in bytes like a socket buffer, so many small frames fit but few large ones."""

    _inbox_frames = 4096
    _inbox_bytes = 4 << 20

    def __init__(self, limits: Limits, peer: str) -> None:
        super().__init__(peer)
        self.limits = limits
        self._reader = FrameReader(limits, self._allocate, admit=self._admit)
        self.other: MemoryConnection | None = None

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        parts = self._sending(encode_frame(msg_type, meta, arrays, self.limits))
        other = self.other
        assert other is not None
        if await other._inbox_room():  # back-pressure; a peer that takes nothing more discards
            for part in parts:
                other._receive(memoryview(part).cast("B"))
        self._check_open()
        await asyncio.sleep(0)  # a send is a scheduling point, as on a socket

    def _receive(self, data: memoryview) -> None:
        """Copy ``data`` into the reader's buffers; deliver what it completes."""
        pos = 0
        while pos < len(data) and self._taking:
            buf = self._reader.get_buffer()
            n = min(len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos += n
            self._advance(self._reader, n)

    def _close_link(self) -> None:
        self._reader.close()
        if self.other is not None:
            self.other._connection_lost(PeerGone("connection closed by peer"))


class MemoryListener(ServingListener):
    def __init__(self, name: str, on_connection: OnConnection, limits: Limits, on_accept: OnAccept | None) -> None:
        super().__init__(on_connection, on_accept)
        self.name = name
        self.address = f"memory://{name}"
        self.limits = limits

    def stop_accepting(self) -> None:
        _listeners.pop(self.name, None)


def _name(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "memory":
        raise ConfigError(f"not a memory:// address: {url!r}")
    return (parts.netloc + parts.path).strip("/")


class MemoryTransport(Transport):
    scheme = "memory"
    in_process = True
    same_host = True
    #: the class of both ends of a pair (a subclass may change how they buffer)
    connection_type: type[MemoryConnection] = MemoryConnection

    def fresh_address(self, host: str = "127.0.0.1") -> str:
        return "memory://"  # listen() names it

    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits = Limits(), on_accept: OnAccept | None = None
    ) -> MemoryListener:
        name = _name(url) or f"auto-{next(_names)}"
        if name in _listeners:
            raise ConnectError(f"cannot listen on memory://{name}: address already in use")
        listener = _listeners[name] = MemoryListener(name, on_connection, limits, on_accept)
        return listener

    async def connect(
        self, url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT
    ) -> MemoryConnection:
        name = _name(url)
        listener = _listeners.get(name)
        if listener is None:
            raise Unreachable(f"cannot connect to {url}: nothing listens there in this process")
        client = self.connection_type(limits, f"memory://{name}")
        server = self.connection_type(listener.limits, f"memory://{name}#client")
        client.other, server.other = server, client
        listener.spawn(server)
        return client


transport = MemoryTransport()

"""Shared-memory transport (``shm://NAME``) for learners on the server's host.

Small frames and all notifications travel over a Unix socket (abstract namespace, so no
socket file is left behind). A frame whose body is larger than ``INLINE`` bytes is written
by the sender into one of *its* shared-memory segments — allocated once and reused — and
only a reference (segment name, length, segment list) crosses the socket. The receiver
maps the segment once and reads the body in place: ``Frame.body`` is a view of shared
memory, so a gradient is never copied on the server side. A sender with ``MAX_SEGMENTS``
bodies outstanding waits (back-pressure). A segment is never written while the receiver
may read it, so no reader ever sees a half-written body; the exceptions are bodies sent
before they are final, each with a *progress word* that says how much of it is: the
server's weights while their update is computed, and a blocking learner's large pushes
while it writes them (each side does so only where the other said it reads the word).

Returning a segment costs no message: every sender segment ends in a control block of two
64-bit words, the *released ticket* and the *sender waits* flag. Each body sent in the
segment gets the next ticket (carried in its reference); the receiver that releases the
frame stores that ticket in the control block, and the sender sees the segment free the
next time it looks. Only a sender that found every segment busy sets the flag; a receiver
that sees it after storing the ticket also sends a RELEASE notice (name, offset, ticket)
over the socket, which wakes the sender. The two sides' store-then-load are not fenced, so
a waiting sender looks at the tickets again every ``RECHECK_S`` seconds as well: a missed
notice costs that long, never a hang. Memory sent by reference from :data:`exported`
(the server's published weights) has no ticket: its release is always a RELEASE notice,
since the sender holds the memory until then.

The package: :mod:`.segments` (the shared memory: segments, control blocks, progress words,
references), :mod:`.connection` (the asyncio side), :mod:`.blocking` (a learner without an
event loop), and here the transport (names, connect, listen).

Cleanup: every segment is owned (created and unlinked) by its sender; the receiver's
attach is unregistered from its resource tracker. If the owner is killed, Python's
resource tracker process unlinks its segments; if the peer is killed, the owner unlinks
them when the connection closes. Nothing is left in /dev/shm either way.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import socket
import ssl
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from ...errors import ConfigError
from ...wire import DEFAULT_TIMEOUT, Limits
from ..base import OnAccept, OnConnection, SharedMemory, Transport
from ..blocking import open_socket
from ..stream import StreamConnection, StreamListener, open_stream, start_listener
from .blocking import BlockingShmConnection
from .connection import ShmConnection
from .segments import exported

__all__ = ["BlockingShmConnection", "ShmConnection", "ShmTransport", "exported", "transport"]


_counter = itertools.count()


def _socket_path(name: str) -> str:
    return "\0rudra-async/" + name


def _name(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "shm":
        raise ConfigError(f"not a shm:// address: {url!r}")
    name = (parts.netloc + parts.path).strip("/")
    if len(name) > 80 or any(c in name for c in "\0/"):
        raise ConfigError(f"bad shm name {name!r}: at most 80 characters, no '/'")
    return name


def _server_name(url: str) -> str:
    """The server's name in a ``shm://NAME`` URL a learner connects to."""
    name = _name(url)
    if not name:
        raise ConfigError(f"{url!r} names no server; expected shm://NAME")
    return name


class ShmTransport(Transport):
    scheme = "shm"
    same_host = True

    def shared_memory(self) -> SharedMemory:
        return exported

    def fresh_address(self, host: str = "127.0.0.1") -> str:
        return "shm://"  # listen() picks a fresh name

    def connect_blocking(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> BlockingShmConnection:
        """A blocking connection to ``shm://NAME`` (same host; ``tls`` is never given: shm has
        none); ConnectError at once if nobody listens there, or after ``timeout``."""
        sock = open_socket(socket.AF_UNIX, _socket_path(_server_name(url)), url, timeout)
        return BlockingShmConnection(sock, limits, url)

    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits = Limits(), on_accept: OnAccept | None = None
    ) -> StreamListener:
        """Listen on ``shm://NAME`` (``shm://`` picks a fresh name). Same host only."""
        name = _name(url) or f"{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        loop = asyncio.get_running_loop()

        def serve(factory: Callable[[], StreamConnection]) -> Awaitable[asyncio.AbstractServer]:
            # bind the socket ourselves: libuv cannot name an abstract-namespace address
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(_socket_path(name))
            except OSError:
                sock.close()
                raise
            return loop.create_unix_server(factory, sock=sock)

        peer = f"shm://{name}#peer"
        listener = await start_listener(
            serve, url, on_connection, lambda on_made: ShmConnection(limits, peer=peer, on_made=on_made), on_accept
        )
        listener.address = f"shm://{name}"
        return listener

    async def connect(self, url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT) -> ShmConnection:
        name = _server_name(url)
        loop = asyncio.get_running_loop()

        async def open_socket() -> tuple[asyncio.BaseTransport, ShmConnection]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, _socket_path(name))
            except OSError:
                sock.close()
                raise
            return await loop.create_unix_connection(lambda: ShmConnection(limits, peer=url), sock=sock)

        conn = await open_stream(open_socket(), url, timeout)
        assert isinstance(conn, ShmConnection)
        return conn


transport = ShmTransport()

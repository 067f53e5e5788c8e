"""``unix:///path/to/socket``: frames over a Unix stream socket, a transport plugin.

Written from docs/transports.md alone: the stream-socket kit of
:mod:`rudra_async.transports.stream` (``connect_stream``, ``listen_stream``) and
:mod:`rudra_async.transports.blocking` (``connect_socket``) moves the frames; this module
says where the socket is and what the transport is (same host only: a server listening here
needs no secret; a fresh address is a new socket file).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import tempfile
from urllib.parse import urlsplit

from rudra_async.errors import ConfigError
from rudra_async.transports.base import OnAccept, OnConnection, Transport
from rudra_async.transports.blocking import BlockingConnection, connect_socket
from rudra_async.transports.stream import StreamConnection, StreamListener, connect_stream, listen_stream
from rudra_async.wire import DEFAULT_TIMEOUT, Limits

#: the longest socket path Linux takes (``sun_path`` is 108 bytes with its NUL)
MAX_PATH_BYTES = 107


def socket_path(url: str) -> str:
    """The absolute socket path of ``unix:///path`` (or ``unix:/path``); ConfigError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "unix" or parts.netloc or not parts.path.startswith("/"):
        raise ConfigError(f"not a unix:// address with an absolute path: {url!r} (e.g. unix:///tmp/rudra.sock)")
    if parts.query or parts.fragment:
        raise ConfigError(f"address {url!r} has more than a path")
    if len(os.fsencode(parts.path)) > MAX_PATH_BYTES:
        raise ConfigError(f"socket path of {url!r} is longer than {MAX_PATH_BYTES} bytes")
    return parts.path


class UnixTransport(Transport):
    scheme = "unix"
    same_host = True  # only processes on this host can open the socket file

    def fresh_address(self, host: str = "127.0.0.1") -> str:
        return f"unix://{tempfile.mkdtemp(prefix='rudra-unix-')}/server.sock"

    async def connect(
        self, url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT
    ) -> StreamConnection:
        path = socket_path(url)
        loop = asyncio.get_running_loop()
        return await connect_stream(
            lambda factory: loop.create_unix_connection(factory, path), url, limits=limits, timeout=timeout
        )

    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits = Limits(), on_accept: OnAccept | None = None
    ) -> StreamListener:
        path = socket_path(url)
        loop = asyncio.get_running_loop()
        listener = await listen_stream(
            lambda factory: loop.create_unix_server(factory, path),
            url,
            on_connection,
            limits=limits,
            on_accept=on_accept,
            on_close=lambda: _remove(path),
        )
        listener.address = f"unix://{path}"
        return listener

    def connect_blocking(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> BlockingConnection:
        return connect_socket(socket.AF_UNIX, socket_path(url), url, limits=limits, timeout=timeout)


def _remove(path: str) -> None:
    """The listener closed: its socket file goes (and the directory fresh_address made, if empty)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    if os.path.basename(os.path.dirname(path)).startswith("rudra-unix-"):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))


transport = UnixTransport()

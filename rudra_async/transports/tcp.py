"""TCP transport (``tcp://host:port``): frames over a TCP stream, see :mod:`.stream`."""

from __future__ import annotations

import asyncio
import ssl

from ..errors import ConnectError
from ..wire import Limits
from .base import OnAccept, OnConnection, Transport, format_host_port, parse_host_port
from .blocking import BlockingConnection, connect_tcp
from .stream import StreamConnection, StreamListener, open_stream, start_listener


def parse_url(url: str) -> tuple[str, int]:
    return parse_host_port(url, "tcp")


class TcpTransport(Transport):
    scheme = "tcp"
    supports_tls = True

    async def connect(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        tls_timeout: float = 10.0,
    ) -> StreamConnection:
        """Connect to a ``tcp://host:port`` URL (over TLS with ``tls``, the certificate checked
        against ``host``); fails within ``timeout`` with ConnectError."""
        host, port = parse_url(url)
        loop = asyncio.get_running_loop()
        opener = loop.create_connection(
            lambda: StreamConnection(limits),
            host,
            port,
            ssl=tls,
            server_hostname=host if tls else None,
            ssl_handshake_timeout=tls_timeout if tls else None,
        )
        try:
            return await open_stream(opener, url, timeout)
        except ConnectError as exc:
            raise _with_tls_hint(exc, host, tls) from None

    async def listen(
        self,
        url: str,
        on_connection: OnConnection,
        *,
        limits: Limits = Limits(),
        on_accept: OnAccept | None = None,
        tls: ssl.SSLContext | None = None,
        tls_timeout: float = 10.0,
    ) -> StreamListener:
        """Listen on a ``tcp://host:port`` URL (port 0 picks one), over TLS with ``tls``.
        Fails at once if it cannot bind."""
        host, port = parse_url(url)
        loop = asyncio.get_running_loop()
        listener = await start_listener(
            lambda factory: loop.create_server(
                factory, host, port, ssl=tls, ssl_handshake_timeout=tls_timeout if tls else None
            ),
            url,
            on_connection,
            lambda on_made: StreamConnection(limits, on_made=on_made),
            on_accept,
        )
        sockname = listener._server.sockets[0].getsockname()  # type: ignore[union-attr]
        listener.address = format_host_port("tcp", sockname[0], sockname[1])
        return listener

    def connect_blocking(
        self, url: str, *, limits: Limits = Limits(), timeout: float = 10.0, tls: ssl.SSLContext | None = None
    ) -> BlockingConnection:
        host, port = parse_url(url)
        try:
            return connect_tcp(host, port, url, limits, timeout, tls)
        except ConnectError as exc:
            raise _with_tls_hint(exc, host, tls) from None


def _with_tls_hint(exc: ConnectError, host: str, tls: ssl.SSLContext | None) -> ConnectError:
    """``exc`` itself, or over TLS the same failure with a hint at the usual cause."""
    if tls is None:
        return exc
    return ConnectError(f"{exc} (TLS: is the server using TLS, with a certificate for {host}?)")


transport = TcpTransport()

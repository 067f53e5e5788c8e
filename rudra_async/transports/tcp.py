"""TCP transport (``tcp://host:port``): frames over a TCP stream, see :mod:`.stream`.

Over TLS the listener accepts each connection itself and hands it to ``on_accept`` before
the TLS handshake, so a connection still in its handshake counts against the server's
limits and deadlines like any other (and is closed by them: its handshake is aborted).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from urllib.parse import urlsplit

from ..addresses import is_loopback_host
from ..errors import ConnectError, PeerGone
from ..logs import rate_limited
from ..wire import DEFAULT_TIMEOUT, Limits
from .base import OnAccept, OnConnection, Transport, format_host_port, parse_host_port
from .blocking import BlockingConnection, connect_tcp
from .stream import StreamConnection, StreamListener, open_stream, start_listener

log = rate_limited(logging.getLogger(__name__))  # a flood of connections provokes its messages

ACCEPT_RETRY_S = 0.1  # after accept failed (e.g. out of file descriptors), try again this much later


def parse_url(url: str) -> tuple[str, int]:
    return parse_host_port(url, "tcp")


class TcpTransport(Transport):
    scheme = "tcp"
    supports_tls = True

    def reaches_only_this_host(self, url: str) -> bool:
        return is_loopback_host(urlsplit(url).hostname or "")

    async def connect(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
        tls_timeout: float = DEFAULT_TIMEOUT,
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
        tls_timeout: float = DEFAULT_TIMEOUT,
    ) -> StreamListener:
        """Listen on a ``tcp://host:port`` URL (port 0 picks one), over TLS with ``tls``.
        Fails at once if it cannot bind."""
        host, port = parse_url(url)
        if tls is not None:
            listener = await _listen_tls(url, on_connection, limits, on_accept, tls, tls_timeout)
        else:
            loop = asyncio.get_running_loop()
            listener = await start_listener(
                lambda factory: loop.create_server(factory, host, port),
                url,
                on_connection,
                lambda on_made: StreamConnection(limits, on_made=on_made),
                on_accept,
            )
        sockname = listener.sockets[0].getsockname()
        listener.address = format_host_port("tcp", sockname[0], sockname[1])
        return listener

    def connect_blocking(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> BlockingConnection:
        host, port = parse_url(url)
        try:
            return connect_tcp(host, port, url, limits, timeout, tls)
        except ConnectError as exc:
            raise _with_tls_hint(exc, host, tls) from None


async def _listen_tls(
    url: str,
    on_connection: OnConnection,
    limits: Limits,
    on_accept: OnAccept | None,
    context: ssl.SSLContext,
    timeout: float,
) -> StreamListener:
    """A listener on ``url`` whose connections become TLS after ``on_accept`` has taken them."""
    listener = StreamListener(on_connection, on_accept)
    listener.attach(_TlsServer(await _bind(url), listener, limits, context, timeout))
    return listener


async def _bind(url: str) -> list[socket.socket]:
    """Listening sockets for every address ``url``'s host resolves to (as ``create_server``)."""
    host, port = parse_url(url)
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this host cannot open (no IPv6): skipped, as create_server does
                continue
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(100)
            sock.setblocking(False)
        if not socks:
            raise OSError(f"no address of {host!r} can be opened")
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise ConnectError(f"cannot listen on {url}: {exc.strerror or exc}") from None
    return socks


class _TlsServer:
    """Accepts on ``sockets``; each connection is handed to the listener's ``on_accept``, then
    its TLS handshake runs (within ``timeout`` s) in the task that serves it."""

    def __init__(
        self,
        sockets: list[socket.socket],
        listener: StreamListener,
        limits: Limits,
        context: ssl.SSLContext,
        timeout: float,
    ) -> None:
        self._sockets = sockets
        self._listener = listener
        self._limits = limits
        self._context = context
        self._timeout = timeout
        loop = asyncio.get_running_loop()
        self._accepting = [loop.create_task(self._accept(sock)) for sock in sockets]
        self._serving: set[asyncio.Task[None]] = set()  # until the listener's _serve has taken them

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._sockets)

    def close(self) -> None:
        """Stop accepting; connections not yet being served are dropped (the listener closes the others)."""
        for task in (*self._accepting, *self._serving):
            task.cancel()
        for sock in self._sockets:
            sock.close()

    async def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listening)
            except OSError as exc:  # out of descriptors, or a connection reset before it was taken
                log.warning("accepting a connection on %s failed: %s", self._listener.address, exc)
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            conn = StreamConnection(self._limits, peer=format_host_port("tcp", address[0], address[1]))
            arrival = _Arrival(sock)
            conn.abort_connecting = arrival.abort  # a close before or during the handshake ends it
            self._listener.accept(conn)
            if conn.is_closed:  # refused at once: no handshake
                continue
            ready = functools.partial(self._handshake, conn, arrival)
            task = loop.create_task(self._listener.serve(conn, accepted=True, ready=ready))
            self._serving.add(task)
            task.add_done_callback(self._serving.discard)
            await asyncio.sleep(0)  # sock_accept may not yield while connections wait: let the loop run

    async def _handshake(self, conn: StreamConnection, arrival: _Arrival) -> None:
        """Make ``conn`` TLS on its socket; PeerGone (and the connection lost) if that fails."""
        loop = asyncio.get_running_loop()
        arrival.handshaking = True
        try:
            await loop.connect_accepted_socket(
                lambda: conn, arrival.sock, ssl=self._context, ssl_handshake_timeout=self._timeout
            )
        except BaseException as exc:
            arrival.sock.close()
            if not isinstance(exc, Exception):
                raise
            lost = PeerGone(f"TLS handshake with {conn.peer} failed: {exc or type(exc).__name__}")
            conn._connection_lost(lost)
            raise lost from None
        finally:
            conn.abort_connecting = None


class _Arrival:
    """An accepted socket until its TLS connection is made: what closing the connection does to it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.handshaking = False

    def abort(self) -> None:
        """Close the socket, or during the handshake shut it down (the TLS layer then fails and
        closes it; closing the descriptor under it would not wake it)."""
        if not self.handshaking:
            self.sock.close()
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _with_tls_hint(exc: ConnectError, host: str, tls: ssl.SSLContext | None) -> ConnectError:
    """``exc`` itself, or over TLS the same failure with a hint at the usual cause."""
    if tls is None:
        return exc
    return type(exc)(f"{exc} (TLS: is the server using TLS, with a certificate for {host}?)")


transport = TcpTransport()

"""TCP transport (``tcp://host:port``): frames over a TCP stream, see :mod:`.stream`."""

from __future__ import annotations

import asyncio

from ..wire import Limits
from .base import OnConnection, Transport, format_host_port, parse_host_port
from .blocking import BlockingConnection, connect_tcp
from .stream import StreamConnection, StreamListener, open_stream, start_listener


def parse_url(url: str) -> tuple[str, int]:
    return parse_host_port(url, "tcp")


class TcpTransport(Transport):
    scheme = "tcp"

    async def connect(self, url: str, *, limits: Limits = Limits(), timeout: float = 10.0) -> StreamConnection:
        """Connect to a ``tcp://host:port`` URL; fails within ``timeout`` with ConnectError."""
        host, port = parse_url(url)
        loop = asyncio.get_running_loop()
        return await open_stream(loop.create_connection(lambda: StreamConnection(limits), host, port), url, timeout)

    async def listen(self, url: str, on_connection: OnConnection, *, limits: Limits = Limits()) -> StreamListener:
        """Listen on a ``tcp://host:port`` URL (port 0 picks one). Fails at once if it cannot bind."""
        host, port = parse_url(url)
        loop = asyncio.get_running_loop()
        listener = await start_listener(
            lambda factory: loop.create_server(factory, host, port),
            url,
            on_connection,
            lambda on_made: StreamConnection(limits, on_made=on_made),
        )
        sockname = listener._server.sockets[0].getsockname()  # type: ignore[union-attr]
        listener.address = format_host_port("tcp", sockname[0], sockname[1])
        return listener

    def connect_blocking(self, url: str, *, limits: Limits = Limits(), timeout: float = 10.0) -> BlockingConnection:
        host, port = parse_url(url)
        return connect_tcp(host, port, url, limits, timeout)


transport = TcpTransport()

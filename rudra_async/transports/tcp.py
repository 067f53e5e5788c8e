"""TCP transport (``tcp://host:port``): frames over a TCP stream, see :mod:`.stream`."""
from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..wire import Limits
from .base import OnConnection
from .stream import StreamConnection, StreamListener, open_stream, protocol_factory, start_listener

IN_PROCESS = False


def parse_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "tcp":
        raise ConfigError(f"not a tcp:// address: {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"address {url!r} needs a host and a port, e.g. tcp://127.0.0.1:7000")
    return parts.hostname, port


def format_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def connect(url: str, *, limits: Limits = Limits(), timeout: float = 10.0) -> StreamConnection:
    """Connect to a ``tcp://host:port`` URL; fails within ``timeout`` with ConnectError."""
    host, port = parse_url(url)
    loop = asyncio.get_running_loop()
    return await open_stream(loop.create_connection(protocol_factory(limits), host, port), url, timeout)


async def listen(url: str, on_connection: OnConnection, *, limits: Limits = Limits()) -> StreamListener:
    """Listen on a ``tcp://host:port`` URL (port 0 picks one). Fails at once if it cannot bind."""
    host, port = parse_url(url)
    loop = asyncio.get_running_loop()
    listener = await start_listener(lambda factory: loop.create_server(factory, host, port), url, on_connection, limits)
    sockname = listener._server.sockets[0].getsockname()  # type: ignore[union-attr]
    listener.address = format_url(sockname[0], sockname[1])
    return listener

"""Transports by URL scheme: built-ins from a table, third parties by entry point.

A transport is a :class:`~rudra_async.transports.base.Transport` instance; see
:mod:`rudra_async.transports.base` for the contract. Third-party transports register
under the entry-point group ``rudra_async.transports`` with the URL scheme as the name.
"""

from __future__ import annotations

import importlib
import ssl
from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError
from ..registry import entry_points, load_entry_point
from ..wire import DEFAULT_TIMEOUT, Limits
from .base import Connection, Listener, OnAccept, OnConnection, SharedMemory, Transport
from .blocking import BlockingConnection

BUILTIN = {
    "tcp": "rudra_async.transports.tcp",
    "memory": "rudra_async.transports.memory",
    "shm": "rudra_async.transports.shm",
}
ENTRY_POINT_GROUP = "rudra_async.transports"

__all__ = [
    "Connection",
    "Listener",
    "SharedMemory",
    "Transport",
    "connect",
    "connect_blocking",
    "is_loopback",
    "known_schemes",
    "listen",
    "transport_for",
]


def known_schemes() -> list[str]:
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def transport_for(url: str) -> Transport:
    """The transport for ``url``'s scheme; a ConfigError names the known schemes, or the
    plugin that registered something other than a :class:`Transport`."""
    try:
        scheme = urlsplit(url).scheme
    except ValueError as exc:  # e.g. an unclosed [IPv6 bracket
        raise ConfigError(f"address {url!r} is not a URL: {exc}") from None
    if not scheme:
        raise ConfigError(f"address {url!r} has no scheme; expected e.g. tcp://127.0.0.1:7000")
    found: Any = load_entry_point(ENTRY_POINT_GROUP, scheme, "transport")
    if found is None and scheme in BUILTIN:  # running from a source tree that was never installed
        found = importlib.import_module(BUILTIN[scheme]).transport
    if found is None:
        raise ConfigError(f"no transport for scheme {scheme!r} in {url!r}; known: {', '.join(known_schemes())}")
    if not isinstance(found, Transport):
        raise ConfigError(
            f"the transport registered for {scheme!r} is not a rudra_async.transports.base.Transport "
            f"instance (got {type(found).__name__}); register an instance, e.g. 'my_package:transport'"
        )
    return found


def is_loopback(url: str) -> bool:
    """True when only this host can reach ``url``, as its transport declares
    (:meth:`Transport.reaches_only_this_host`): a tcp address on a loopback host or
    ``localhost``, any address of a same-host transport (``shm``, ``memory``, a plugin that
    sets ``same_host``). UCX listens on every interface whatever the host: never loopback."""
    return transport_for(url).reaches_only_this_host(url)


def _tls_options(transport: Transport, url: str, tls: ssl.SSLContext | None, timeout: float) -> dict[str, Any]:
    if tls is None:
        return {}
    if not transport.supports_tls:
        raise ConfigError(f"TLS is for tcp:// addresses; {url} cannot use it")
    return {"tls": tls, "tls_timeout": timeout}


async def connect(
    url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT, tls: ssl.SSLContext | None = None
) -> Connection:
    """Connect to ``url`` (with ``tls``, an ``ssl.SSLContext``, over TLS: tcp only)."""
    transport = transport_for(url)
    return await transport.connect(url, limits=limits, timeout=timeout, **_tls_options(transport, url, tls, timeout))


def connect_blocking(
    url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT, tls: ssl.SSLContext | None = None
) -> BlockingConnection | None:
    """A blocking connection to ``url`` (see :meth:`~.base.Transport.connect_blocking`), or
    None when its transport has none; ``tls`` as for :func:`connect` (tcp only)."""
    transport = transport_for(url)
    options = _tls_options(transport, url, tls, timeout)
    return transport.connect_blocking(url, limits=limits, timeout=timeout, tls=options.get("tls"))


async def listen(
    url: str,
    on_connection: OnConnection,
    *,
    limits: Limits = Limits(),
    on_accept: OnAccept | None = None,
    tls: ssl.SSLContext | None = None,
    tls_timeout: float = DEFAULT_TIMEOUT,
) -> Listener:
    """Listen on ``url``; ``on_accept(conn)`` runs for each accepted connection before any
    of its bytes is parsed (see :meth:`~.base.Transport.listen`); with ``tls`` (tcp only)
    connections are TLS, each handshake given ``tls_timeout`` seconds."""
    transport = transport_for(url)
    options: dict[str, Any] = _tls_options(transport, url, tls, tls_timeout)
    if on_accept is not None:
        options["on_accept"] = on_accept
    return await transport.listen(url, on_connection, limits=limits, **options)

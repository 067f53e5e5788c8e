"""The transport contract: move whole frames between two endpoints.

A transport is an instance of :class:`Transport` with two coroutines::

    async def connect(url, *, limits: Limits, timeout: float) -> Connection
    async def listen(url, on_connection, *, limits: Limits) -> Listener

registered under the entry-point group ``rudra_async.transports`` with its URL scheme as
the name (``myscheme = "my_package:transport"``). Everything above this layer speaks frames (:mod:`rudra_async.wire`), never bytes.

Contract, for every transport:

- **Framing is the transport's job.** ``send`` takes a message type, a metadata map and
  arrays; ``recv`` returns a :class:`~rudra_async.wire.Frame` with the same type, metadata
  (plus its ``seg`` list) and arrays of the same dtypes, shapes and bytes. How the bytes
  travel (one stream, segments in shared memory, UCX messages) is the transport's own.
- **Ordering.** Frames arrive in the order they were sent on that connection. Concurrent
  ``send`` calls on one connection never interleave the parts of two frames.
- **Ownership.** ``send`` returns once the arrays may be modified by the caller again.
  A received frame's ``body`` (and ``arrays``) stays valid until ``frame.release()``; a
  transport may recycle the memory after that, so consumers release promptly, and a
  transport that lends memory (shared memory) must not let it change before the release.
- **Back-pressure.** A transport bounds what it buffers: a receiver that does not consume
  eventually makes ``send`` wait on the other side; nothing grows without limit.
- **Size limits.** Bodies up to ``limits.max_body`` (8 GiB by default; 64-bit lengths,
  no 2 GB cliff) and metadata up to ``limits.max_meta`` must work; larger ones are refused
  with :class:`~rudra_async.errors.FrameTooLarge`, by the sender before sending and by
  the receiver before allocating.
- **Errors.** :class:`~rudra_async.errors.PeerGone` when the peer closed or died or the
  link broke — including in the middle of a frame, which is never delivered in part;
  :class:`~rudra_async.errors.ConnectionClosed` for any use after a local ``close``; a
  fatal :class:`~rudra_async.errors.WireError` from ``recv`` when the incoming bytes are
  not valid framing (the connection is unusable after it); ``ConnectError`` from
  ``connect``/``listen`` at once for a refused connection or a busy address (never a hang:
  ``connect`` gives up after ``timeout``). No foreign exception escapes.
- **Close.** ``close`` is idempotent, never raises, and makes the peer's ``recv`` raise
  ``PeerGone``. ``Listener.close`` stops accepting, closes every accepted connection and
  waits for their handlers. A listener accepts new connections after old ones closed
  (reconnect).

:func:`rudra_async.testing.check_transport` checks all of this against a live transport.
"""
from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any, Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import numpy as np

from ..errors import ConfigError, RudraError
from ..wire import Allocator, Frame, Limits

log = logging.getLogger(__name__)


class Connection(abc.ABC):
    """One bidirectional, ordered stream of frames (see the module docstring for the contract)."""

    peer: str = "?"
    #: optional hook choosing where a received body goes (see ``wire.Allocator``); a
    #: transport that hands out bodies in place (shared memory) may ignore it
    allocator: Allocator | None = None

    @abc.abstractmethod
    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one frame; returns when the arrays may be reused. Raises PeerGone/ConnectionClosed."""

    @abc.abstractmethod
    async def recv(self) -> Frame:
        """The next frame, in order. Raises PeerGone, ConnectionClosed or a fatal WireError."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close this end. Idempotent; never raises."""

    @property
    @abc.abstractmethod
    def is_closed(self) -> bool:
        """True after a local close or once the peer is known to be gone."""

    @abc.abstractmethod
    async def wait_lost(self) -> None:
        """Return once the connection is closed (locally) or lost (peer gone), without reading.

        Lets a server notice a learner's death while it waits on something else.
        """


class SharedMemory(abc.ABC):
    """Memory a transport can send without copying (a capability of same-host transports).

    A server listening on such a transport allocates its published weight buffers here, so
    a pull moves a reference and the learner makes the one copy into its model."""

    @abc.abstractmethod
    def allocate(self, nbytes: int) -> np.ndarray:
        """A writable byte buffer of ``nbytes`` that this transport sends by reference."""

    @abc.abstractmethod
    def free(self, array: np.ndarray) -> None:
        """Give back memory from :meth:`allocate`; views stay readable."""


class Transport(abc.ABC):
    """How frames move for one URL scheme. An instance is registered under the entry-point
    group ``rudra_async.transports`` with the scheme as its name.

    Optional capabilities have defaults here, so callers never probe with ``getattr``:

    - ``in_process``: True when only the listening process itself can connect (no second
      process can reach it; e.g. ``memory://``). The conformance suite then skips the
      crash check and ``train`` refuses it for learner processes.
    - :meth:`shared_memory`: memory this transport sends without copying, or None.
    """

    scheme: str = ""
    in_process: bool = False

    @abc.abstractmethod
    async def connect(self, url: str, *, limits: Limits, timeout: float) -> "Connection":
        """Connect to ``url``; ConnectError at once if refused, or after ``timeout`` seconds."""

    @abc.abstractmethod
    async def listen(self, url: str, on_connection: "OnConnection", *, limits: Limits) -> "Listener":
        """Listen on ``url``; ConnectError at once if it cannot (e.g. the address is in use)."""

    def shared_memory(self) -> SharedMemory | None:
        """Memory this transport sends by reference (see :class:`SharedMemory`), or None."""
        return None


class Listener(abc.ABC):
    """Accepts connections and hands each to the ``on_connection`` coroutine given to ``listen``;
    the connection is closed when that coroutine returns."""

    #: the URL peers can connect to (with the real port or name when 0 or none was asked for)
    address: str

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting, close every accepted connection, wait for their handlers. Idempotent."""


OnConnection = Callable[[Connection], Awaitable[None]]


class ServingListener(Listener):
    """A listener that runs ``on_connection`` once per accepted connection and closes the
    connection when it returns; subclasses only accept (``_spawn`` or ``await _serve``)
    and stop accepting (``_stop_accepting``)."""

    def __init__(self, on_connection: OnConnection) -> None:
        self._on_connection = on_connection
        self._conns: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    def _spawn(self, conn: Connection) -> None:
        """Serve ``conn`` in a task of its own."""
        asyncio.get_running_loop().create_task(self._serve(conn))

    async def _serve(self, conn: Connection) -> None:
        """Serve ``conn`` in the current task (for transports that call back in a task)."""
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(conn)
        self._tasks.add(task)
        try:
            await self._on_connection(conn)
        except (RudraError, asyncio.CancelledError):
            pass
        except Exception:  # a handler bug must not take the listener down
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            conn.close()
            self._conns.discard(conn)
            self._tasks.discard(task)

    def _stop_accepting(self) -> None:
        """Stop taking new connections (the subclass's server object)."""

    async def close(self) -> None:
        self._stop_accepting()
        for conn in list(self._conns):
            conn.close()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def parse_host_port(url: str, scheme: str) -> tuple[str, int]:
    """``scheme://host:port`` (IPv6 in brackets) → (host, port), or a ConfigError saying why."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ConfigError(f"not a {scheme}:// address: {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"bad port in {url!r}") from None
    if not parts.hostname or port is None:
        raise ConfigError(f"address {url!r} needs a host and a port, e.g. {scheme}://127.0.0.1:7000")
    return parts.hostname, port


def format_host_port(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

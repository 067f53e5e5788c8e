"""The transport contract: move whole frames between two endpoints.

A transport is an instance of :class:`Transport` with two coroutines::

    async def connect(url, *, limits: Limits, timeout: float) -> Connection
    async def listen(url, on_connection, *, limits: Limits) -> Listener

registered under the entry-point group ``rudra_async.transports`` with its URL scheme as
the name (``myscheme = "my_package:transport"``). Everything above this layer speaks
frames (:mod:`rudra_async.wire`), never bytes.

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
  eventually makes ``send`` wait on the other side; nothing grows without limit; and the
  waiting ``send`` completes once the receiver consumes again.
- **Size limits.** Bodies up to ``limits.max_body`` (8 GiB by default; 64-bit lengths,
  no 2 GB cliff) and metadata up to ``limits.max_meta`` must work; larger ones are refused
  with :class:`~rudra_async.errors.FrameTooLarge`, by the sender before sending (no byte
  of the frame goes out) and by the receiver before allocating (a fatal error).
- **Errors.** :class:`~rudra_async.errors.PeerGone` when the peer closed or died or the
  link broke — including in the middle of a frame, which is never delivered in part;
  :class:`~rudra_async.errors.ConnectionClosed` for any use after a local ``close``,
  also for a ``recv`` already waiting; a fatal :class:`~rudra_async.errors.WireError`
  from ``recv`` when the incoming bytes are not valid framing (the connection is unusable
  after it); ``ConnectError`` from ``connect``/``listen`` at once for a refused connection
  or a busy address (never a hang: ``connect`` gives up after ``timeout``). No foreign
  exception escapes.
- **Close.** ``close`` is idempotent, never raises, and makes the peer's ``recv`` raise
  ``PeerGone``. ``Listener.close`` stops accepting, closes every accepted connection and
  waits for their handlers. A listener accepts new connections after old ones closed
  (reconnect).

What :class:`Connection` does for a transport: the life cycle and the inbox. ``recv``,
``close``, ``is_closed`` and ``wait_lost`` are implemented once, here, over an I/O-free
:class:`~.core.ConnectionCore` (:attr:`Connection.core`, which the blocking connection keeps
too); a transport
implements only ``send`` and ``_close_link`` (how its link closes), and reports what
arrives through the subclass API:

- ``admit(header)`` and ``allocator(...)``, hooks a user of the connection may set (the
  server does, from the moment a connection is accepted): a transport builds its readers
  with ``FrameReader(limits, self._allocate, admit=self._admit)`` so both apply from the
  first byte; a transport that resolves bodies itself (shared memory) calls
  ``self._admit(header)`` before touching a body.
- ``_deliver(frame_or_fatal_error)`` queues a frame in the bounded inbox and wakes
  ``recv`` (a frame that finds the inbox empty is first offered to
  :attr:`Connection.express`); a fatal :class:`~rudra_async.errors.WireError` (then in
  ``core.fatal``) is raised by every later ``recv`` (until the peer is known to be gone:
  then once more, and ``PeerGone`` after it), and nothing after it is queued.
  ``_advance(reader, n)`` does this for bytes written into a
  :class:`~rudra_async.wire.FrameReader` (``FrameReader(limits, self._allocate)``
  honours :attr:`Connection.allocator`).
- ``_connection_lost(PeerGone(...))``: the link broke or the peer closed; ``recv`` raises
  it once the frames before it were consumed. ``_check_open()`` raises ConnectionClosed
  or that PeerGone (call it in ``send``).
- Back-pressure: the inbox is full at ``_inbox_frames`` frames (8) or ``_inbox_bytes``
  bytes of bodies (no limit), class attributes a transport may change. While
  ``_inbox_full`` the transport stops taking frames: a stream pauses reading, a
  message-based transport stops posting receives (``await self._inbox_room()``, False
  once the connection takes nothing more), an in-process sender waits on its peer's.
  ``_on_consumed()`` is called after ``recv`` took a frame (e.g. to resume reading).
- Optionally ``nowait_room(body_bytes)`` and ``send_nowait(...)``: sending a frame from a
  callback, without awaiting (a stream does when its write buffer is empty); the default
  is "never", and ``send`` is all a transport must have.
- Optionally ``sends_computing(body_bytes)`` and ``send_computing(..., gate)``: sending a
  body another thread is still computing, each byte once ``gate`` says it is final (a
  stream whose sender thread writes the frame); the default is "never".
- Traffic: :attr:`Connection.bytes_in` counts what ``_advance`` reads; a transport passes
  each encoded frame through ``_sending(parts)`` (counted in :attr:`Connection.bytes_out`)
  and adds bytes that move outside the frames (a body in shared memory) itself.

Optional capabilities of a :class:`Transport` have defaults: ``in_process`` (no second
process can reach it) and :meth:`Transport.shared_memory` (memory it sends by reference).

:func:`rudra_async.testing.check_transport` checks all of this against a live transport.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..addresses import format_host_port as format_host_port
from ..addresses import parse_host_port as parse_host_port
from ..bodies import BodyBudget, BodyLease
from ..errors import PeerGone, RudraError, TransportError, WireError
from ..wire import Admit, Allocator, Frame, FrameReader, Header, Limits
from .core import ConnectionCore, collect

if TYPE_CHECKING:
    from .blocking import BlockingConnection
    from .offload import Gate

log = logging.getLogger(__name__)
T = TypeVar("T")

#: a TCP link that stays silent this long (keepalive probes unanswered, or data sent and not
#: acknowledged) breaks the connection on both ends, so that a cut cable is an error (and a
#: learner's --reconnect starts) within seconds rather than TCP's ~15 minutes
LINK_TIMEOUT_S = 15
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S = 5, 2


def tune_tcp(sock: socket.socket) -> None:
    """A TCP socket's options: TCP_NODELAY, and the dead-link detection of
    :data:`LINK_TIMEOUT_S` (keepalive probes after :data:`KEEPALIVE_IDLE_S` of silence,
    every :data:`KEEPALIVE_INTERVAL_S`, and TCP_USER_TIMEOUT) where the platform has them."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probes = (LINK_TIMEOUT_S - KEEPALIVE_IDLE_S) // KEEPALIVE_INTERVAL_S
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", probes), ("TCP_USER_TIMEOUT", LINK_TIMEOUT_S * 1000)):  # fmt: skip
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Connection(abc.ABC):
    """One bidirectional, ordered stream of frames (see the module docstring for the contract).

    The life cycle is implemented here once; a transport implements :meth:`send` and
    :meth:`_close_link`, calls ``super().__init__(peer)``, and feeds what arrives through
    :meth:`_deliver` (or :meth:`_advance` with a :class:`~rudra_async.wire.FrameReader`)
    and :meth:`_connection_lost`. Methods and attributes with one underscore are this
    subclass API; everything else is for users.
    """

    peer: str = "?"
    #: optional hook choosing where a received body goes (see ``wire.Allocator``); a
    #: transport that hands out bodies in place (shared memory) may ignore it
    allocator: Allocator | None = None
    #: optional hook checking each incoming header before anything of its frame is
    #: allocated (see ``wire.Admit``); a server sets it when the connection is accepted
    admit: Admit | None = None
    #: optional budget of large bodies shared with other connections (a server's: see
    #: :mod:`rudra_async.bodies`); honoured by stream transports, ignored by the others
    bodies: BodyBudget | None = None
    #: optional hook offered each received frame that finds the inbox empty, from the
    #: transport's callback: True means it took (and answered) the frame, which is then not
    #: queued; False queues it as usual. A server sets it only while it waits in ``recv``.
    express: Callable[[Frame], bool] | None = None
    #: the inbox is full at this many unconsumed frames ...
    _inbox_frames: int = 8
    #: ... or this many bytes of unconsumed bodies, whichever comes first (one frame is always taken)
    _inbox_bytes: int = sys.maxsize

    def __init__(self, peer: str = "?") -> None:
        """Needs a running event loop."""
        self.peer = peer
        #: the inbox, how the connection ended, the byte counts (no I/O: see :mod:`.core`)
        self.core = ConnectionCore(self._inbox_frames, self._inbox_bytes)
        self.__arrived = asyncio.Event()  # set when the inbox changed or the connection ended
        self.__room = asyncio.Event()  # set when the inbox has room again or the connection ended
        #: close by half-closing and discarding the peer's input for a while (not a reset, which
        #: would destroy a last reply still on its way): after a fatal error, or :meth:`hang_up`
        self._linger = False
        self.__ended = asyncio.get_running_loop().create_future()  # done once closed or lost

    # -- the user API ------------------------------------------------------------------------
    @abc.abstractmethod
    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one frame; returns when the arrays may be reused. Raises PeerGone/ConnectionClosed,
        or FrameTooLarge (before sending anything) when the frame exceeds the limits."""

    async def recv(self) -> Frame:
        """The next frame, in order. Raises PeerGone, ConnectionClosed or a fatal WireError
        (again on every later call, until the peer is known to be gone: see :mod:`.core`)."""
        while (frame := self.core.next()) is None:
            self.__arrived.clear()
            await self.__arrived.wait()
        if not self._inbox_full:
            self.__room.set()
        self._on_consumed()
        return frame

    async def within(self, operation: Awaitable[T], timeout: float) -> T:
        """``operation`` (on this connection) with a deadline of ``timeout`` seconds; TimeoutError past it."""
        return await asyncio.wait_for(operation, timeout)

    @property
    def bytes_in(self) -> int:
        """Bytes received: the frames as they travel (header, metadata, body)."""
        return self.core.bytes_in

    @bytes_in.setter
    def bytes_in(self, value: int) -> None:
        self.core.bytes_in = value

    @property
    def bytes_out(self) -> int:
        """Bytes sent, counted as :attr:`bytes_in`."""
        return self.core.bytes_out

    @bytes_out.setter
    def bytes_out(self, value: int) -> None:
        self.core.bytes_out = value

    def close(self) -> None:
        """Close this end. Idempotent; never raises."""
        if not self.core.close():  # first: nothing the link reports while it closes is taken
            return
        # hooks refer back to their owner: no cycle outlives the close
        self.allocator = self.admit = self.express = None
        try:
            self._close_link()
        except Exception:  # the contract: close never raises
            log.debug("closing the link to %s failed", self.peer, exc_info=True)
        self._end()

    def tell(self, msg_type: int, meta: dict[str, Any]) -> bool:
        """Send one small frame without a body where it can be sent at once (True), else
        nothing (False). Never raises: for a best-effort notice."""
        try:
            if self.nowait_room(0):
                self.send_nowait(msg_type, meta)
                return True
        except RudraError:
            pass
        return False

    def hang_up(self, msg_type: int, meta: dict[str, Any]) -> None:
        """:meth:`tell` the peer one last frame (an ERROR saying why) and close so that it
        reaches the peer even if the peer is still sending (where the transport can: a
        half-close and a little while of discarded input, not a reset). Never raises."""
        self._linger = self.tell(msg_type, meta)
        self.close()

    def nowait_room(self, body_bytes: int) -> bool:
        """Whether :meth:`send_nowait` can send a frame with a body of ``body_bytes`` now.
        Default: False (the transport sends only with :meth:`send`)."""
        return False

    def send_nowait(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one frame without waiting; only right after :meth:`nowait_room` said True
        for its body (no ``await`` in between). The transport may read the arrays after
        this returns, so pass arrays nobody changes. Raises as :meth:`send` does."""
        raise NotImplementedError(f"{type(self).__name__} sends only with send()")

    def sends_computing(self, body_bytes: int) -> bool:
        """Whether :meth:`send_computing` can send a frame with a body of ``body_bytes``
        now. Default: False (the transport sends only finished bodies)."""
        return False

    async def send_computing(
        self, msg_type: int, meta: dict[str, Any] | None, arrays: Sequence[np.ndarray], gate: Gate
    ) -> None:
        """:meth:`send` a frame whose body is still being computed by another thread: each
        byte is written once ``gate`` says it is final. Only right after
        :meth:`sends_computing` said True for its body (no ``await`` in between)."""
        raise NotImplementedError(f"{type(self).__name__} sends only finished bodies")

    @property
    def is_closed(self) -> bool:
        """True after a local close or once the peer is known to be gone."""
        return self.core.ended

    async def wait_lost(self) -> None:
        """Return once the connection is closed (locally) or lost (peer gone), without reading.

        Lets a server notice a learner's death while it waits on something else. A
        transport notices a lost peer while it reads, so with a full inbox (nobody
        consuming) it may notice only once frames are consumed.
        """
        await asyncio.shield(self.__ended)

    # -- the subclass API --------------------------------------------------------------------
    @abc.abstractmethod
    def _close_link(self) -> None:
        """Close the underlying link (called once, by :meth:`close`); the peer then sees PeerGone."""

    def _deliver(self, item: Frame | WireError) -> None:
        """Queue a received frame, or a fatal framing error after which nothing more is
        queued, and wake ``recv``. Never refuses: the transport stops taking frames while
        :attr:`_inbox_full`. Frames arriving after a close or a fatal error are dropped."""
        core = self.core
        if isinstance(item, Frame) and core.accepting and not core.inbox:
            express = self.express
            if express is not None and express(item):
                return
        if core.queue(item):
            self.__arrived.set()

    def _advance(self, reader: FrameReader, nbytes: int) -> None:
        """Report ``nbytes`` written into ``reader.get_buffer()``; deliver the frames it
        completes, then the fatal error it raises."""
        for item in self.core.read(reader, nbytes):
            self._deliver(item)

    def _resume_body(self, reader: FrameReader, lease: BodyLease) -> None:
        """Hand ``reader``'s waiting body ``lease``'s buffer; deliver the frames the bytes read
        meanwhile complete, then the fatal error they raise."""
        for item in collect(lambda: reader.resume(lease)):
            self._deliver(item)

    def _sending(self, parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
        """Count an encoded frame (``wire.encode_frame``'s or ``encode_messages``' buffers) as
        sent, and return it."""
        self.core.sending(parts)
        return parts

    def _allocate(self, msg_type: int, meta: dict[str, Any], nbytes: int) -> memoryview | None:
        """:attr:`allocator` as a ``FrameReader``'s ``allocate`` (it may be set at any time)."""
        return self.allocator(msg_type, meta, nbytes) if self.allocator is not None else None

    def _admit(self, header: Header) -> None:
        """:attr:`admit` as a ``FrameReader``'s ``admit`` (it may be set at any time)."""
        if self.admit is not None:
            self.admit(header)

    def _connection_lost(self, reason: PeerGone) -> None:
        """The link broke or the peer closed: ``recv`` raises ``reason`` once the inbox is
        empty, ``send`` raises it at once. Idempotent (the first reason stays)."""
        self.core.lose(reason)
        self._end()

    def _check_open(self) -> None:
        """Raise ConnectionClosed after a local close, or the PeerGone that ended the connection."""
        self.core.check_open()

    @property
    def _inbox_full(self) -> bool:
        """True while the transport must not take more frames (see ``_inbox_frames``)."""
        return self.core.full

    @property
    def _taking(self) -> bool:
        """False once the connection takes no more frames (closed, lost, or a fatal error)."""
        return self.core.taking

    async def _inbox_room(self) -> bool:
        """Wait while the inbox is full. True once there is room, False if not :attr:`_taking`."""
        while self._inbox_full and self._taking:
            self.__room.clear()
            await self.__room.wait()
        return self._taking

    def _on_consumed(self) -> None:  # noqa: B027 (an optional hook, not an abstract method)
        """Hook: ``recv`` took a frame out of the inbox (e.g. resume reading). Default: nothing."""

    def _end(self) -> None:
        """Closed or lost: wake every waiter."""
        self.__arrived.set()
        self.__room.set()
        if not self.__ended.done():
            self.__ended.set_result(None)


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
    - ``supports_tls``: ``connect``/``listen`` accept ``tls=ssl_context`` (``tcp`` does).
    - :meth:`connect_blocking`: a blocking connection for code without an event loop (the
      blocking client uses it, and otherwise drives the asyncio one), or None.
    - ``same_host``: True when only processes on this host can connect (shared memory, a
      Unix socket): a server listening there needs no secret (:meth:`reaches_only_this_host`).
    - :meth:`fresh_address`: an address no other listener uses, for a run's own server and
      for the conformance suite's second listener.
    """

    scheme: str = ""
    in_process: bool = False
    #: True when only processes on this host can connect to any of this transport's addresses
    same_host: bool = False
    #: True when ``connect`` and ``listen`` take ``tls=`` (an ``ssl.SSLContext``) and
    #: ``tls_timeout=`` (seconds for the TLS handshake)
    supports_tls: bool = False

    @abc.abstractmethod
    async def connect(self, url: str, *, limits: Limits, timeout: float) -> Connection:
        """Connect to ``url``; ConnectError at once if refused, or after ``timeout`` seconds."""

    @abc.abstractmethod
    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits, on_accept: OnAccept | None = None
    ) -> Listener:
        """Listen on ``url``; ConnectError at once if it cannot (e.g. the address is in use).
        ``on_accept(conn)`` runs synchronously for each accepted connection before any of
        its bytes is parsed (``ServingListener`` does this), then ``on_connection(conn)``."""

    def shared_memory(self) -> SharedMemory | None:
        """Memory this transport sends by reference (see :class:`SharedMemory`), or None."""
        return None

    def reaches_only_this_host(self, url: str) -> bool:
        """True when only this host can connect to ``url`` (a server listening there without
        a secret is then not exposed); by default ``same_host``. ``tcp`` says so for a
        loopback host; a transport that cannot tell must say False."""
        return self.same_host

    def fresh_address(self, host: str = "127.0.0.1") -> str:
        """An address to listen on, on ``host`` where the transport has hosts, that no other
        listener uses: by default ``scheme://host:0`` (the system picks a free port)."""
        return format_host_port(self.scheme, host, 0)

    def connect_blocking(
        self, url: str, *, limits: Limits, timeout: float, tls: ssl.SSLContext | None = None
    ) -> BlockingConnection | None:
        """A blocking connection to ``url`` (see :mod:`rudra_async.transports.blocking`), over
        TLS with ``tls`` where the transport supports it, or None when it has none."""
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
#: called once per accepted connection, synchronously, before any byte from it is parsed
#: (it may set the connection's ``admit``/``allocator`` hooks, or close it at once)
OnAccept = Callable[[Connection], None]


class ServingListener(Listener):
    """A listener that runs ``on_connection`` once per accepted connection and closes the
    connection when it returns; subclasses only hand over each accepted connection (:meth:`spawn`, or ``await``
    :meth:`serve`) and stop accepting (:meth:`stop_accepting`); its own state is private
    (name-mangled), so a subclass may use any attribute name. ``on_accept`` runs first, synchronously:
    a subclass hands a connection over before reading from it."""

    def __init__(self, on_connection: OnConnection, on_accept: OnAccept | None = None) -> None:
        self.__on_connection = on_connection
        self.__on_accept = on_accept
        self.__conns: set[Connection] = set()
        self.__tasks: set[asyncio.Task[None]] = set()
        self.address = ""

    def spawn(self, conn: Connection) -> None:
        """Serve ``conn`` in a task of its own (``on_accept`` runs now, before this returns)."""
        self.accept(conn)
        asyncio.get_running_loop().create_task(self.serve(conn, accepted=True))

    def accept(self, conn: Connection) -> None:
        """Run ``on_accept`` for ``conn`` now (:meth:`spawn` and :meth:`serve` do, unless told it ran)."""
        if self.__on_accept is not None:
            try:
                self.__on_accept(conn)
            except Exception:  # a hook bug must not take the listener down
                log.exception("accepting %s failed", conn.peer)
                conn.close()

    async def serve(
        self, conn: Connection, *, accepted: bool = False, ready: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Serve ``conn`` in the current task (for transports that call back in a task);
        call it before the connection reads anything, so that ``on_accept`` comes first.
        ``ready()``, awaited first, completes the connection (e.g. a TLS handshake); if it
        fails, or is cancelled, the connection is lost and ``on_connection`` still runs (it
        learns so at its first receive), so whatever ``on_accept`` set up ends with it."""
        if not accepted:
            self.accept(conn)
        task = asyncio.current_task()
        assert task is not None
        self.__conns.add(conn)
        self.__tasks.add(task)
        try:
            if conn.is_closed:  # refused by on_accept
                return
            if ready is not None:
                try:
                    await ready()
                except RudraError:
                    pass
                except asyncio.CancelledError:
                    conn.close()
                    await self.__on_connection(conn)  # returns at once: the connection is closed
                    raise
            await self.__on_connection(conn)
        except asyncio.CancelledError:
            pass
        except RudraError as exc:  # the handler gave the connection up: say why
            _log_given_up(conn, exc)
        except Exception:  # a handler bug must not take the listener down
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            conn.close()
            self.__conns.discard(conn)
            self.__tasks.discard(task)

    def stop_accepting(self) -> None:
        """Stop taking new connections (the subclass's server object)."""

    async def close(self) -> None:
        self.stop_accepting()
        for conn in list(self.__conns):
            conn.close()
        tasks = [t for t in self.__tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _log_given_up(conn: Connection, exc: RudraError) -> None:
    """Log the error a connection handler ended with: at debug level when the connection
    simply ended (TransportError: the peer went away, or this side closed it), else a warning."""
    if isinstance(exc, TransportError):
        log.debug("the connection to %s ended: %s", conn.peer, exc)
    else:
        log.warning("connection handler for %s gave up: [%s] %s", conn.peer, exc.code, exc)

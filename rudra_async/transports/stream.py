"""Frames over an asyncio byte stream (TCP or a Unix socket) with ``BufferedProtocol``.

Incoming bytes go into the :class:`~rudra_async.wire.FrameReader`'s buffers (small frames
through its staging buffer, one read for one or several; a large body straight into its
final buffer, no copy); outgoing frames go out with ``writelines`` over views of the caller's
arrays. The write-buffer high-water mark is 0, so ``send`` knows exactly when the OS has
taken every byte and the arrays may change again. A frame with a large body is written by
a sender thread instead, so the loop serves other connections meanwhile (:mod:`.offload`).
After each frame sent the loop polls for a moment (:mod:`.polling`), so a quick answer does
not wait for a sleeping thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np

from ..bodies import BodyBudget, BodyLease
from ..errors import ConnectError, ConnectionClosed, PeerGone, Unreachable
from ..wire import FrameReader, Limits, encode_frame
from . import offload
from .base import Connection, OnAccept, OnConnection, ServingListener, format_host_port, tune_tcp
from .polling import loop_poller

log = logging.getLogger(__name__)

#: how long a body waits for a buffer of a server's budget before one more is allocated
BODY_WAIT_S = 5.0
LINGER_S = 2.0  # after a fatal framing error, how long to drain input before closing

#: transports half-closed and draining their input (see ``_close_link``), with their loops
_lingering: dict[asyncio.BaseTransport, asyncio.AbstractEventLoop] = {}


def _close_lingering_one(transport: asyncio.BaseTransport) -> None:
    _lingering.pop(transport, None)
    transport.close()


def close_lingering() -> None:
    """Close at once the connections of this thread's loop still draining input after a last
    reply: a server shutting down, whose loop must not outlive them."""
    loop = asyncio.get_running_loop()
    for transport in [t for t, owner in _lingering.items() if owner is loop]:
        _close_lingering_one(transport)


OnMade = Callable[["StreamConnection"], None]


class StreamConnection(Connection, asyncio.BufferedProtocol):
    """A connection that is its own ``asyncio.BufferedProtocol``: the base class keeps the
    inbox and life cycle, this class moves bytes. Reading pauses while the inbox is full
    and resumes once it is half empty."""

    def __init__(self, limits: Limits, *, peer: str = "", on_made: OnMade | None = None) -> None:
        """``peer`` defaults to the socket's peer address; ``on_made`` is called once connected."""
        super().__init__(peer)
        self.limits = limits
        self._reader = FrameReader(limits, self._allocate, admit=self._admit)
        self._transport: asyncio.Transport | None = None
        self._drained = asyncio.Event()  # set when the write buffer emptied or the connection ended
        self._reading_paused = False
        self._scratch: bytearray | None = None  # after a fatal error, input is read into this and dropped
        self._on_made = on_made
        self._poller = loop_poller()  # keeps the loop awake for a moment after each frame sent
        self._thread_write: asyncio.Future[None] | None = None  # the frame a sender thread writes
        self._thread_stop = threading.Event()  # set when the connection ends: the thread gives up
        #: called by a close before the transport exists (e.g. to abort a TLS handshake)
        self.abort_connecting: Callable[[], None] | None = None
        #: while a body waits for a budget's buffer: the budget, the timer of the wait's limit, the loop
        self._body_wait: tuple[BodyBudget, asyncio.TimerHandle, asyncio.AbstractEventLoop] | None = None
        self._waiter = self._body_free  # one bound method, so that the budget can cancel it

    @property
    def bodies(self) -> BodyBudget | None:
        """The budget this connection's large bodies are received through (see
        :mod:`rudra_async.bodies`): set by a server when it accepts the connection."""
        return self._reader.budget

    @bodies.setter
    def bodies(self, budget: BodyBudget | None) -> None:
        self._reader.budget = budget

    # -- asyncio callbacks ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = stream = cast(asyncio.Transport, transport)  # uvloop's are no asyncio.Transport subclass
        self.peer = self.peer or describe_peer(stream)
        stream.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            tune_tcp(sock)
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.core.fatal is not None:
            if self._scratch is None:
                self._scratch = bytearray(65536)
            return memoryview(self._scratch)
        return self._reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._poller.arrived()
        if self.core.fatal is not None:
            return
        self._advance(self._reader, nbytes)
        if self._reader.waiting and self._body_wait is None and self.core.fatal is None:
            self._wait_for_body()
        if (
            (self._inbox_full or self._reader.waiting)
            and self.core.fatal is None
            and not self._reading_paused
            and self._transport is not None
        ):
            self._reading_paused = True
            self._transport.pause_reading()

    # -- waiting for a body's buffer (a server's budget) -----------------------------------
    def _wait_for_body(self) -> None:
        """Stop reading until the budget has a buffer for the waiting body (or, after
        :data:`BODY_WAIT_S`, take one beyond it, with a warning)."""
        budget, loop = self._reader.budget, asyncio.get_running_loop()
        assert budget is not None
        timer = loop.call_later(BODY_WAIT_S, self._body_wait_too_long)
        self._body_wait = (budget, timer, loop)
        budget.wait(self._reader.waiting, self._waiter)

    def _body_free(self, lease: BodyLease) -> None:
        """The budget's callback (on the thread that gave a buffer back)."""
        wait = self._body_wait
        try:
            if wait is None:
                raise RuntimeError("no longer waiting")
            wait[2].call_soon_threadsafe(self._take_body_buffer, lease)
        except RuntimeError:  # the wait ended, or the loop is closed: nothing will read the body
            lease.give_back()

    def _body_wait_too_long(self) -> None:
        if self._body_wait is not None and self._reader.waiting:
            budget = self._body_wait[0]
            budget.cancel(self._waiter)
            log.warning(
                "%s: no gradient buffer came free within %g s (%d in use, %d waiting): receiving into one more",
                self.peer,
                BODY_WAIT_S,
                budget.in_use,
                budget.waiting,
            )
            lease = budget.take(self._reader.waiting, force=True)
            assert lease is not None
            self._take_body_buffer(lease)

    def _take_body_buffer(self, lease: BodyLease) -> None:
        if self._body_wait is not None:
            self._body_wait[1].cancel()
            self._body_wait = None
        if self.core.fatal is not None or self.is_closed or not self._reader.waiting:
            lease.give_back()
            return
        self._resume_body(self._reader, lease)
        self._on_consumed()

    def _end_body_wait(self) -> None:
        if self._body_wait is not None:
            budget, timer, _ = self._body_wait
            self._body_wait = None
            timer.cancel()
            budget.cancel(self._waiter)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._drained.set()
        if self._reader.mid_frame and self.core.fatal is None:
            self._connection_lost(PeerGone("connection lost in the middle of a frame"))
        else:
            self._connection_lost(PeerGone(f"connection closed by peer{': ' + str(exc) if exc else ''}"))
        self._end_body_wait()
        self._reader.close()  # a body in progress gives its buffer back (after a lingering close too)

    def resume_writing(self) -> None:
        self._drained.set()

    # -- the Connection subclass API -----------------------------------------------------
    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        await self._send_frame(encode_frame(msg_type, meta, arrays, self.limits), None)

    def sends_computing(self, body_bytes: int) -> bool:
        """True while a body of ``body_bytes`` would be written by a sender thread, which
        writes each byte as soon as it is final (see :mod:`.offload`)."""
        return not self.is_closed and self._thread_socket_ok(body_bytes)

    async def send_computing(
        self, msg_type: int, meta: dict[str, Any] | None, arrays: Sequence[np.ndarray], gate: offload.Gate
    ) -> None:
        await self._send_frame(encode_frame(msg_type, meta, arrays, self.limits), gate)

    async def _send_frame(self, parts: list[bytes | memoryview], gate: offload.Gate | None) -> None:
        while (job := self._thread_writing()) is not None:
            await asyncio.wait([job])  # frames stay in order
        self._check_open()
        body_bytes = sum(len(p) for p in parts[1:])  # the body: uint8 views
        sock = self._thread_socket(body_bytes)
        if sock is not None:
            await self._write_in_thread(sock, self._sending(parts), gate, len(parts[0]))
            return
        if gate is not None:  # the loop writes this frame: only once all of it is final
            await asyncio.to_thread(offload.wait_final, gate, body_bytes)
            self._check_open()
        self._write(parts)
        self._poller.sent()
        transport = self._transport
        assert transport is not None
        try:
            while transport.get_write_buffer_size() > 0:
                self._check_open()
                self._drained.clear()
                await self._drained.wait()
            self._check_open()
        except BaseException:
            # The frame's memory may change once this returns (a lease ends): what the
            # transport still holds of it must never go out (closing would flush it).
            if transport.get_write_buffer_size() > 0:
                transport.abort()
            raise

    def nowait_room(self, body_bytes: int) -> bool:
        """True while nothing waits in the write buffer (the frame goes to the OS at once,
        or is the one frame buffered) and no sender thread writes."""
        transport = self._transport
        return (
            not self.is_closed
            and transport is not None
            and transport.get_write_buffer_size() == 0
            and self._thread_writing() is None
        )

    def send_nowait(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        self._write(encode_frame(msg_type, meta, arrays, self.limits))
        self._poller.sent()

    def _write_soon(self, parts: list[bytes | memoryview]) -> None:
        """Write a frame that expects no answer (no poll window) from a callback: now, or
        right after the frame a sender thread is writing (never inside it)."""
        job = self._thread_writing()
        if job is None:
            self._write(parts)
        else:
            job.add_done_callback(lambda _: None if self.is_closed else self._write(parts))

    def _write(self, parts: list[bytes | memoryview]) -> None:
        """Hand a frame to the loop's transport (the OS takes what it can at once)."""
        transport = self._transport
        assert transport is not None
        transport.writelines(self._sending(parts))

    def _thread_writing(self) -> asyncio.Future[None] | None:
        """The sender thread's job while it writes a frame of this connection, else None."""
        job = self._thread_write
        return None if job is None or job.done() else job

    def _thread_socket(self, body_bytes: int) -> socket.socket | None:
        """A duplicate of the socket for a sender thread to write a frame with a body of
        ``body_bytes`` to, or None where the loop writes it (see :mod:`.offload`)."""
        if not self._thread_socket_ok(body_bytes):
            return None
        assert self._transport is not None, "checked by _thread_socket_ok"
        raw = self._transport.get_extra_info("socket")
        sock = socket.socket(fileno=os.dup(raw.fileno()))
        sock.settimeout(0.0)
        return sock

    def _thread_socket_ok(self, body_bytes: int) -> bool:
        """Whether a sender thread may write a frame with a body of ``body_bytes`` now."""
        transport = self._transport
        if transport is None or not offload.wanted(body_bytes) or transport.get_write_buffer_size():
            return False
        if transport.get_extra_info("sslcontext") is not None or transport.get_extra_info("ssl_object") is not None:
            return False
        return transport.get_extra_info("socket") is not None

    async def _write_in_thread(
        self, sock: socket.socket, parts: list[bytes | memoryview], gate: offload.Gate | None, body_at: int
    ) -> None:
        """Write a frame to ``sock`` in a sender thread (the body, from byte ``body_at`` on,
        as ``gate`` lets it); return once every byte is written. Cancelled, or failing
        midway, the connection ends (part of a frame may be out); cancelled, no byte of the
        frame goes out once this has returned, though the thread may still run."""
        job = self._thread_write = offload.start(
            asyncio.get_running_loop(), sock, parts, self._thread_stop, gate, body_at
        )
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            self._shut_down_socket()
            self.close()
            raise
        except ConnectionClosed:
            self._check_open()
            raise
        except OSError as exc:
            self._connection_lost(PeerGone(f"the link broke while a frame was being written: {exc}"))
            if self._transport is not None:
                self._transport.abort()
            self._check_open()  # raises that PeerGone
        except Exception:  # the gate's computation failed: the frame can never be completed
            self.close()
            raise
        self._poller.sent()  # every byte went out: a peer that answered and left since is for recv to report

    def _shut_down_socket(self) -> None:
        """Shut the socket down at once (not at the loop's next turn, as closing does): the
        peer sees it hung up, and a sender thread writes nothing more, even one that has just
        looked for a stop and is about to call ``sendmsg`` (which then fails), after which the
        frame's memory may change. A ``sendmsg`` already copying holds the socket's lock, so
        the shutdown returns only once that copy is over."""
        transport = self._transport
        raw = transport.get_extra_info("socket") if transport is not None else None
        if raw is None:
            return
        try:  # through a duplicate: the loop's socket object may not offer shutdown (uvloop)
            with socket.socket(fileno=os.dup(raw.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already gone
            pass

    def _on_consumed(self) -> None:
        if (
            self._reading_paused
            and not self._reader.waiting
            and len(self.core.inbox) <= self.core.inbox_frames // 2
            and self._transport is not None
        ):
            self._reading_paused = False
            self._transport.resume_reading()

    def _close_link(self) -> None:
        self._drained.set()
        self._thread_stop.set()
        self._end_body_wait()
        self._reader.close()  # its buffers go now, not when the cycle collector runs
        transport = self._transport
        if transport is None:
            if self.abort_connecting is not None:
                self.abort_connecting()
            return
        if (self.core.fatal is not None or self._linger) and self.core.lost is None and transport.can_write_eof():
            # Closing with unread bytes would reset the connection and destroy the error
            # reply just sent; half-close instead, discard input, and close a bit later.
            transport.write_eof()
            if self._reading_paused:
                transport.resume_reading()
            loop = asyncio.get_running_loop()
            _lingering[transport] = loop
            loop.call_later(LINGER_S, _close_lingering_one, transport)
        else:
            transport.close()


class Accepting(Protocol):
    """What accepts a listener's connections (an ``asyncio`` server, or the TLS acceptor)."""

    def close(self) -> None:
        """Stop accepting."""


class StreamListener(ServingListener):
    """A listener whose connections are :class:`StreamConnection` s; ``on_close`` runs once
    it stops accepting (e.g. to remove a Unix socket's file)."""

    def __init__(
        self, on_connection: OnConnection, on_accept: OnAccept | None = None, on_close: Callable[[], None] | None = None
    ) -> None:
        super().__init__(on_connection, on_accept)
        self._server: Accepting | None = None
        self._on_close = on_close

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        """The sockets it listens on (an ``asyncio`` server's; none for another acceptor)."""
        return tuple(getattr(self._server, "sockets", None) or ())

    def attach(self, acceptor: Accepting) -> None:
        """What accepts this listener's connections (an ``asyncio`` server, a TLS acceptor);
        :meth:`stop_accepting` closes it."""
        self._server = acceptor

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
            if self._on_close is not None:
                self._on_close()


def describe_peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return format_host_port("tcp", peer[0], peer[1])
    return f"unix:{peer!r}" if peer else "unix:?"


async def open_stream(opener: Awaitable[tuple[Any, StreamConnection]], url: str, timeout: float) -> StreamConnection:
    """Await a loop.create_*_connection call; map its failures to ConnectError."""
    try:
        _, conn = await asyncio.wait_for(opener, timeout)
    except asyncio.TimeoutError:
        raise Unreachable(f"cannot connect to {url}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise Unreachable(f"cannot connect to {url}: {exc.strerror or exc}") from None
    return conn


ServerOpener = Callable[[Callable[[], StreamConnection]], Awaitable[asyncio.AbstractServer]]


async def start_listener(
    server_opener: ServerOpener,
    url: str,
    on_connection: OnConnection,
    new_connection: Callable[[OnMade], StreamConnection],
    on_accept: OnAccept | None = None,
    on_close: Callable[[], None] | None = None,
) -> StreamListener:
    """Start a server with ``server_opener(factory)``, where the factory makes each accepted
    connection with ``new_connection(on_made)``; map bind failures to ConnectError.
    ``on_accept`` runs in ``connection_made``, before the first byte is parsed."""
    listener = StreamListener(on_connection, on_accept, on_close)
    try:
        listener.attach(await server_opener(lambda: new_connection(listener.spawn)))
    except OSError as exc:
        raise ConnectError(f"cannot listen on {url}: {exc.strerror or exc}") from None
    return listener


# -- the stream-socket kit: a transport over any asyncio stream socket, in two calls ----------
async def connect_stream(
    open_connection: Callable[[Callable[[], StreamConnection]], Awaitable[tuple[Any, StreamConnection]]],
    url: str,
    *,
    limits: Limits,
    timeout: float,
) -> StreamConnection:
    """A connection made by ``open_connection(protocol_factory)``, one of the event loop's
    ``create_connection``/``create_unix_connection`` calls with its address filled in;
    ``ConnectError`` (naming ``url``) if refused, or after ``timeout`` seconds."""
    return await open_stream(open_connection(lambda: StreamConnection(limits)), url, timeout)


async def listen_stream(
    create_server: ServerOpener,
    url: str,
    on_connection: OnConnection,
    *,
    limits: Limits,
    on_accept: OnAccept | None = None,
    on_close: Callable[[], None] | None = None,
) -> StreamListener:
    """A listener started by ``create_server(protocol_factory)``, one of the event loop's
    ``create_server``/``create_unix_server`` calls with its address filled in; ``on_accept``
    runs for each connection before its first byte is parsed, ``on_close`` once the listener
    stops. ``ConnectError`` if it cannot bind. Set the listener's ``address`` (the URL a
    client connects to) before returning it."""
    return await start_listener(
        create_server,
        url,
        on_connection,
        lambda on_made: StreamConnection(limits, on_made=on_made),
        on_accept,
        on_close,
    )

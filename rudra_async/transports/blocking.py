"""Frames over a blocking socket, for code that has no event loop (a training script).

:class:`BlockingConnection` speaks exactly the stream transport's bytes (so the server
cannot tell the difference): ``sendmsg`` over views of the caller's arrays, ``recv_into``
straight into the :class:`~rudra_async.wire.FrameReader`'s buffers. Its ``send`` and
``recv`` are coroutines that never suspend: the asyncio :class:`~rudra_async.client.Client`
runs on it unchanged, driven by :func:`rudra_async.eventloop.run_sync`, without the cost of
starting an event loop for every request. The first read after a send polls the socket for a
moment before it blocks (:mod:`.polling`).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from ..errors import ConnectError, PeerGone, Unreachable, WireError
from ..wire import Allocator, Frame, FrameReader, Limits, encode_frame
from .base import format_host_port, tune_tcp
from .core import ConnectionCore
from .polling import Adaptive

T = TypeVar("T")
IOV_MAX = 1024  # buffers one sendmsg call takes (Linux allows 1024)


class BlockingConnection:
    """One blocking stream of frames (the subset of ``Connection`` a client uses)."""

    def __init__(self, sock: socket.socket, limits: Limits, peer: str) -> None:
        self._sock = sock
        self.limits = limits
        self.peer = peer
        self._reader = FrameReader(limits)
        #: the inbox, how the connection ended, the byte counts (the asyncio Connection's rules: see :mod:`.core`)
        self.core = ConnectionCore()
        self._polling = Adaptive()  # the first read after a send polls for a moment (see .polling)
        self._awaiting = False  # a frame was sent since the last read
        self._tls = isinstance(sock, ssl.SSLSocket)

    @property
    def allocator(self) -> Allocator | None:
        return self._reader.allocate

    @allocator.setter
    def allocator(self, value: Allocator | None) -> None:
        self._reader.allocate = value

    @property
    def is_closed(self) -> bool:
        return self.core.ended

    async def within(self, operation: Awaitable[T], timeout: float) -> T:
        """``operation`` (on this connection) with a deadline of ``timeout`` seconds for each
        blocking call, by the socket's timeout meanwhile; TimeoutError past it."""
        before = self.gettimeout()
        self.settimeout(timeout)
        try:
            return await operation
        finally:
            self.settimeout(before)

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        """Send one frame; returns when the kernel has every byte (the arrays may change)."""
        self.core.check_open()
        parts = encode_frame(msg_type, meta, arrays, self.limits)
        self.core.sending(parts)
        views = [memoryview(part).cast("B") for part in parts]
        self._awaiting = True
        try:
            if self._tls:  # TLS records: no scatter-gather
                for view in views:
                    self._sock.sendall(view)
                return
            while views:
                sent = self._sock.sendmsg(views[:IOV_MAX])
                while views and sent >= len(views[0]):
                    sent -= len(views.pop(0))
                if sent:
                    views[0] = views[0][sent:]
        except OSError as exc:
            raise self._gone(f"connection lost while sending: {exc}") from None

    async def recv(self) -> Frame:
        """The next frame. Raises PeerGone, ConnectionClosed or a fatal WireError (once:
        the byte stream is then lost, and later calls raise PeerGone)."""
        while (frame := self.core.next()) is None:
            buf = self._reader.get_buffer()
            try:
                n = self._first_read(buf) if self._awaiting else None
                if n is None:
                    n = self._sock.recv_into(buf)
            except TimeoutError:
                raise  # the caller's deadline (socket timeout) passed
            except OSError as exc:
                raise self._gone(f"connection lost: {exc}") from None
            if n == 0:
                raise self._gone("connection lost in the middle of a frame" if self._reader.mid_frame
                                 else "connection closed by peer")  # fmt: skip
            for item in self.core.read(self._reader, n):
                self.core.queue(item)
                if isinstance(item, WireError):
                    self.core.lose(PeerGone("the byte stream lost its framing"))
        return frame

    def _first_read(self, buf: memoryview) -> int | None:
        """The first read after a send: poll for up to one window when that pays (None: nothing came)."""
        self._awaiting = False
        if self._pollable and self._polling.polls():
            return self._polling.poll_recv_into(self._sock, buf)
        return None

    @property
    def _pollable(self) -> bool:
        """Whether reads may poll with ``MSG_DONTWAIT``: not under a socket timeout, not over TLS."""
        return not self._tls and self._sock.gettimeout() is None

    def settimeout(self, seconds: float | None) -> None:
        """Deadline for each blocking call (None: wait as long as it takes; only then does
        the first read after a send poll). Nothing once closed."""
        if not self.core.closed:
            self._sock.settimeout(seconds)

    def gettimeout(self) -> float | None:
        """The deadline :meth:`settimeout` set."""
        return self._sock.gettimeout()

    def close(self) -> None:
        """Close this end. Idempotent; never raises."""
        if self.core.close():
            self._sock.close()

    def _gone(self, why: str) -> PeerGone:
        """The peer is gone (``why``): the PeerGone to raise (later calls raise the first reason)."""
        reason = PeerGone(why)
        self.core.lose(reason)
        return reason


def connect_tcp(
    host: str, port: int, url: str, limits: Limits, timeout: float, tls: ssl.SSLContext | None = None
) -> BlockingConnection:
    """A blocking TCP connection (:func:`~.base.tune_tcp`), over TLS with ``tls`` (the certificate checked
    against ``host``); ConnectError at once if refused, or after ``timeout``."""
    with _connecting(url, timeout):
        sock = socket.create_connection((host, port), timeout=timeout)
    tune_tcp(sock)
    if tls is not None:
        try:
            sock = tls.wrap_socket(sock, server_hostname=host)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ConnectError(f"cannot connect to {url}: {exc}") from None
    sock.settimeout(None)
    peer = sock.getpeername()
    return BlockingConnection(sock, limits, format_host_port("tcp", peer[0], peer[1]))


def connect_socket(family: int, address: Any, url: str, *, limits: Limits, timeout: float) -> BlockingConnection:
    """A blocking connection over a new stream socket of ``family`` connected to ``address``
    (e.g. ``socket.AF_UNIX`` and a path): the blocking side of a transport made with
    :func:`rudra_async.transports.stream.connect_stream`. ConnectError (naming ``url``) at
    once if refused, or after ``timeout``."""
    return BlockingConnection(open_socket(family, address, url, timeout), limits, url)


def open_socket(family: int, address: Any, url: str, timeout: float) -> socket.socket:
    """A new blocking stream socket of ``family`` connected to ``address`` (for a transport
    whose blocking connection is a subclass: it wraps the socket itself); ConnectError
    (naming ``url``) at once if refused, or after ``timeout``."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with _connecting(url, timeout):
            sock.connect(address)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def _connecting(url: str, timeout: float) -> Iterator[None]:
    """A connect's failures as Unreachable, naming ``url``."""
    try:
        yield
    except TimeoutError:
        raise Unreachable(f"cannot connect to {url}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise Unreachable(f"cannot connect to {url}: {exc.strerror or exc}") from None

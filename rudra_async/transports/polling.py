"""Brief busy polling after a send, so that a reply that comes quickly finds its reader awake.

A process that blocks (in ``epoll_wait`` or ``recv``) lets its CPU go idle; on a virtual
machine an idle vCPU halts, and waking it again costs tens of microseconds, paid by the
sender's ``send`` and again by the sleeper before it runs. A small push+pull over loopback
pays it twice per round trip, which is more than all the work of both ends. So after each
frame it sends, a connection keeps its reader awake for a short window (300 µs by
default): an event loop keeps running with a zero poll timeout
(:class:`LoopPoller`), a blocking connection polls its socket without blocking
(:meth:`Adaptive.poll_recv_into`), and only then sleeps as usual.

A window costs at most its length in CPU per frame sent (a frame sent while a window is open
moves its end), and only while polling pays:
each waiter keeps a credit that a window which caught an arrival raises by one (up to
``CREDIT_MAX``) and a window that ran out lowers by ``MISS_COST``; without credit it polls
only every ``PROBE_EVERY``-th time, until a probe catches an arrival again
(:class:`Adaptive`). So polling goes on only while at least two windows in three catch
something: a large model (whose replies take milliseconds), a server whose learners compute
between requests, or an idle one do not poll but for the probes. A
blocking poller yields its CPU between polls (``sched_yield``), so a process the host must
run instead (the server a learner waits for, on a busy host) is not held up.

The window is process-wide: ``RUDRA_ASYNC_BUSY_POLL_US`` (microseconds, 0 turns polling off;
unset or empty: 300) read when this module is first imported, or :func:`set_window`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import weakref

from ..errors import ConfigError
from ..options import env_value

#: the most credit a waiter keeps (windows that caught something, net of misses)
CREDIT_MAX = 8
#: the credit a window that caught nothing costs
MISS_COST = 2
#: without credit, one wait in this many polls anyway (a probe)
PROBE_EVERY = 16
DEFAULT_WINDOW_US = 300.0
ENV = "RUDRA_ASYNC_BUSY_POLL_US"


def _checked(seconds: float, source: str) -> float:
    """``seconds`` if it is a window (0 to 1 s), else a ConfigError naming ``source``."""
    if not 0 <= seconds <= 1:
        raise ConfigError(f"{source} must be between 0 and 1 s (1000000 us), got {seconds!r} s")
    return seconds


_window = _checked(env_value(ENV, DEFAULT_WINDOW_US, float, "a number of microseconds") * 1e-6, ENV)


def window() -> float:
    """The polling window in seconds (0: no polling)."""
    return _window


def set_window(seconds: float) -> None:
    """Set the polling window of this process (0 turns polling off); applies to the next wait."""
    global _window
    _window = _checked(seconds, "the busy-poll window")


class Adaptive:
    """Whether the next wait polls: yes while it has credit (see the module docstring),
    else only every :data:`PROBE_EVERY`-th wait (a probe)."""

    def __init__(self) -> None:
        self.credit = CREDIT_MAX // 2
        self._skipped = 0

    def polls(self) -> bool:
        if not _window:
            return False
        if self.credit > 0:
            return True
        self._skipped += 1
        if self._skipped < PROBE_EVERY:
            return False
        self._skipped = 0
        return True

    def caught(self) -> None:
        self.credit = min(CREDIT_MAX, self.credit + 1)

    def missed(self) -> None:
        self.credit = max(0, self.credit - MISS_COST)

    def poll_recv_into(self, sock: socket.socket, buffer: memoryview) -> int | None:
        """Poll a blocking socket (no timeout, not TLS) for up to one window: the bytes
        ``recv_into`` read, or None when nothing came (the caller then blocks as usual).
        Bytes that were already there count neither way. Raises what ``recv_into`` raises,
        but ``BlockingIOError``."""
        deadline = time.perf_counter() + _window
        waited = False
        while True:
            try:
                n = sock.recv_into(buffer, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    self.missed()
                    return None
                waited = True
                os.sched_yield()
                continue
            if waited:
                self.caught()
            return n


class LoopPoller:
    """Keeps the running event loop from sleeping for one window after a frame is sent: the
    loop runs a tick callback after another, so it polls its sockets with a zero timeout,
    until something arrives on any of its connections (:meth:`arrived`) or the window runs
    out. One per loop (:func:`loop_poller`), shared by its connections; used only on its
    loop's thread. It holds no reference to the loop (a closed loop is freed)."""

    def __init__(self) -> None:
        self._adaptive = Adaptive()
        self._until = 0.0  # when the current window ends; 0: none open
        self._ticking = False

    def sent(self) -> None:
        """A frame went out: poll for a reply (or the next request) for one window."""
        if not self._until and not self._adaptive.polls():
            return
        self._until = time.perf_counter() + _window
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._tick)

    def arrived(self) -> None:
        """Bytes arrived: the loop is awake, the window has done its job."""
        if self._until:
            self._until = 0.0
            self._adaptive.caught()

    def _tick(self) -> None:
        until = self._until
        if until and time.perf_counter() < until:
            asyncio.get_running_loop().call_soon(self._tick)
            return
        self._ticking = False
        if until:  # ran out with nothing arriving
            self._until = 0.0
            self._adaptive.missed()


_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopPoller] = weakref.WeakKeyDictionary()


def loop_poller() -> LoopPoller:
    """The running loop's poller (made on first use)."""
    loop = asyncio.get_running_loop()
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = LoopPoller()
    return poller

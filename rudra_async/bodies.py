"""Buffers that frame bodies are received into: a :class:`BufferPool` of reused ones (each
reader has its own), and a budget of large bodies shared by many readers, so that a
server's memory for gradients stays the same whatever the number of learners.

Each connection's :class:`~rudra_async.wire.FrameReader` would otherwise allocate a model's
size for every push that arrives, so that λ learners pushing at once cost λ buffers, while
the server applies one update at a time. With a :class:`BodyBudget`, a body of at least
``threshold`` bytes is received only into one of at most ``limit`` buffers *in use* (being
received, or read by the server until its frame is released); a reader whose body would
exceed that waits (its transport stops reading: the sender's bytes wait in the socket)
until one is given back. A body a protocol keeps until other gradients arrive (hardsync,
softsync) is *set aside* (:meth:`BodyLease.set_aside`): it stays allocated but no longer
counts, so a round never waits for its own members. Given-back buffers are kept (at most
``limit``) and handed out again, warm.

Thread-safe; a waiter's callback runs on the thread that gave the buffer back.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np

#: a waiting reader's callback: it receives the lease it waited for
Waiter = Callable[["BodyLease"], None]


class BufferPool:
    """Body buffers for reuse: freshly allocated pages fill several times slower than warm
    ones, so released buffers are kept (at most ``keep``) and handed out again.

    Buffers are ``numpy.empty`` arrays, not zero-filled: the pages of a large one are
    committed only as bytes arrive, so a body that is announced but never sent costs
    (almost) no memory. :meth:`clear` gives every kept buffer back at once."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (reused when one is free)."""
        for i, buf in enumerate(self._free):
            if len(buf) >= nbytes:
                return self._free.pop(i)
        return np.empty(nbytes, np.uint8)

    def give_back(self, buf: np.ndarray) -> None:
        if len(self._free) < self.keep:
            self._free.append(buf)

    @property
    def kept(self) -> tuple[np.ndarray, ...]:
        """The free buffers kept for reuse."""
        return tuple(self._free)

    def clear(self) -> None:
        self._free.clear()


class BodyLease:
    """One body's buffer from a :class:`BodyBudget`; counted until set aside or given back."""

    def __init__(self, budget: BodyBudget, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self._budget: BodyBudget | None = budget
        self._counted = True

    def set_aside(self) -> None:
        """The body is kept for a while (a protocol holds it): it no longer counts against
        the budget. Idempotent."""
        if self._counted and self._budget is not None:
            self._counted = False
            self._budget._uncount()

    def give_back(self) -> None:
        """The body is no longer read: its buffer goes back for reuse. Idempotent."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget._give_back(self.buffer, self._counted)


class BodyBudget:
    """At most ``limit`` bodies of at least ``threshold`` bytes in use at once (see the
    module docstring); ``limit`` ≥ 1."""

    def __init__(self, limit: int = 2, threshold: int = 1 << 20) -> None:
        if limit < 1:
            raise ValueError("a body budget needs a limit of at least 1")
        self.limit = limit
        self.threshold = threshold
        self.in_use = 0
        self._pool = BufferPool(keep=limit)
        self._waiters: deque[tuple[int, Waiter]] = deque()
        self._lock = threading.Lock()

    def counts(self, nbytes: int) -> bool:
        """Whether a body of ``nbytes`` is received through this budget."""
        return nbytes >= self.threshold

    def take(self, nbytes: int, *, force: bool = False) -> BodyLease | None:
        """A buffer of at least ``nbytes``, or None while ``limit`` are in use (``force``: one
        anyway, for a reader that waited too long)."""
        with self._lock:
            if self.in_use >= self.limit and not force:
                return None
            return self._lease(nbytes)

    def wait(self, nbytes: int, waiter: Waiter) -> None:
        """Call ``waiter(lease)`` once a buffer of ``nbytes`` is free (waiters are served in
        order). Call :meth:`cancel` to stop waiting."""
        with self._lock:
            self._waiters.append((nbytes, waiter))
        self._serve()

    def cancel(self, waiter: Waiter) -> None:
        """Stop waiting (a reader closed or forced its buffer). No-op if not waiting."""
        with self._lock:
            self._waiters = deque(w for w in self._waiters if w[1] is not waiter)

    @property
    def kept(self) -> tuple[np.ndarray, ...]:
        """The free buffers kept for reuse."""
        with self._lock:
            return self._pool.kept

    @property
    def waiting(self) -> int:
        """How many readers wait for a buffer."""
        return len(self._waiters)

    def clear(self) -> None:
        """Drop the kept free buffers (a server closing)."""
        with self._lock:
            self._pool.clear()

    # -- the leases' side ---------------------------------------------------------------------
    def _lease(self, nbytes: int) -> BodyLease:
        """One more buffer in use (called holding the lock)."""
        self.in_use += 1
        return BodyLease(self, self._pool.take(nbytes))

    def _uncount(self) -> None:
        with self._lock:
            self.in_use -= 1
        self._serve()

    def _give_back(self, buffer: np.ndarray, counted: bool) -> None:
        with self._lock:
            if counted:
                self.in_use -= 1
            self._pool.give_back(buffer)
        self._serve()

    def _serve(self) -> None:
        """Hand free room to the waiters in order, each callback outside the lock."""
        while True:
            with self._lock:
                if not self._waiters or self.in_use >= self.limit:
                    return
                nbytes, waiter = self._waiters.popleft()
                lease = self._lease(nbytes)
            waiter(lease)

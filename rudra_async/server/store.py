"""The server's state: flat weights, momentum and the clock, with torn-free publication.

Readers (a pull reply being written to a socket) *lease* the current weights buffer. An
update writes in place when nobody holds a lease, otherwise into a spare buffer that is
then published, so a reader never sees a half-applied update and no copy is made on the
common path.

With a :class:`Background`, an update of a large model is computed on its update
thread while the caller's thread (the event loop) goes on receiving and sending:
:meth:`WeightStore.apply` returns once the update is *decided* (the clock has advanced),
and every reader of the weights or the momentum (``weights``, ``lease``, the next
``apply``) first waits for it to be computed (:meth:`WeightStore.finish`), so nobody sees
an update half done and updates are computed one at a time, in the order they were decided.
A reader that can write bytes as they become final (a reply written by a sender thread)
may instead lease the weights while they are computed (:meth:`WeightStore.lease_computing`):
the update thread computes them in pieces, in order, and its :class:`Progress` says how
many bytes are final.

With a ``history`` of H, the store also keeps the last H published versions (held as leases,
so no update writes into them) for delay compensation (:meth:`WeightStore.versions`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from ..errors import UpdateFailed
from ..kernels import Steps, Updater, make_updater
from ..kernels.delay import delay_compensated
from ..layout import Layout

#: models with fewer values are updated on the caller's thread: the hand-overs to the check
#: and update threads and back (four cross-thread wake-ups, 0.3–1 ms on a shared VM) cost
#: more than the overlap frees. Measured with ``benchmarks/handover.py`` and the peer
#: driver: at 580K values (its CNN) a step's push+pull is 0.3–1 ms shorter inline; at 1M
#: values 4 learners without compute get 10–40% more updates/s inline; at 4M, about equal.
log = logging.getLogger(__name__)

BACKGROUND_MIN_VALUES = 1 << 21


#: values per piece of an update computed in the background (8 MiB of float32): a reply
#: leased while it is computed can write each piece as soon as it is final
PIECE_VALUES = 1 << 21


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def off_loop(values: int) -> bool:
    """Whether work on ``values`` floats goes to the background thread (read at call time, so
    a test may lower :data:`BACKGROUND_MIN_VALUES`)."""
    return values >= BACKGROUND_MIN_VALUES


class Background:
    """Two worker threads: one runs the updates in the order they are submitted
    (:meth:`submit`), the other the reads of pushed gradients (their checks, :meth:`check`),
    so the next gradient is checked while an update is computed. ``wake()`` is called from
    the update thread after each update (e.g. ``loop.call_soon_threadsafe`` of something that
    calls :meth:`WeightStore.reap`).

    With ``threads`` > 1, a pool of that many *part* threads computes the pieces of one
    update side by side, and the max |g| of a gradient's pieces (:meth:`spread`): the
    update kernel is elementwise and a maximum is exact, so the result is the same bits as
    on one thread."""

    def __init__(self, wake: Callable[[], None] = lambda: None, threads: int = 1) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rudra-update")
        self._checks = ThreadPoolExecutor(1, thread_name_prefix="rudra-check")
        self.wake = wake
        self.threads = max(1, threads)
        self._parts = ThreadPoolExecutor(self.threads, thread_name_prefix="rudra-part") if self.threads > 1 else None

    def spread(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a part thread (at once on this one where there are none)."""
        if self._parts is not None:
            return self._parts.submit(fn, *args)
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as exc:
            done.set_exception(exc)
        return done

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the update thread, after every job submitted before it."""
        return self._pool.submit(fn, *args)

    def check(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)``, which changes no shared state, on the check thread (in order)."""
        return self._checks.submit(fn, *args)

    def close(self) -> None:
        """Wait for the submitted jobs, then stop the threads. Idempotent."""
        self._checks.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        if self._parts is not None:
            self._parts.shutdown(wait=True)


class Progress:
    """How many bytes of an update's output buffer are final, from its start (a
    :class:`rudra_async.transports.offload.Gate`). Advanced by the update thread."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._final = 0
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def advance(self, final: int) -> None:
        """The first ``final`` bytes are final now."""
        with self._changed:
            self._final = final
            self._changed.notify_all()

    def fail(self, error: BaseException) -> None:
        """The update failed: no more bytes will become final."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def wait(self, nbytes: int, timeout: float) -> int:
        """Wait until the first ``nbytes`` bytes are final or ``timeout`` seconds passed;
        return how many are final. Raises RuntimeError once the update failed."""
        with self._changed:
            self._changed.wait_for(lambda: self._final >= nbytes or self._error is not None, timeout)
            if self._error is not None:
                raise RuntimeError(f"the update of these weights failed: {self._error!r}")
            return self._final


class WeightStore:
    """``kernel`` names the update backend (see :func:`rudra_async.kernels.resolve`);
    ``background`` the thread that computes updates of a model of at least
    :data:`BACKGROUND_MIN_VALUES` values (None: every update on the caller's thread)."""

    def __init__(
        self,
        layout: Layout,
        initial: np.ndarray,
        kernel: str = "numpy",
        allocate: Callable[[int], np.ndarray] | None = None,
        free: Callable[[np.ndarray], None] | None = None,
        background: Background | None = None,
        on_failure: Callable[[UpdateFailed], None] = lambda failure: None,
        history: int = 0,
    ) -> None:
        """``allocate(nbytes)``/``free(buffer)`` provide the published buffers (e.g. shared
        memory a transport can send without copying); plain memory by default.
        ``on_failure(failure)`` is called once, on the caller's thread, when an update fails.
        ``history``: how many published versions to keep for :meth:`versions` (0: none; H
        costs up to H + 1 buffers of the weights)."""
        if initial.size != layout.size:
            raise ValueError(f"initial weights have {initial.size} values, layout needs {layout.size}")
        self.layout = layout
        self.clock = 0
        self._allocate = allocate or (lambda nbytes: np.empty(nbytes, np.uint8))
        self._free = free
        self._buffers: list[np.ndarray] = []
        self._current: np.ndarray = self._new_buffer()
        self._current[:] = np.asarray(initial, np.float32).reshape(-1)
        self.updater: Updater = make_updater(kernel, layout.size)
        self._leases: dict[int, int] = {}  # id(buffer) -> readers (and kept versions)
        self._history = history
        self._versions: dict[int, np.ndarray] = {}  # clock -> the weights published at it (kept)
        self._spares: list[np.ndarray] = []
        self.update_seconds = 0.0  # time spent computing updates
        self._background = background if background is not None and off_loop(layout.size) else None
        self._in_flight: Future[None] | None = None  # the update being computed in the background
        self._progress: Progress | None = None  # how much of its output is final
        self._after: list[Callable[[], None]] = []  # to call once it is computed
        #: set once an update raised: the weights are undefined, and every later read or update raises it
        self.failure: UpdateFailed | None = None
        self._on_failure = on_failure

    @property
    def updates_inline(self) -> bool:
        """Whether updates are computed on the caller's thread (no background thread: a
        model below :data:`BACKGROUND_MIN_VALUES`, or none given)."""
        return self._background is None

    @property
    def in_flight(self) -> Future[None] | None:
        """The update being computed in the background (None: the weights are up to date)."""
        return self._in_flight

    @property
    def weights(self) -> np.ndarray:
        """The published weights (read-only view; valid until the next update)."""
        self.finish()
        view: np.ndarray = self._current.view()
        view.flags.writeable = False
        return view

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[int, np.ndarray]]:
        """Hold the current (clock, weights) unchanged for the duration of the block."""
        self.finish()
        with self._hold() as buf:
            yield self.clock, buf

    @contextlib.contextmanager
    def lease_computing(self) -> Iterator[tuple[int, np.ndarray, Progress | None]]:
        """:meth:`lease` without waiting for the update in flight: (clock, weights, progress),
        where ``progress`` says how many bytes of the weights are final (None: all are).
        Bytes once final stay unchanged for the duration of the block."""
        with self._hold() as buf:
            yield self.clock, buf, self._progress  # set exactly while an update is in flight

    @contextlib.contextmanager
    def _hold(self) -> Iterator[np.ndarray]:
        """The current buffer, which no update writes into while it is held (but the one in flight)."""
        self._usable()
        buf = self._keep(self._current)
        try:
            yield buf
        finally:
            self._let_go(buf)

    def _keep(self, buf: np.ndarray) -> np.ndarray:
        """Hold ``buf`` unchanged (no update writes into it) until :meth:`_let_go`."""
        self._leases[id(buf)] = self._leases.get(id(buf), 0) + 1
        return buf

    def _let_go(self, buf: np.ndarray) -> None:
        key = id(buf)
        self._leases[key] -= 1
        if not self._leases[key]:
            del self._leases[key]
            if buf is not self._current:
                self._spares.append(buf)

    def versions(self, stamps: Sequence[int]) -> list[np.ndarray | None]:
        """The weights published at each clock in ``stamps`` (θ_j, for delay compensation),
        where kept and older than the current clock; None for the current clock, or a version
        not kept (beyond the history, or from before this store's first update). Each stays
        unchanged until the next :meth:`apply` has computed its update."""
        self._remember_current()
        return [self._versions.get(j) if j < self.clock else None for j in stamps]

    def _remember_current(self) -> None:
        """Keep the current weights as the version of the current clock, and let go of those
        beyond the history (the store's first version: whatever the clock says, e.g. after
        a resume; the history is cleared if the clock moved otherwise than by updates)."""
        if not self._history or self._versions.get(self.clock) is self._current:
            return
        if self.clock - 1 not in self._versions:
            for buf in self._versions.values():
                self._let_go(buf)
            self._versions.clear()
        self._versions[self.clock] = self._keep(self._current)
        for j in [j for j in self._versions if j <= self.clock - self._history]:
            self._let_go(self._versions.pop(j))

    def apply(
        self,
        grads: Sequence[np.ndarray],
        scales: Sequence[float],
        steps: Steps,
        *,
        check: bool = False,
        after: Iterable[Callable[[], None]] = (),
        dc: tuple[float, Sequence[np.ndarray | None]] | None = None,
        consumed: Sequence[Callable[[], None]] = (),
    ) -> bool:
        """Fold the gradients into the weights and advance the clock. The gradients must stay
        unchanged until the update is computed; then each of ``after`` is called (at once,
        or from :meth:`finish` after a background update). ``dc``: (λ_dc, one version of
        :meth:`versions` per gradient): each gradient with a version is delay-compensated
        first (:func:`~rudra_async.kernels.delay.delay_compensated`), with the weights this
        update starts from. ``consumed``: for a background update, called on the update
        thread once the gradients are read, before the last piece of the new weights is
        published (a learner that has all of its reply finds its gradient's memory free).

        With ``check``, the new weights are computed (on this thread) into a spare buffer and
        the momentum is saved first; if any new weight or momentum value is not finite, both
        stay as they were (the clock still advances) and False is returned."""
        self.finish()
        self._remember_current()
        src = self._current
        if not check:
            dst = src if id(src) not in self._leases else self._spare()
            self._current = dst
            self.clock += 1
            self._remember_current()
            if self._background is None:
                try:
                    self._failing(self._compute, src, dst, grads, scales, steps, None, dc)
                finally:
                    _call_all(after)
            else:
                background, self._after = self._background, list(after)
                self._progress = progress = Progress(dst.nbytes)
                self._in_flight = background.submit(
                    self._compute, src, dst, grads, scales, steps, progress, dc, consumed
                )
                self._in_flight.add_done_callback(lambda _: background.wake())
            return True
        saved = self.updater.momentum
        dst = self._spare()
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is what the check is for
                self._failing(self._compute, src, dst, grads, scales, steps, None, dc)
        finally:
            _call_all(after)
        self.clock += 1
        applied = bool(np.isfinite(dst).all() and np.isfinite(self.updater.momentum).all())
        if applied:
            self._current = dst
            if id(src) not in self._leases:
                self._spares.append(src)
        else:
            self.updater.load_momentum(saved)
            self._spares.append(dst)
        self._remember_current()
        return applied

    def _compute(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        grads: Sequence[np.ndarray],
        scales: Sequence[float],
        steps: Steps,
        progress: Progress | None = None,
        dc: tuple[float, Sequence[np.ndarray | None]] | None = None,
        consumed: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Compute the update into ``dst``; with ``progress``, piece by piece in order (if the
        backend can), advancing it after each piece; it ends complete or failed. ``dc``: see
        :meth:`apply` (the compensated gradients are computed whole, first). Each of
        ``consumed`` is called once every gradient is read, before the last piece is published."""
        t0 = time.perf_counter()
        updater, size, background = self.updater, self.layout.size, self._background
        if dc is not None:
            dc_lambda, bases = dc
            grads = [g if base is None else delay_compensated(g, src, base, dc_lambda) for g, base in zip(grads, bases)]
        spread = background is not None and background.threads > 1 and updater.partial and size > PIECE_VALUES
        others: list[Future[None]] = []  # work of other threads that writes into dst
        try:
            if not spread and (progress is None or not updater.partial):
                updater.apply(src, dst, grads, scales, steps)
                _tell_consumed(consumed)
            elif spread:  # every piece on a part thread, copied from src there: the same bits
                assert background is not None
                spans = self._pieces()
                others = [background.spread(updater.apply, src, dst, grads, scales, steps, span) for span in spans]
                for i, ((_, hi), part) in enumerate(zip(spans, others)):
                    part.result()
                    if i == len(spans) - 1:
                        _tell_consumed(consumed)
                    if progress is not None:
                        progress.advance(4 * hi)
            else:
                assert progress is not None
                spans = self._pieces()
                others = self._copy_ahead(src, dst, spans)
                for i, (_, hi) in enumerate(spans):
                    if others:  # dst holds src's values there once copied: the same step, in place
                        others[i].result()
                    updater.apply(dst if others else src, dst, grads, scales, steps, span=spans[i])
                    if i == len(spans) - 1:
                        _tell_consumed(consumed)
                    progress.advance(4 * hi)
        except BaseException as exc:
            for job in others:  # none may write into dst once this has failed
                job.cancel()
            wait(others)
            if progress is not None:
                progress.fail(exc)
            raise
        if progress is not None:
            progress.advance(progress.nbytes)
        self.update_seconds += time.perf_counter() - t0

    def max_abs(self, grad: np.ndarray) -> float:
        """max |g| of a pushed gradient by the updater's stateless ``max_abs``, its pieces on
        the part threads where there are several (the same value: a maximum is exact); NaN
        if it holds a NaN. Changes no state (it may run on any thread)."""
        background = self._background
        if background is None or background.threads == 1 or grad.size <= PIECE_VALUES:
            return self.updater.max_abs(grad)
        parts = [
            background.spread(self.updater.max_abs, grad[lo : lo + PIECE_VALUES])
            for lo in range(0, grad.size, PIECE_VALUES)
        ]
        found = [part.result() for part in parts]
        return math.nan if any(math.isnan(x) for x in found) else max(found)

    def _pieces(self) -> list[tuple[int, int]]:
        """The vector cut into pieces of about :data:`PIECE_VALUES` values, at multiples of
        the updater's grain (the same bits as a whole update)."""
        piece = max(PIECE_VALUES // self.updater.grain, 1) * self.updater.grain
        return [(lo, min(lo + piece, self.layout.size)) for lo in range(0, self.layout.size, piece)]

    def _copy_ahead(self, src: np.ndarray, dst: np.ndarray, spans: list[tuple[int, int]]) -> list[Future[None]]:
        """For an update into a spare buffer: copy ``src`` into ``dst`` span by span on the
        check thread (queued now, in order), one future per span, so the update thread steps
        each span in place while the next is copied; none where there is nothing to copy."""
        if src is dst or self._background is None:
            return []
        check = self._background.check
        return [check(np.copyto, dst[lo:hi], src[lo:hi]) for lo, hi in spans]

    def finish(self) -> None:
        """Wait until the background update, if any, is computed, and call its ``after``
        callbacks (an error of the update is raised here, as :class:`UpdateFailed`, and by
        every later call)."""
        self._usable()
        job, self._in_flight, self._progress = self._in_flight, None, None
        if job is None:
            return
        after, self._after = self._after, []
        try:
            self._failing(job.result)
        finally:
            _call_all(after)

    def _failing(self, compute: Callable[..., Any], *args: Any) -> None:
        """``compute(*args)``; if it raises, the store has failed (:attr:`failure`)."""
        try:
            compute(*args)
        except Exception as exc:
            self.failure = UpdateFailed(f"the update to clock {self.clock} failed, the weights are undefined: {exc!r}")
            self.failure.__cause__ = exc  # already for on_failure (a log of it shows the kernel's traceback)
            self._on_failure(self.failure)
            raise self.failure from exc

    def _usable(self) -> None:
        if self.failure is not None:
            raise self.failure

    def reap(self) -> None:
        """:meth:`finish` if the background update is computed already (never waits)."""
        if self._in_flight is not None and self._in_flight.done():
            self.finish()

    def _spare(self) -> np.ndarray:
        return self._spares.pop() if self._spares else self._new_buffer()

    def _new_buffer(self) -> np.ndarray:
        buf = self._allocate(4 * self.layout.size).view(np.float32)
        self._buffers.append(buf)
        return buf

    def close(self) -> None:
        """Give the buffers back to their allocator (views stay readable). Idempotent; after
        a failed update too."""
        with contextlib.suppress(UpdateFailed):
            self.finish()
        if self._free is not None:
            for buf in self._buffers:
                self._free(buf)
        self._buffers.clear()


def _tell_consumed(consumed: Iterable[Callable[[], None]]) -> None:
    """Call each ``consumed`` hook (from the update thread): an optimisation, whose failure
    (a connection closing meanwhile) is logged, never the update's."""
    for hook in consumed:
        try:
            hook()
        except Exception:
            log.warning("telling a transport that a gradient was read failed", exc_info=True)


def _call_all(callbacks: Iterable[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()

"""The update pipeline: every pushed gradient's way from its bytes to the weights, on the
event loop's side. It owns the update and check threads (:class:`~.store.Background`),
measuring gradients (large ones off the loop, piece by piece while their learner still
writes them), waiting for updates in flight, and reaping computed updates (their
gradients' buffers go back to their transports). The weights, their leases and the
update's progress are the I/O-free :class:`~.store.WeightStore`'s; when to apply is the
core's; when a reply may go is the session's (:meth:`Session._send_weights
<rudra_async.server.session.Session._send_weights>`).

Every push takes one route through it, in these states (a small gradient skips the
threads: measured by the core, computed inline, applied at once). Before it, a large push
over a stream transport may wait in its socket for one of the server's
``--gradient-buffers`` (:mod:`rudra_async.bodies`); a gradient the protocol holds is set
aside from that budget::

    state      how it is entered                      who leaves it, to
    ---------  -------------------------------------  -----------------------------------------
    ARRIVING   the PUSH's header is read; the         the learner's last byte (frame.written
               learner may still write the body       becomes None) -> MEASURED; lost -> gone
    MEASURED   max |g| (and its norm) known:          ServerCore.push -> DECIDED (applied or
               inline, on the check thread, or        held), or refused/dropped (its frame
               piece by piece as written              released)
    DECIDED    the protocol made an update: the       WeightStore.apply: inline -> APPLIED;
               clock advanced                         large model -> COMPUTING
    COMPUTING  the update thread writes the new       Progress complete -> computed; the
               weights piece by piece (Progress),     loop's reap (store.finish) -> APPLIED
               telling the transport the gradient
               is read (Frame.consumed) before the
               last piece
    APPLIED    the weights are published, the         (end: frames released, on_update)
               gradient's frame released

A reply with weights goes in one of three ways, all decided in the session's one route:
at once (no update in flight: inline models, and the express path from the transport's
callback, which is this route carried out without waiting), *while computing* (the
transport writes each piece once Progress says it is final; only while no other learner
has a request in progress), or *after computed* (:meth:`UpdatePipeline.updates_computed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ..config import ServerConfig
from ..errors import UpdateFailed
from ..wire import Frame
from .core import CheckedPush, GradientSize, LearnerInfo, ServerCore
from .store import Background, off_loop, usable_cores

#: how often the loop looks at how much of a gradient is written
POLL_S = 0.001
#: values per piece of a gradient being written that is handed to the check thread
#: (8 MiB of float32: the learner's own pieces)
WRITTEN_PIECE_VALUES = 1 << 21


class UpdatePipeline:
    """The loop's side of the updates of one server (see the module docstring). Made
    before the core (which takes :attr:`background`), then :meth:`bind` to it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        #: validates and applies large gradients off the loop, on --update-threads part threads
        self.background = Background(self._wake, config.update_threads or usable_cores())
        self._core: ServerCore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the weights are given back)."""
        return self._closed

    def bind(self, core: ServerCore) -> None:
        self._core = core

    @property
    def core(self) -> ServerCore:
        assert self._core is not None, "bind() first"
        return self._core

    def start(self) -> None:
        """Computed updates are reaped on the running loop from now on."""
        self._loop = asyncio.get_running_loop()

    # -- ARRIVING -> MEASURED -------------------------------------------------------------
    async def measure(
        self, learner: LearnerInfo, frame: Frame, on_written: Callable[[], None] = lambda: None
    ) -> CheckedPush | None:
        """Check a PUSH and measure its gradient on the check thread, if it is large (the loop
        and the update in flight go on meanwhile), checked once (:class:`CheckedPush`); None
        for a small one, which the core checks and measures inline. A gradient its learner still writes (``frame.written``) is measured
        piece by piece as it is written while no other learner has a request in progress
        (``ServerCore.alone``: otherwise the cores are busy anyway, and the pieces' hand-offs
        cost 2–4% of the updates per second at λ = 2 and 4); one that is small, whose norm
        is bounded, or whose learner is not alone, once all of it is written. Either way the
        whole body is written when this returns, and ``on_written()`` was called as soon as
        it was (before its measure ends; at once for a frame that came whole)."""
        core = self.core
        large = off_loop(frame.body.nbytes // 4)
        piecewise = frame.written is not None and large and self.config.max_grad_norm is None and core.alone(learner)
        if not piecewise:  # as if it had come whole
            await until_written(frame)
            on_written()
        if not large:
            return None
        fields, grad = core.check_push(learner, frame.meta, frame)
        if piecewise:
            check = functools.partial(self.background.check, core.max_abs)
            size = GradientSize(await max_abs_as_written(frame, grad, check, on_written))
        else:
            size = await asyncio.wrap_future(self.background.check(core.measure, grad))
        return CheckedPush(fields, grad, size)

    # -- COMPUTING -> APPLIED ---------------------------------------------------------------
    async def updates_computed(self) -> None:
        """Return once every decided update is computed (waiting without blocking the loop).

        An update decided while this waited is waited for too, so a caller that reads the
        weights right after this returns (no ``await`` in between) never blocks the loop on
        the update thread. Raises :class:`UpdateFailed` if one failed."""
        store = self.core.store
        while store is not None and (job := store.in_flight) is not None and not job.done():
            try:  # shielded: cancelling this wait must not cancel an update that is still queued
                await asyncio.shield(asyncio.wrap_future(job))
            except Exception:
                store.finish()  # raises it as UpdateFailed, the store's failure from now on
                raise

    def _wake(self) -> None:
        """Called on the update thread after each update: reap it on the loop."""
        loop = self._loop
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self.reap)
        except RuntimeError:  # the loop is closed: close() has reaped everything already
            pass

    def reap(self) -> None:
        """Finish a computed update on the loop (its gradients' buffers go back to their
        transports); never waits. A failed update stops the server through the core's
        ``on_failure``."""
        store = self._core.store if self._core is not None else None
        if store is not None and not self._closed:
            with contextlib.suppress(UpdateFailed):
                store.reap()

    def close(self) -> None:
        """Close the store (after the update in flight) and stop the threads. Idempotent."""
        self._closed = True
        self.core.close()
        self.background.close()


async def until_written(frame: Frame) -> None:
    """Return once the whole body of ``frame`` is written (PeerGone if it never will be);
    ``frame.written`` is then None, as for a frame that came whole."""
    written = frame.written
    while written is not None and written() < frame.body.nbytes:
        await asyncio.sleep(POLL_S)
    frame.written = None


async def max_abs_as_written(
    frame: Frame, grad: np.ndarray, check: Callable[[np.ndarray], Future[float]], on_written: Callable[[], None]
) -> float:
    """max |g| of ``grad`` (the body of ``frame``, as values), each piece measured by
    ``check`` (on another thread) once it is written; NaN if any piece holds a NaN. Once
    all of it is written, ``frame.written`` becomes None and ``on_written()`` is called,
    before the last pieces are measured. If the learner never finishes (PeerGone), the
    pieces not yet measured are cancelled and the error is raised."""
    written = frame.written
    assert written is not None, "a frame whose body is being written"
    done, parts = 0, []
    try:
        while done < grad.size:
            final = written() // grad.itemsize
            if final >= min(done + WRITTEN_PIECE_VALUES, grad.size):
                parts.append(asyncio.wrap_future(check(grad[done:final])))
                done = final
            else:
                await asyncio.sleep(POLL_S)
        frame.written = None
        on_written()
    except BaseException:
        for part in parts:
            part.cancel()  # a piece not started is never measured; a running one's result is dropped
        raise
    found = await asyncio.gather(*parts)
    return math.nan if any(math.isnan(x) for x in found) else max(found, default=0.0)

"""The parameter server's asyncio shell: listeners, one session per connection, waiting,
checkpoint scheduling. The state and the rules are the I/O-free :class:`~.core.ServerCore`.

Embed it::

    async with ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"])) as ps:
        print(ps.addresses)
        await ps.serve()          # until ps.close() (or cancellation)

Every request gets exactly one reply. Bad input is answered with an ERROR frame carrying a
stable code; it never changes the weights and never affects other connections.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import checkpoint, transports
from ..config import ServerConfig
from ..errors import ConfigError, FrameTooLarge, PeerGone, RudraError
from ..logs import rate_limited
from ..transports.base import Connection, Listener, SharedMemory
from ..wire import Limits
from .checkpointer import Checkpointer
from .core import ServerCore, learner_extra
from .session import Session
from .stats import Traffic

if TYPE_CHECKING:
    from ..monitor import Monitor

log = rate_limited(logging.getLogger(__name__))  # peers provoke its messages


def shared_memory_of(listen: list[str]) -> SharedMemory | None:
    """Memory that one of the listening transports sends without copying, if any."""
    for url in listen:
        shared = transports.transport_for(url).shared_memory()
        if shared is not None:
            return shared
    return None


class ParameterServer:
    """A server for the weights of one model (or one shard of it); see the module docstring.
    ``initial`` (tensor name → array) seeds the weights instead of the first learner's hello."""

    def __init__(self, config: ServerConfig | None = None, *, initial: dict[str, np.ndarray] | None = None) -> None:
        cfg = self.config = (config or ServerConfig()).validate()
        self.limits = Limits(max_body=cfg.max_frame)
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_every, self.checkpoint)
        self.core = ServerCore(
            cfg,
            initial=initial,
            shared_memory=shared_memory_of(cfg.listen),
            on_change=self._notify,
            on_update=self.checkpointer.after_update,
        )
        if cfg.resume is not None:
            self.core.restore(checkpoint.load(cfg.resume), cfg.resume)
            self.checkpointer.on_disk(cfg.resume, self.core.clock, written=False)
        self._listeners: list[Listener] = []
        self._closed: asyncio.Event | None = None
        self._initialized: asyncio.Event | None = None
        self._changed = asyncio.Event()
        self._blocked: set[int] = set()
        self._waiting: Counter[int] = Counter()  # requests of each learner waiting on the protocol
        self._store_closed = False
        self._shutdown: asyncio.Future[None] | None = None
        self.traffic = Traffic()
        self.monitor: Monitor | None = None  # serving --metrics, once started
        self._watch: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind every listen address; raises ConnectError at once if one cannot be bound."""
        self._closed = asyncio.Event()
        self._initialized = asyncio.Event()
        if self.core.store is not None:
            self._initialized.set()
        try:
            for url in self.config.listen:
                handle = functools.partial(self._handle, url.partition(":")[0])
                self._listeners.append(await transports.listen(url, handle, limits=self.limits))
            if self.config.metrics:
                from ..monitor import Monitor

                self.monitor = Monitor(self)
                await self.monitor.serve(self.config.metrics)
        except BaseException:
            await self.close()
            raise
        self._watch = asyncio.ensure_future(self._watch_learners())
        log.info("parameter server listening on %s (%s)", ", ".join(self.addresses), self.core.protocol.describe())

    async def serve(self) -> None:
        """Run until :meth:`close` is called (starts the server if needed)."""
        if self._closed is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()

    def request_close(self) -> None:
        """Make :meth:`serve` return (e.g. from a signal handler); the owner then awaits :meth:`close`."""
        if self._closed is not None:
            self._closed.set()
        self._notify()

    def close_on_signals(self) -> None:
        """SIGINT and SIGTERM end :meth:`serve` (the owner then closes, writing the final checkpoint)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_close)

    async def close(self) -> None:
        """Stop listening, drop every connection, write the final checkpoint if one is
        configured (a failure to write it is raised). Idempotent; concurrent calls share one shutdown."""
        self.request_close()
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._shutdown)

    async def _shut_down(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.monitor is not None:
            await self.monitor.close()
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        try:
            await self.checkpointer.final(self.core.clock if self.core.store is not None else None)
        finally:
            self._store_closed = True
            self.core.close()

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what an embedding application reads ---------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [listener.address for listener in self._listeners]

    @property
    def clock(self) -> int:
        return self.core.clock

    @property
    def stopped(self) -> bool:
        return self.core.stopped

    @property
    def closing(self) -> bool:
        return self._closed is not None and self._closed.is_set()

    @property
    def blocked(self) -> frozenset[int]:
        """Learners whose reply waits on the protocol now (a hardsync round, a staleness bound)."""
        return frozenset(self._blocked)

    def stop_at(self, updates: int) -> None:
        """End the run once the clock reaches ``updates`` (replies then carry ``stop``)."""
        self.core.stop_at(updates)

    async def wait_initialized(self) -> None:
        """Return once the server has weights (from ``initial``, a checkpoint or the first hello)."""
        assert self._initialized is not None, "start() first"
        await self._initialized.wait()

    def weights(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, by tensor name."""
        return self.core.weights()

    def stats(self, loss_curve: bool = True) -> dict[str, Any]:
        """Statistics for reports and embedding apps (plain JSON-able values); see
        :meth:`ServerCore.stats <rudra_async.server.core.ServerCore.stats>`."""
        return {
            **self.core.stats(loss_curve),
            "checkpoint": dict(self.checkpointer.stats),
            "traffic": self.traffic.totals(),
        }

    # -- checkpoints --------------------------------------------------------------------------
    async def checkpoint(self, path: str | None = None) -> int:
        """Write a checkpoint now, to ``path`` or the configured one; returns its clock.

        The published weights are leased while the file is written in a thread (updates go on
        into a spare buffer), so only the momentum is copied."""
        store = self.core.store
        target = path or self.config.checkpoint
        if store is None or self._store_closed:
            raise RudraError("the server has no weights to checkpoint", code="no_weights")
        if not target:
            raise ConfigError("no checkpoint path: pass one or configure --checkpoint")
        with store.lease() as (clock, weights):
            await asyncio.to_thread(checkpoint.save, target, self.core.snapshot(clock, weights))
        self.checkpointer.on_disk(target, clock)
        log.info("checkpoint of update %d written to %s", clock, target)
        return clock

    # -- waiting ------------------------------------------------------------------------------
    def _notify(self) -> None:
        """The core's state changed: every waiting request re-checks its condition."""
        if self._initialized is not None and self.core.store is not None:
            self._initialized.set()
        self._changed.set()
        self._changed = asyncio.Event()
        self._blocked.clear()  # those still blocked re-enter

    async def wait_until(self, ready: Callable[[], bool], conn: Connection, learner: int) -> None:
        """Wait until ``ready()`` (re-checked on every state change), the run stops or closes.
        Raises PeerGone if the connection is lost meanwhile; ``learner`` is in :attr:`blocked`
        while it waits."""
        if ready() or self.stopped or self.closing:
            return
        lost = asyncio.ensure_future(conn.wait_lost())
        self._waiting[learner] += 1
        try:
            while not (ready() or self.stopped or self.closing):
                self._blocked.add(learner)
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({changed, lost}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if lost.done():
                    raise PeerGone("connection lost while waiting")
        finally:
            self._blocked.discard(learner)
            self._waiting[learner] -= 1
            if not self._waiting[learner]:
                del self._waiting[learner]
            lost.cancel()

    async def _watch_learners(self) -> None:
        """Warn once about each connected learner silent for ``slow_after`` seconds while no
        request of its waits on the server (it is slow, stuck, or gone without a word)."""
        after = self.config.slow_after
        while True:
            await asyncio.sleep(min(after / 4, 5.0))
            for info in self.core.newly_slow(after, self._waiting):
                log.warning(
                    "learner %d (%s) is slow: nothing from it for %g s",
                    info.learner_id,
                    info.name,
                    after,
                    extra=learner_extra(info),
                )

    # -- connections --------------------------------------------------------------------------
    def _allocate(self, msg_type: int, meta: dict[str, Any], nbytes: int) -> None:
        """Once the layout is known, refuse bodies far larger than any valid request (memory safety).

        Up to twice the model size is still read, so a float64 gradient gets a precise
        ``bad_dtype`` answer instead of a dropped connection.
        """
        store = self.core.store
        if store is not None and nbytes > 2 * store.layout.nbytes + 65536:
            raise FrameTooLarge(f"body of {nbytes} bytes is far larger than the model ({store.layout.nbytes} bytes)")
        return None  # the reader's reusable pool takes it

    async def _handle(self, scheme: str, conn: Connection) -> None:
        conn.allocator = self._allocate
        with self.traffic.track(scheme, conn):
            await Session(self, conn).run()

"""The parameter server's state and rules, with no I/O: registration, push validation, the
sync protocol, the LR policy, the update and its accounting.

:class:`ServerCore` is fed requests that have already been read (metadata and arrays) and
answers with plain values or a :class:`~rudra_async.errors.RequestError` carrying a
stable code; it never awaits, reads a socket or a file. The asyncio shell
(:mod:`rudra_async.server.parameter_server`) owns connections and waiting: it calls
``on_change`` hooks of the core to wake requests that wait on the protocol.
:meth:`ServerCore.snapshot` and :meth:`ServerCore.restore` are the whole state a
checkpoint keeps.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import __version__, kernels, registry
from ..checkpoint import Checkpoint
from ..config import ServerConfig
from ..errors import CheckpointError, ConfigError, RequestError, RudraError
from ..kernels import SGD
from ..layout import Layout, Shard
from ..logs import rate_limited
from ..lr import LRPolicy, Schedule
from ..sync import Decision, Gradient, SyncProtocol
from ..transports.base import SharedMemory
from ..wire import Frame
from .stats import StalenessHistogram
from .store import WeightStore

log = rate_limited(logging.getLogger(__name__))  # peers provoke its messages

MAX_LOSSES = 1_000_000  # reported training losses kept for the loss curve


@dataclass
class LearnerInfo:
    """One registered learner (a HELLO on one connection). ``last_seen`` is the core's clock
    (``now()``) at its last request; ``staleness_sum`` the σ of its applied gradients, summed."""

    learner_id: int
    name: str
    peer: str
    applied: int = 0
    dropped: int = 0
    connected: bool = True
    last_seen: float = 0.0
    staleness_sum: int = 0
    slow: bool = False  # set by the shell's watch while it has not been seen for too long

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.applied if self.applied else 0.0


@dataclass(eq=False)
class PendingGradient:
    """A pushed gradient from its acceptance until its update; ``frame`` holds its bytes and
    is released once the gradient is applied or dropped."""

    learner_id: int
    frame: Frame
    grad: np.ndarray
    samples: int
    wait_applied: bool = False  # the pusher's reply waits until the gradient is applied or dropped
    outcome: str = "pending"  # → "applied" | "dropped"
    staleness: int | None = None

    @property
    def settled(self) -> bool:
        return self.outcome != "pending"

    def settle(self, outcome: str, staleness: int | None = None) -> None:
        self.outcome, self.staleness = outcome, staleness
        self.frame.release()


def learner_extra(info: LearnerInfo) -> dict[str, Any]:
    """Fields a machine-readable log line carries about a learner (``logging``'s ``extra``)."""
    return {"learner": info.learner_id, "learner_name": info.name, "peer": info.peer}


def int_field(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    """An integer metadata field (not a bool), or ``bad_request`` naming it."""
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"field {key!r} must be an integer, got {value!r}", code="bad_request")
    return value


def make_loss_curve(losses: list[tuple[int, float]], points: int = 50) -> list[list[float]]:
    """The reported training losses averaged into ``points`` buckets: [[update, loss], ...]."""
    if not losses:
        return []
    size = max(1, len(losses) // points)
    curve = []
    for i in range(0, len(losses), size):
        chunk = losses[i : i + size]
        curve.append([chunk[-1][0], sum(loss for _, loss in chunk) / len(chunk)])
    return curve


def make_protocol(cfg: ServerConfig) -> SyncProtocol:
    proto: SyncProtocol = registry.create("protocol", cfg.protocol, cfg.protocol_kwargs(), SyncProtocol)
    return proto


def make_lr_policy(cfg: ServerConfig) -> LRPolicy:
    policy: LRPolicy = registry.create("lr policy", cfg.lr_policy, cfg.lr_policy_kwargs(), LRPolicy)
    return policy


class ServerCore:
    """One server's state. ``initial`` (tensor name → array) seeds the weights; otherwise
    the first HELLO does. ``shared_memory`` provides the published weight buffers when a
    listening transport sends them by reference. ``on_change()`` is called after every event
    that may release a waiting request; ``on_update(clock)`` after events that applied updates."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        initial: dict[str, np.ndarray] | None = None,
        shared_memory: SharedMemory | None = None,
        on_change: Callable[[], None] = lambda: None,
        on_update: Callable[[int], None] = lambda clock: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        cfg = self.config = config.validate()
        self.kernel = kernels.resolve(cfg.kernel, cfg.device)
        self.protocol = make_protocol(cfg)
        self.lr_policy = make_lr_policy(cfg)
        self.schedule = Schedule(
            cfg.lr, cfg.lr_decay_at, cfg.lr_decay, cfg.lr_decay_unit, cfg.warmup, cfg.lr_scale_ref_batch
        )
        self.shard: Shard = cfg.shard
        self.layout: Layout | None = None  # the whole model's; the store holds this server's shard of it
        self.store: WeightStore | None = None
        self.learners: dict[int, LearnerInfo] = {}
        self.staleness = StalenessHistogram()
        self.rejected: Counter[str] = Counter()
        self.losses: list[tuple[int, float]] = []  # (clock, training loss) as learners report it
        self.samples = 0
        self.update_seconds = 0.0  # time spent in the update kernel
        self.first_update_at: float | None = None
        self.last_update_at: float | None = None
        self._shared_memory = shared_memory
        self._on_change, self._on_update, self._now = on_change, on_update, now
        self._next_id = 0
        if initial is not None:
            layout = Layout.from_shapes((k, np.shape(a)) for k, a in initial.items())
            flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in initial.values()])
            lo, hi = self.shard.range(layout.size)
            self._create_store(layout, flat[lo:hi])

    # -- queries ------------------------------------------------------------------------------
    @property
    def clock(self) -> int:
        return self.store.clock if self.store is not None else 0

    @property
    def stopped(self) -> bool:
        limit = self.config.max_updates
        return limit is not None and self.clock >= limit

    def pull_ready(self, learner_id: int, newer_than: int = -1) -> bool:
        """Whether a pull of ``learner_id`` may be answered now (the clock has passed both
        ``newer_than`` and the protocol's floor for this learner)."""
        return self.clock > max(newer_than, self.protocol.pull_floor(learner_id))

    def weights(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, by tensor name."""
        store = self._need_store()
        flat = store.weights
        return {t.name: flat[t.offset : t.offset + t.size].reshape(t.shape).copy() for t in store.layout.tensors}

    def welcome(self, learner: LearnerInfo) -> dict[str, Any]:
        """The WELCOME metadata for a learner that just registered."""
        store, layout = self._need_store(), self.layout
        assert layout is not None
        return {
            "learner_id": learner.learner_id,
            "layout": layout.to_wire(),
            "shard": self.shard.to_wire(),
            "range": list(self.shard.range(layout.size)),
            **self.protocol.describe(),
            "clock": store.clock,
            "server": f"rudra-async {__version__}",
            "pid": os.getpid(),
        }

    def stats(self, loss_curve: bool = True) -> dict[str, Any]:
        """Statistics for reports and embedding apps (plain JSON-able values). Per learner,
        ``last_seen_s`` is the time since its last request. ``loss_curve=False`` leaves out
        the loss curve, the one entry whose cost grows with the run (for frequent readers)."""
        now = self._now()
        return {
            **self.protocol.describe(),
            "lr_policy": self.config.lr_policy,
            "kernel": self.kernel,
            "shard": str(self.shard),
            "updates": self.clock,
            "gradients": self.staleness.total,
            "dropped": sum(info.dropped for info in self.learners.values()),
            "samples": self.samples,
            "update_seconds": self.update_seconds,
            **self.staleness.summary(),
            "learners": {
                str(i): {
                    "name": info.name,
                    "peer": info.peer,
                    "gradients": info.applied,
                    "dropped": info.dropped,
                    "connected": info.connected,
                    "staleness_mean": info.staleness_mean,
                    "last_seen_s": now - info.last_seen,
                    "slow": info.slow,
                }
                for i, info in self.learners.items()
            },
            "rejected": dict(self.rejected),
            **({"loss_curve": make_loss_curve(self.losses)} if loss_curve else {}),
        }

    # -- events -------------------------------------------------------------------------------
    def reject(self, code: str) -> None:
        """Count a refused request (every refusal, from framing errors to bad fields)."""
        self.rejected[code] += 1

    def stop_at(self, updates: int) -> None:
        """End the run once the clock reaches ``updates`` (replies then carry ``stop``)."""
        if updates < 1:
            raise ConfigError(f"max updates must be >= 1, got {updates}")
        self.config.max_updates = updates
        self._drop_held_if_stopped()
        self._on_change()

    def register(self, meta: dict[str, Any], arrays: list[np.ndarray], peer: str) -> LearnerInfo:
        """A HELLO: check the layout and shard (the first hello of an empty server brings the
        initial weights), register the learner and tell the protocol."""
        layout = Layout.from_wire(meta.get("layout"))
        shard = Shard.from_wire(meta.get("shard"))
        if shard != self.shard:
            raise RequestError(
                f"this server is shard {self.shard}; the learner asked for shard {shard}", code="shard_mismatch"
            )
        if self.store is None:
            self._initialize(layout, arrays, peer)
        elif self.layout is None or layout.to_wire() != self.layout.to_wire():
            raise RequestError("the learner's parameter layout differs from the server's", code="layout_mismatch")
        info = LearnerInfo(self._next_id, str(meta.get("name", "")), peer, last_seen=self._now())
        self._next_id += 1
        self.learners[info.learner_id] = info
        self._decide(self.protocol.join(info.learner_id))
        self._on_change()
        log.info("learner %d (%s) joined from %s", info.learner_id, info.name, peer, extra=learner_extra(info))
        return info

    def leave(self, learner: LearnerInfo, clean: bool = True) -> None:
        """The learner's connection ended: with a bye (``clean``), or lost (crash, close)."""
        learner.connected = False
        self._decide(self.protocol.leave(learner.learner_id))
        self._on_change()
        if clean:
            log.info("learner %d (%s) left", learner.learner_id, learner.name, extra=learner_extra(learner))
        else:
            log.warning(
                "learner %d (%s) is gone: its connection ended without a bye (%d gradients applied)",
                learner.learner_id,
                learner.name,
                learner.applied,
                extra=learner_extra(learner),
            )

    def seen(self, learner: LearnerInfo) -> None:
        """A request from ``learner`` arrived (its ``last_seen``; a slow learner is back)."""
        learner.last_seen = self._now()
        if learner.slow:
            learner.slow = False
            log.info("learner %d (%s) is back", learner.learner_id, learner.name, extra=learner_extra(learner))

    def newly_slow(self, after: float, waiting: Container[int]) -> list[LearnerInfo]:
        """Connected learners not seen for ``after`` seconds that no request of theirs is
        ``waiting`` for (so the server does not hold them back), and not reported yet;
        they are marked ``slow`` until seen again."""
        now = self._now()
        found = [
            info
            for info in self.learners.values()
            if info.connected and not info.slow and now - info.last_seen > after and info.learner_id not in waiting
        ]
        for info in found:
            info.slow = True
        return found

    def push(self, learner: LearnerInfo, meta: dict[str, Any], frame: Frame) -> PendingGradient:
        """Validate a PUSH and hand its gradient to the protocol. The core keeps the frame
        until the gradient is applied or dropped (then releases it)."""
        store = self._need_store()
        self.seen(learner)
        if meta.get("learner_id", learner.learner_id) != learner.learner_id:
            raise RequestError(f"learner id {meta.get('learner_id')!r} is not this connection's", code="bad_request")
        stamp = int_field(meta, "timestamp")
        samples = int_field(meta, "samples", 0)
        if not 0 <= stamp <= store.clock:
            raise RequestError(f"timestamp {stamp} is outside [0, {store.clock}]", code="bad_timestamp")
        if samples < 0:
            raise RequestError(f"samples must be >= 0, got {samples}", code="bad_request")
        if self.stopped:
            raise RequestError(f"the run is over ({self.config.max_updates} updates)", code="stopped")
        specs = frame.specs
        if len(specs) != 1 or specs[0].shape != (store.layout.size,):
            shapes = [list(s.shape) for s in specs]
            raise RequestError(
                f"gradient must be one segment of shape [{store.layout.size}], got {shapes}", code="bad_shape"
            )
        if specs[0].dtype not in (np.float32, np.float16):
            raise RequestError(f"gradient dtype must be <f4 or <f2, got {specs[0].dtype.str}", code="bad_dtype")
        grad = frame.arrays[0]
        if not np.isfinite(grad).all():
            raise RequestError("gradient contains NaN or infinity", code="bad_gradient")
        loss = meta.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and len(self.losses) < MAX_LOSSES:
            self.losses.append((store.clock, float(loss)))
        pending = PendingGradient(learner.learner_id, frame.take(), grad, samples)
        decision = self.protocol.push(Gradient(learner.learner_id, stamp, pending))
        pending.wait_applied = decision.wait_applied
        self._decide(decision)
        return pending

    def pulled(self, learner: LearnerInfo, clock: int) -> None:
        """The learner received the weights of ``clock`` and computes on them."""
        self.seen(learner)
        self._decide(self.protocol.pulled(learner.learner_id, clock))

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self, clock: int, weights: np.ndarray) -> Checkpoint:
        """Everything a checkpoint keeps, with ``weights`` the (leased) published weights of
        ``clock``. Only the momentum is copied."""
        store, layout = self._need_store(), self.layout
        assert layout is not None
        cfg = self.config
        info = {
            "server": f"rudra-async {__version__}",
            "protocol": self.protocol.describe(),
            "kernel": self.kernel,
            "lr": cfg.lr,
            "lr_policy": cfg.lr_policy,
            "momentum": cfg.momentum,
            "weight_decay": cfg.weight_decay,
            "nesterov": cfg.nesterov,
        }
        state = {"staleness": self.staleness.to_dict(), "lr_policy": self.lr_policy.state()}
        return Checkpoint(
            layout, clock, weights, store.updater.momentum, self.samples, info, shard=self.shard, state=state
        )

    def restore(self, ckpt: Checkpoint, source: str = "checkpoint") -> None:
        """Continue from a snapshot (before any learner joined): weights, momentum, clock (the
        protocol's too), samples, staleness histogram and LR-policy state."""
        if self.store is not None:
            raise ConfigError("give the server initial weights or a checkpoint to resume from, not both")
        if ckpt.shard != self.shard:
            raise ConfigError(f"{source} holds shard {ckpt.shard}, but this server is shard {self.shard}")
        store = self._create_store(ckpt.layout, ckpt.weights)
        store.clock = ckpt.clock
        self.protocol.start_at(ckpt.clock)
        store.updater.load_momentum(ckpt.momentum)
        self.samples = ckpt.samples
        try:
            self.staleness.load(ckpt.state.get("staleness", {}))
            self.lr_policy.load_state(ckpt.state.get("lr_policy", {}))
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{source} has a bad 'state' entry: {exc}") from None
        log.info("resumed from %s: update %d, %d parameters", source, ckpt.clock, ckpt.layout.size)

    def close(self) -> None:
        """Give the weight buffers back (views stay readable)."""
        if self.store is not None:
            self.store.close()

    # -- internals ----------------------------------------------------------------------------
    def _need_store(self) -> WeightStore:
        if self.store is None:
            raise RudraError("the server has no weights yet (no learner said hello)", code="no_weights")
        return self.store

    def _initialize(self, layout: Layout, arrays: list[np.ndarray], peer: str) -> None:
        """Weights from the first HELLO: one float32 segment of this shard's size."""
        try:
            lo, hi = self.shard.range(layout.size)
        except ConfigError as exc:
            raise RequestError(str(exc), code="bad_layout") from None
        if len(arrays) != 1 or arrays[0].dtype != np.float32 or arrays[0].size != hi - lo:
            raise RequestError(
                "the server has no weights yet: the first hello must carry the initial weights "
                f"(of shard {self.shard}) as one float32 segment of {hi - lo} values",
                code="no_weights",
            )
        self._create_store(layout, arrays[0].reshape(-1))
        log.info("weights initialized by %s: %d parameters in %d tensors", peer, layout.size, len(layout.tensors))

    def _create_store(self, layout: Layout, shard_weights: np.ndarray) -> WeightStore:
        """Hold this server's shard of a model with the given (whole) layout."""
        shared = self._shared_memory
        self.layout = layout
        self.store = WeightStore(
            self.shard.layout(layout),
            shard_weights,
            self.kernel,
            shared.allocate if shared else None,
            shared.free if shared else None,
        )
        return self.store

    def _decide(self, decision: Decision) -> None:
        """Carry out a protocol decision: apply its batches in order, count its drops. Once the
        run has stopped, gradients a protocol released or still holds are not applied: their
        pushes are answered ``dropped`` and counted under ``rejected["stopped"]``."""
        for batch in decision.updates:
            if self.stopped:
                for g in batch:
                    g.payload.settle("dropped")
                    self.reject("stopped")
            else:
                self._apply(batch)
        for g in decision.dropped:
            g.payload.settle("dropped")
            self.learners[g.learner].dropped += 1
        if decision.updates:
            self._drop_held_if_stopped()
        if decision.updates or decision.dropped:
            self._on_change()
        if decision.updates:
            self._on_update(self.clock)

    def _drop_held_if_stopped(self) -> None:
        """Once the run is over, gradients a protocol still holds will never be applied."""
        if self.stopped:
            for g in self.protocol.release_held():
                g.payload.settle("dropped")
                self.reject("stopped")

    def _apply(self, batch: list[Gradient]) -> None:
        """One update from c = len(batch) gradients (the formula is in docs/protocols.md)."""
        store = self._need_store()
        cfg = self.config
        clock, c = store.clock, len(batch)
        sigmas = [clock - g.stamp for g in batch]
        for s in sigmas:
            self.lr_policy.observe(s)
        pendings: list[PendingGradient] = [g.payload for g in batch]
        samples = sum(p.samples for p in pendings)
        epoch = self.samples / cfg.samples_per_epoch if cfg.samples_per_epoch else None
        base = self.schedule.rate(clock, epoch, samples or None)
        scales = [self.lr_policy.factor(s) / c for s in sigmas]
        t0 = time.perf_counter()
        store.apply([p.grad for p in pendings], scales, SGD(base, cfg.momentum, cfg.weight_decay, cfg.nesterov))
        self.update_seconds += time.perf_counter() - t0
        self.samples += samples
        now = self._now()
        self.first_update_at = self.first_update_at or now
        self.last_update_at = now
        for p, s in zip(pendings, sigmas):
            self.staleness.add(s)
            info = self.learners[p.learner_id]
            info.applied += 1
            info.staleness_sum += s
            p.settle("applied", s)

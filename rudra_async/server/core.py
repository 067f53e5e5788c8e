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

import collections
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import __version__, kernels, schema
from ..checkpoint import Checkpoint
from ..config import ServerConfig, make_lr_policy, make_protocol
from ..errors import CheckpointError, ConfigError, RequestError, RudraError, UpdateFailed, quoted
from ..groups import ParamGroup, default_groups, parse_groups, steps_for
from ..kernels import SGD, Group, max_abs
from ..layout import Layout, Shard
from ..logs import rate_limited
from ..lr import Schedule
from ..model_state import RunState, StateLayout
from ..staleness import StalenessHistogram
from ..sync import Decision, Gradient
from ..wire import Frame, MsgType
from .guard import OutlierGuard
from .store import Background, WeightStore

if TYPE_CHECKING:
    from ..transports.base import SharedMemory  # a type only: the core loads no transport

log = rate_limited(logging.getLogger(__name__))  # peers provoke its messages

#: every code a refusal is counted under in ``stats()["rejected"]``: the error codes of
#: docs/wire.md (but ``shutting_down``, said to learners when the server stops, no refusal)
#: and the connections closed without an ERROR; metrics show each from zero
REFUSAL_CODES = (
    "bad_magic", "bad_version", "frame_too_large", "malformed", "unknown_type", "bad_request", "bad_layout",
    "no_weights", "read_only", "gradient_outlier", "too_many_connections", "evicted", "layout_mismatch",
    "bad_groups", "groups_mismatch", "shard_mismatch", "not_registered", "no_state", "bad_shape", "bad_dtype",
    "bad_gradient", "bad_timestamp", "stopped", "gradient_too_large", "update_not_finite", "reply_too_large",
    "auth_required", "auth_failed", "auth_unavailable",
    "auth_abandoned", "handshake_timeout", "idle_timeout", "reply_not_read", "push_not_written",
)  # fmt: skip
MAX_LOSSES = 1_000_000  # reported training losses kept for the loss curve
MAX_RUN_SAMPLES = schema.INT64_MAX  # P saturates here (a checkpoint stores it as a msgpack int)
#: an update whose bound on every intermediate value stays below this is applied in place
#: without a check; float32 overflows at 3.4e38, so rounding cannot reach it
SAFE_MAGNITUDE = 1e37


@dataclass
class LearnerInfo:
    """One registered learner (a HELLO on one connection). ``last_active`` is the core's
    clock (``now()``) when a request of it last arrived or was answered; ``staleness_sum``
    the σ of its applied gradients, summed."""

    learner_id: int
    name: str
    peer: str
    index: int = 0  # its learner index (its part of the data), unique among connected learners
    applied: int = 0
    dropped: int = 0
    connected: bool = True
    left_cleanly: bool = False  # it left with a bye (or the server shut down), not lost
    busy: int = 0  # requests of this learner the server is handling now
    #: of those, bare PULLs waiting for newer weights: a member that waits for weights
    #: instead of pushing would stall its round, so they do not keep it from being evicted
    parked: int = 0
    writing: bool = False  # its push in hand is still being written (shm): not yet in progress
    last_active: float = 0.0  # when a request of it last arrived or was answered
    evicted: bool = False  # out of the protocol (hung: --learner-timeout) until it shows up again
    rejoined_at: int | None = None  # the clock it rejoined at after an eviction, until it pushes on newer weights
    #: since when it owes a gradient: its hello or the first weights it got after its last push (None: it pushed
    #: since); what --learner-timeout measures, so that pulling again does not keep a learner in a round it stalls
    owes_since: float | None = None
    reader: bool = False  # a client that only reads (HELLO's reader): never in the protocol, holds no index
    evictions: int = 0
    staleness_sum: int = 0
    slow: bool = False  # idle for too long (see ServerCore.newly_slow) until its next request

    @property
    def in_progress(self) -> bool:
        """Whether the server handles a request of it now, not counting a push whose gradient
        it still writes (that push's update comes once it is written, as if it had not arrived)
        nor a PULL parked waiting for newer weights."""
        return self.busy > self.parked and not self.writing

    @property
    def staleness_mean(self) -> float:
        return self.staleness_sum / self.applied if self.applied else 0.0


@dataclass(frozen=True)
class GradientSize:
    """max |g| of a pushed gradient, and its L2 norm if a bound on it is configured."""

    max_abs: float
    norm: float | None = None


@dataclass(frozen=True)
class CheckedPush:
    """A PUSH whose fields and gradient :meth:`ServerCore.check_push` accepted and whose
    gradient was measured (off the event loop, for a large one): what
    :meth:`ServerCore.push` would otherwise check and measure itself."""

    fields: dict[str, Any]
    grad: np.ndarray
    size: GradientSize


@dataclass(eq=False)
class PendingGradient:
    """A pushed gradient from its acceptance until its update; ``frame`` holds its bytes and
    is released once the gradient is applied or dropped."""

    learner_id: int
    frame: Frame
    grad: np.ndarray
    samples: int
    magnitude: float = 0.0  # max |g|
    wait_applied: bool = False  # the pusher's reply waits until the gradient is applied or dropped
    outcome: str = "pending"  # → "applied" | "dropped" | "refused"
    staleness: int | None = None
    refusal_code: str = ""
    refusal: str = ""

    @property
    def settled(self) -> bool:
        return self.outcome != "pending"

    def settle(self, outcome: str, staleness: int | None = None, *, release: bool = True) -> None:
        """Record the outcome; ``release=False`` leaves the frame to whoever still reads it."""
        self.outcome, self.staleness = outcome, staleness
        if release:
            self.frame.release()

    def refuse(self, code: str, message: str) -> None:
        self.refusal_code, self.refusal = code, message
        self.settle("refused")


def learner_extra(info: LearnerInfo) -> dict[str, Any]:
    """Fields a machine-readable log line carries about a learner (``logging``'s ``extra``)."""
    return {"learner": info.learner_id, "learner_name": info.name, "peer": info.peer}


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


def gradient_of(frame: Frame, size: int) -> np.ndarray:
    """A PUSH's gradient: its segments, each one-dimensional and all of one dtype (<f4 or
    <f2), end to end (a view of the body, no copy). Refused with ``bad_shape`` unless their
    lengths add up to ``size``, with ``bad_dtype`` for another dtype or a mix."""
    specs = frame.specs
    if not specs or any(len(s.shape) != 1 for s in specs) or sum(s.shape[0] for s in specs) != size:
        shapes = [list(s.shape) for s in specs]
        raise RequestError(
            f"gradient must be one-dimensional segments whose lengths add up to {size}, got {shapes}",
            code="bad_shape",
        )
    dtypes = {s.dtype.str for s in specs}
    if len(dtypes) != 1 or specs[0].dtype not in (np.float32, np.float16):
        raise RequestError(f"gradient dtype must be one of <f4 or <f2, got {sorted(dtypes)}", code="bad_dtype")
    if len(specs) == 1:
        return frame.arrays[0]
    return np.frombuffer(frame.body, dtype=specs[0].dtype, count=size)


class ServerCore:
    """One server's state. ``initial`` (tensor name → array) seeds the weights; otherwise
    the first HELLO does. ``shared_memory`` provides the published weight buffers when a
    listening transport sends them by reference. ``on_change()`` is called after every event
    that may release a waiting request; ``on_update(clock)`` after events that applied updates;
    ``on_failure(failure)`` once, when computing an update raised (the weights are undefined)."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        initial: dict[str, np.ndarray] | None = None,
        shared_memory: SharedMemory | None = None,
        on_change: Callable[[], None] = lambda: None,
        on_update: Callable[[int], None] = lambda clock: None,
        on_failure: Callable[[UpdateFailed], None] = lambda failure: None,
        now: Callable[[], float] = time.monotonic,
        background: Background | None = None,
    ) -> None:
        """``background``: the thread that validates and applies large gradients (see
        :mod:`.store`); None: all on the caller's thread."""
        cfg = self.config = config.validate()
        self.kernel = kernels.resolve(cfg.kernel, cfg.kernel_device)
        kernels.preload(self.kernel, cfg.kernel_threads)
        self.protocol = make_protocol(cfg)
        self.lr_policy = make_lr_policy(cfg)
        self.schedule = Schedule(
            cfg.lr, cfg.lr_decay_at, cfg.lr_decay, cfg.lr_decay_unit, cfg.warmup, cfg.lr_scale_ref_batch
        )
        self.shard: Shard = cfg.shard
        self.layout: Layout | None = None  # the whole model's; the store holds this server's shard of it
        self.groups: tuple[ParamGroup, ...] = ()  # set with the layout
        self.rates: tuple[float, ...] = ()  # each group's base rate in force (a scheduler's, pushed as `lr`)
        self.state: RunState | None = None  # frozen parameters and buffers, once a HELLO declares them
        self.peak = 0  # the most learners registered at once
        self._outliers = OutlierGuard(cfg.grad_outlier_factor)
        self.store: WeightStore | None = None
        self.learners: dict[int, LearnerInfo] = {}
        self.staleness = StalenessHistogram()
        self.rejected: Counter[str] = Counter()
        self.losses: list[tuple[int, float]] = []  # (clock, training loss) as learners report it
        self.samples = 0
        self.first_update_at: float | None = None
        self.last_update_at: float | None = None
        self.resumed_from: int | None = None  # the checkpoint's clock, after a restore
        self.forgotten: Counter[str] = Counter()  # totals of departed learners no longer listed
        self._departed: collections.deque[int] = collections.deque()
        self._weights_bound = 0.0  # ≥ max |θ| (exact after a check, grows by each update's bound)
        self._momentum_bound = 0.0  # ≥ max |v|
        self._bound_at: dict[int, float] = {}  # clock -> a bound of max |θ| then (delay compensation's versions)
        self.dc_uncompensated = 0  # gradients applied without delay compensation (σ beyond the history)
        self._last_steps: tuple[tuple[float, ...], Sequence[Group], SGD] | None = None  # see _steps
        self._shared_memory = shared_memory
        self._background = background
        self._on_change, self._on_update, self._on_failure, self._now = on_change, on_update, on_failure, now
        self._next_id = 0
        if initial is not None:
            layout = Layout.from_shapes((k, np.shape(a)) for k, a in initial.items())
            flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in initial.values()])
            lo, hi = self.shard.range(layout.size)
            if not math.isfinite(max_abs(flat[lo:hi])):
                raise ConfigError("the initial weights contain NaN or infinity")
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
        cfg = self.config
        return {
            "learner_id": learner.learner_id,
            "layout": layout.to_wire(),
            "shard": self.shard.to_wire(),
            "range": list(self.shard.range(layout.size)),
            **self.protocol.describe(),
            "clock": store.clock,
            "resumed": self.resumed_from,
            "server": f"rudra-async {__version__}",
            "pid": os.getpid(),
            "groups": [g.to_wire() for g in self.groups],
            "lr": list(self.rates),
            "momentum": cfg.momentum,
            "nesterov": cfg.nesterov,
            "index": learner.index,
            "learners": self.learner_count(),
            **({"state": self.state.layout.to_wire()} if self.state is not None else {}),
        }

    def learner_count(self) -> int:
        """λ as learners should shard their data by: ``--expected-learners`` (when set), or the
        learners connected now (readers not counted), and in any case above every connected
        learner's index."""
        indices = [info.index for info in self.learners.values() if info.connected and not info.reader]
        return max(self.config.expected_learners or len(indices), 1 + max(indices, default=0))

    def stats(self, loss_curve: bool = True) -> dict[str, Any]:
        """Statistics for reports and embedding apps (plain JSON-able values). Per learner,
        ``last_seen_s`` is the time since a request of it last arrived or was answered.
        ``loss_curve=False`` leaves out the loss curve, the one entry whose cost grows with
        the run (for frequent readers)."""
        now = self._now()
        return {
            **self.protocol.describe(),
            "lr_policy": self.config.lr_policy,
            "kernel": self.kernel,
            "shard": str(self.shard),
            "updates": self.clock,
            "gradients": self.staleness.total,
            "dropped": sum(info.dropped for info in self.learners.values()) + self.forgotten["dropped"],
            "evictions": sum(info.evictions for info in self.learners.values()) + self.forgotten["evictions"],
            "learners_forgotten": self.forgotten["learners"],
            "samples": self.samples,
            "update_seconds": self.store.update_seconds if self.store is not None else 0.0,
            **self.staleness.summary(),
            "learners": {
                str(i): {
                    "name": info.name,
                    "peer": info.peer,
                    "gradients": info.applied,
                    "dropped": info.dropped,
                    "connected": info.connected,
                    "left": None if info.connected else "bye" if info.left_cleanly else "lost",
                    "evictions": info.evictions,
                    "staleness_mean": info.staleness_mean,
                    "last_seen_s": now - info.last_active,
                    "slow": info.slow,
                }
                for i, info in self.learners.items()
            },
            "rejected": dict(self.rejected),
            **({"dc_uncompensated": self.dc_uncompensated} if self.config.dc_lambda else {}),
            **self.protocol.statistics(),
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
        fields = schema.check(MsgType.HELLO, meta)
        layout = Layout.from_wire(fields["layout"])
        shard = Shard.from_wire(fields["shard"])
        if shard != self.shard:
            raise RequestError(
                f"this server is shard {self.shard}; the learner asked for shard {shard}", code="shard_mismatch"
            )
        groups = parse_groups(fields["groups"], layout) if fields.get("groups") is not None else None
        state = StateLayout.from_wire(fields["state"]) if "state" in fields else None
        if state is not None and self.state is not None and (why := self.state.layout.mismatch(state)):
            raise RequestError(f"the learner's frozen parameters or buffers differ: {why}", code="layout_mismatch")
        if self.store is None:
            self._initialize(layout, arrays, peer, groups)
        elif self.layout is None or layout.to_wire() != self.layout.to_wire():
            raise RequestError("the learner's parameter layout differs from the server's", code="layout_mismatch")
        elif groups is not None and groups != self.groups:
            raise RequestError(
                f"the learner's parameter groups {[g.to_wire() for g in groups]} differ from the server's "
                f"{[g.to_wire() for g in self.groups]}",
                code="groups_mismatch",
            )
        if state is not None and self.state is None:
            self.state = RunState(state)
        reader = fields["reader"]
        index = -1 if reader else self._free_index(fields.get("index"))
        now = self._now()
        info = LearnerInfo(self._next_id, fields["name"], peer, index, last_active=now, owes_since=now, reader=reader)
        self._next_id += 1
        self.learners[info.learner_id] = info
        if not reader:
            self.peak = max(self.peak, sum(1 for i in self.learners.values() if i.connected and not i.reader))
            self._decide(self.protocol.join(info.learner_id))
            self._on_change()
        log.info("learner %d (%s) joined from %s", info.learner_id, info.name, peer, extra=learner_extra(info))
        return info

    def _free_index(self, wanted: int | None) -> int:
        """``wanted`` when no connected learner holds it and it is below ``--expected-learners``
        (if set), else the lowest index no connected learner holds."""
        held = {info.index for info in self.learners.values() if info.connected and not info.reader}
        limit = self.config.expected_learners
        if wanted is not None and wanted not in held and (limit is None or wanted < limit):
            return wanted
        return next(i for i in range(len(held) + 1) if i not in held)

    def leave(self, learner: LearnerInfo, clean: bool = True) -> None:
        """The learner's connection ended: with a bye (``clean``), or lost (crash, close).
        Beyond ``learner_history`` departed learners, the oldest is dropped from the table
        (its counts stay in the totals)."""
        learner.connected, learner.left_cleanly = False, clean
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
        self._departed.append(learner.learner_id)
        while len(self._departed) > self.config.learner_history:
            old = self.learners.pop(self._departed.popleft())
            self.forgotten.update(learners=1, dropped=old.dropped, evictions=old.evictions)

    def alone(self, learner: LearnerInfo) -> bool:
        """Whether no other learner has a request in progress (:attr:`LearnerInfo.in_progress`)."""
        return not any(info.in_progress for info in self.learners.values() if info is not learner)

    def active(self, learner: LearnerInfo) -> None:
        """A request of ``learner`` arrived: a slow learner is back (an evicted one rejoins the
        protocol only with a push: :meth:`push`, :meth:`written`)."""
        learner.busy += 1
        learner.last_active = self._now()
        if learner.slow:
            learner.slow = False
            log.info("learner %d (%s) is back", learner.learner_id, learner.name, extra=learner_extra(learner))

    def writing(self, learner: LearnerInfo) -> None:
        """``learner``'s push in hand arrived before its gradient is all written (shm): until
        :meth:`written` or :meth:`not_written`, it is not a request in progress."""
        learner.writing = True

    def not_written(self, learner: LearnerInfo) -> None:
        """The gradient of ``learner``'s push in hand will never be all written (the
        connection was lost): it no longer counts as being written."""
        learner.writing = False

    def parked(self, learner_id: int, change: int) -> None:
        """A bare PULL of ``learner_id`` starts (+1) or ends (-1) waiting for newer weights: a
        parked wait is no request in progress (:attr:`LearnerInfo.parked`). Nothing for a
        learner the server no longer knows."""
        info = self.learners.get(learner_id)
        if info is not None:
            info.parked += change

    def written(self, learner: LearnerInfo) -> None:
        """The gradient of ``learner``'s push in hand is all written now: the push is in
        progress (:meth:`alone`), and a learner evicted while it wrote rejoins, as if the
        push had arrived now (the protocol then treats its gradient as any rejoining
        learner's: hardsync and backup drop it if the round moved on meanwhile)."""
        learner.writing = False
        self._rejoin(learner)

    def _rejoin(self, learner: LearnerInfo) -> None:
        """An evicted learner that shows up again rejoins the protocol as a newcomer."""
        if learner.evicted and learner.connected:
            learner.evicted, learner.rejoined_at = False, self.clock
            log.warning(
                "learner %d (%s) is back and rejoins", learner.learner_id, learner.name, extra=learner_extra(learner)
            )
            self._decide(self.protocol.join(learner.learner_id))
            self._on_change()

    def idle(self, learner: LearnerInfo) -> None:
        """A request of ``learner`` was answered (or refused)."""
        learner.busy -= 1
        learner.last_active = self._now()

    def evict_hung(self, now: float, timeout: float) -> list[LearnerInfo]:
        """Take out of the protocol every learner an update waits for (``waits_for``) that has
        owed a gradient (since its hello, or since the first weights it got after its last
        push: pulling again does not count) for more than ``timeout`` seconds with no request
        of it in progress but a push whose gradient it still writes or a PULL parked waiting
        for newer weights, so the others go on; it rejoins with its next push, or once that
        gradient is written (a late gradient is then dropped). Not for ``async`` and
        ``softsync``, which wait for nobody."""
        if not self.protocol.waits_for_members:
            return []
        hung = [
            info
            for info in self.learners.values()
            if info.connected
            and not info.evicted
            and not info.in_progress
            and self.protocol.waits_for(info.learner_id)
            and info.owes_since is not None
            and now - info.owes_since > timeout
        ]
        for info in hung:
            info.evicted = True
            info.evictions += 1
            log.warning(
                "learner %d (%s) evicted from the round: no gradient from it for %.1f s after it got its weights "
                "(--learner-timeout %g)",
                info.learner_id,
                info.name,
                now - info.owes_since,  # type: ignore[operator]
                timeout,
                extra=learner_extra(info),
            )
            self._decide(self.protocol.leave(info.learner_id))
        if hung:
            self._on_change()
        return hung

    def newly_slow(self, after: float) -> list[LearnerInfo]:
        """Connected learners idle for ``after`` seconds (no request of theirs in the server,
        so the server does not hold them back), not reported yet; they are marked ``slow``
        until their next request."""
        now = self._now()
        found = [
            info
            for info in self.learners.values()
            if info.connected and not info.slow and not info.busy and now - info.last_active > after
        ]
        for info in found:
            info.slow = True
        return found

    def check_push(self, learner: LearnerInfo, meta: dict[str, Any], frame: Frame) -> tuple[dict[str, Any], np.ndarray]:
        """The checks of a PUSH that do not read its gradient; returns its fields and gradient."""
        store = self._need_store()
        fields = schema.check(MsgType.PUSH, meta)
        if fields.get("learner_id", learner.learner_id) != learner.learner_id:
            raise RequestError(
                f"learner id {quoted(fields['learner_id'])} is not this connection's", code="bad_request"
            )
        if "lr" in fields and len(fields["lr"]) != len(self.groups):
            raise RequestError(
                f"field 'lr' must list one rate per parameter group ({len(self.groups)}), got {len(fields['lr'])}",
                code="bad_request",
            )
        stamp = fields["timestamp"]
        if not 0 <= stamp <= store.clock:
            raise RequestError(f"timestamp {stamp} is outside [0, {store.clock}]", code="bad_timestamp")
        self._check_running()
        return fields, gradient_of(frame, store.layout.size)

    def _check_running(self) -> None:
        if self.stopped:
            raise RequestError(f"the run is over ({self.config.max_updates} updates)", code="stopped")

    def measure(self, grad: np.ndarray) -> GradientSize:
        """What the push rules need to know of a gradient's values (reads it once or twice,
        and the updater's stateless ``max_abs``; changes no state, so it may run on another
        thread)."""
        norm = None
        if self.config.max_grad_norm is not None:
            with np.errstate(over="ignore"):  # a norm past float32's range is inf: refused
                norm = float(np.linalg.norm(grad))
        return GradientSize(self.max_abs(grad), norm)

    def max_abs(self, grad: np.ndarray) -> float:
        """max |g| of (a piece of) a gradient, by the updater's stateless ``max_abs`` (may run
        on another thread)."""
        return self._need_store().max_abs(grad)

    def push(
        self, learner: LearnerInfo, meta: dict[str, Any], frame: Frame, checked: CheckedPush | None = None
    ) -> PendingGradient:
        """Validate a PUSH and hand its gradient to the protocol. The core keeps the frame
        until the gradient is applied or dropped (then releases it). ``checked``: the push
        already checked and measured (:meth:`check_push`, :meth:`measure`); of those checks
        only whether the run is still going is made again (the rest cannot change
        meanwhile: the clock only grows). A refusal (:class:`RequestError`) is raised
        before anything changes (the frame is not taken)."""
        if learner.reader:
            raise RequestError("this client said hello as a reader: it cannot push", code="read_only")
        if checked is None:
            fields, grad = self.check_push(learner, meta, frame)
            size = self.measure(grad)
        else:
            fields, grad, size = checked.fields, checked.grad, checked.size
            self._check_running()
        if not math.isfinite(size.max_abs):
            raise RequestError("gradient contains NaN or infinity", code="bad_gradient")
        bound = self.config.max_grad_norm
        if bound is not None and not (size.norm is not None and size.norm <= bound):
            raise RequestError(
                f"gradient norm {size.norm:.6g} is above the bound {bound:g} (--max-grad-norm)",
                code="gradient_too_large",
            )
        outlier = self._outliers.why(size.max_abs)
        if outlier is not None:
            raise RequestError(outlier, code="gradient_outlier")
        if "lr" in fields:  # a scheduler's rates, in force from the next update computed
            self.rates = tuple(float(r) for r in fields["lr"])
        self._rejoin(learner)  # an evicted learner's push brings it back (pulls do not)
        learner.owes_since = None
        self._outliers.accepted(size.max_abs)
        loss = fields.get("loss")
        if loss is not None and math.isfinite(loss) and len(self.losses) < MAX_LOSSES:
            self.losses.append((self.clock, float(loss)))
        pending = PendingGradient(learner.learner_id, frame.take(), grad, fields["samples"], size.max_abs)
        gradient = Gradient(learner.learner_id, fields["timestamp"], pending)
        if learner.rejoined_at is not None and gradient.stamp < learner.rejoined_at:
            decision = Decision(dropped=[gradient])  # computed before it was evicted: late, whatever the protocol
        else:
            learner.rejoined_at = None
            decision = self.protocol.push(gradient)
        pending.wait_applied = decision.wait_applied
        self._decide(decision)
        if not pending.settled and not any(g is gradient for batch in decision.updates for g in batch):
            pending.frame.set_aside()  # held until others arrive: it no longer counts against the body budget
        return pending

    def receive_state(self, learner: LearnerInfo, meta: dict[str, Any], arrays: list[np.ndarray]) -> list[np.ndarray]:
        """A STATE request: all of the learner's state tensors (the first such request seeds the
        run's values; later ones are only checked) or its buffers (combined into the run's: see
        :class:`~rudra_async.model_state.RunState`). Returns the run's values when asked for
        (``reply``), else nothing. Refused before anything changes."""
        fields = schema.check(MsgType.STATE, meta)
        state = self.state
        if state is None:
            raise RequestError(
                "the run has no frozen parameters or buffers: no HELLO declared them (its 'state')", code="no_state"
            )
        if fields["tensors"] == "all":
            state.layout.check_arrays(state.layout.tensors, arrays)
            if not state.seeded:
                state.seed(arrays)
                log.info("frozen parameters and buffers (%d tensors) from %s", len(arrays), learner.name)
        elif not state.seeded:
            raise RequestError(
                "the run's frozen parameters and buffers have no values yet: send all of them first", code="no_state"
            )
        else:
            state.report(learner.learner_id, arrays, self.peak)
        return list(state.values or []) if fields["reply"] else []

    def pulled(self, learner: LearnerInfo, clock: int) -> None:
        """The learner received the weights of ``clock`` and computes on them (it owes a
        gradient from the first weights it got after its last push)."""
        if learner.owes_since is None:
            learner.owes_since = self._now()
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
        state = {
            "staleness": self.staleness.to_dict(),
            "lr_policy": self.lr_policy.state(),
            "groups": [g.to_wire() for g in self.groups],
            "rates": list(self.rates),
        }
        model_state = self.state if self.state is not None and self.state.values is not None else None
        return Checkpoint(
            layout,
            clock,
            weights,
            store.updater.momentum,
            self.samples,
            info,
            shard=self.shard,
            state=state,
            model_state=model_state.layout if model_state else None,
            model_state_values=list(model_state.values or []) if model_state else [],
        )

    def restore(self, ckpt: Checkpoint, source: str = "checkpoint") -> None:
        """Continue from a snapshot (before any learner joined): weights, momentum, clock (the
        protocol's too), samples, staleness histogram and LR-policy state."""
        if self.store is not None:
            raise ConfigError("give the server initial weights or a checkpoint to resume from, not both")
        if ckpt.shard != self.shard:
            raise ConfigError(f"{source} holds shard {ckpt.shard}, but this server is shard {self.shard}")
        try:
            groups = parse_groups(ckpt.state["groups"], ckpt.layout) if "groups" in ckpt.state else None
        except RequestError as exc:
            raise CheckpointError(f"{source} has bad parameter groups: {exc}") from None
        configured = default_groups(ckpt.layout, self.config.lr, self.config.weight_decay)
        if groups is not None and groups != configured:
            log.warning(
                "resuming with %s's parameter groups %s ([tensors, lr, weight_decay]); "
                "--lr %g --weight-decay %g apply only to a new run",
                source,
                [g.to_wire() for g in groups],
                self.config.lr,
                self.config.weight_decay,
            )
        momentum_bound = max_abs(ckpt.momentum)
        if not math.isfinite(max_abs(ckpt.weights)) or not math.isfinite(momentum_bound):
            raise CheckpointError(f"{source} holds weights or momentum that are not finite")
        try:  # each raises before it changes anything; both before the store exists
            self.lr_policy.load_state(ckpt.state.get("lr_policy", {}))
            self.staleness.load(ckpt.state.get("staleness", {}))
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{source} has a bad 'state' entry: {exc}") from None
        store = self._create_store(ckpt.layout, ckpt.weights, groups)
        self.rates = tuple(float(r) for r in ckpt.state.get("rates", self.rates))
        if ckpt.model_state is not None:
            self.state = RunState(ckpt.model_state, [a.copy() for a in ckpt.model_state_values])
        store.clock = ckpt.clock
        self.protocol.start_at(ckpt.clock)
        store.updater.load_momentum(ckpt.momentum)
        self._momentum_bound = momentum_bound
        self.resumed_from = ckpt.clock
        self.samples = ckpt.samples
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

    def _initialize(
        self, layout: Layout, arrays: list[np.ndarray], peer: str, groups: tuple[ParamGroup, ...] | None
    ) -> None:
        """Weights (and parameter groups) from the first HELLO: one float32 segment of this shard's size."""
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
        if not math.isfinite(max_abs(arrays[0])):
            raise RequestError("the initial weights contain NaN or infinity", code="no_weights")
        self._create_store(layout, arrays[0].reshape(-1), groups)
        log.info("weights initialized by %s: %d parameters in %d tensors", peer, layout.size, len(layout.tensors))

    def _create_store(
        self, layout: Layout, shard_weights: np.ndarray, groups: tuple[ParamGroup, ...] | None = None
    ) -> WeightStore:
        """Hold this server's shard of a model with the given (whole) layout and groups
        (default: one group with the configured learning rate and weight decay)."""
        shared = self._shared_memory
        self.layout = layout
        self.groups = groups or default_groups(layout, self.config.lr, self.config.weight_decay)
        self.rates = tuple(g.lr for g in self.groups)
        self.store = WeightStore(
            self.shard.layout(layout),
            shard_weights,
            self.kernel,
            shared.allocate if shared else None,
            shared.free if shared else None,
            self._background,
            self._on_failure,
            history=self.config.dc_history if self.config.dc_lambda else 0,
        )
        self._weights_bound = max_abs(self.store.weights)
        return self.store

    def _decide(self, decision: Decision) -> None:
        """Carry out a protocol decision: apply its batches in order, count its drops. Once the
        run has stopped, gradients a protocol released or still holds are not applied: their
        pushes are answered ``dropped`` and counted under ``rejected["stopped"]``, and the
        protocol's clock, which counted their update, goes back to the server's."""
        for batch in decision.updates:
            if self.stopped:
                for g in batch:
                    g.payload.settle("dropped")
                    self.reject("stopped")
                self.protocol.clock -= 1  # that update never happens (a run extended later goes on from here)
            else:
                self._apply(batch)
        for g in decision.dropped:
            g.payload.settle("dropped")
            if g.learner in self.learners:
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
        """One update from c = len(batch) gradients (the formula is in docs/protocols.md).

        An update whose result would not be finite is not applied: the weights and the
        momentum stay as they were, the clock still advances (so every protocol's rounds stay
        in step), and its gradients are refused with ``update_not_finite``. Checking costs
        nothing on the common path: a bound on every intermediate value is kept from each
        gradient's max |g| (measured when it was validated), and only an update whose bound
        comes near float32's range is computed aside and checked before it is published."""
        store = self._need_store()
        cfg = self.config
        clock, c = store.clock, len(batch)
        sigmas = [clock - g.stamp for g in batch]
        observed_before = self.lr_policy.state()  # restored if the update is not applied
        for s in sigmas:
            self.lr_policy.observe(s)
        pendings: list[PendingGradient] = [g.payload for g in batch]
        samples = sum(p.samples for p in pendings)
        epoch = self.samples / cfg.samples_per_epoch if cfg.samples_per_epoch else None
        rate, boost = self.schedule.rate, self.lr_policy.rate_factor(clock)
        momentum = self.lr_policy.momentum(cfg.momentum) if cfg.momentum else 0.0
        steps, worst = self._steps(
            tuple(rate(clock, epoch, samples or None, base=r) * boost for r in self.rates), momentum
        )
        scales = [self.lr_policy.factor(s) / c for s in sigmas]
        bases = None
        if cfg.dc_lambda:
            bases = store.versions([g.stamp for g in batch])
            self._bound_at[clock] = self._weights_bound  # θ_t's, for later gradients stamped t
            for j in [j for j in self._bound_at if j <= clock - cfg.dc_history]:
                del self._bound_at[j]
        magnitudes = self._magnitudes(pendings, [g.stamp for g in batch], bases)
        weights_bound, momentum_bound = self._bounds(magnitudes, scales, worst)  # the largest group's rates bound all
        grads = [p.grad for p in pendings]
        releases = [p.frame.release for p in pendings]  # once the update has read the gradients
        consumed = [p.frame.consumed for p in pendings]  # ... told from the update thread, before its last piece
        dc = (cfg.dc_lambda, bases) if bases is not None else None
        if max(weights_bound, momentum_bound) <= SAFE_MAGNITUDE:
            store.apply(grads, scales, steps, after=releases, dc=dc, consumed=consumed)
            self._weights_bound, self._momentum_bound = weights_bound, momentum_bound
        elif store.apply(grads, scales, steps, check=True, after=releases, dc=dc):
            self._weights_bound = max_abs(store.weights)  # exact again after a near miss
            self._momentum_bound = max_abs(store.updater.momentum) if cfg.momentum else self._momentum_bound
        else:
            message = f"the update at clock {clock} would make weights or momentum overflow; it was not applied"
            log.warning("%s (gradients of learners %s)", message, sorted({p.learner_id for p in pendings}))
            self.lr_policy.load_state(observed_before)  # its gradients are dropped: never observed
            for p in pendings:
                self.reject("update_not_finite")
                p.refuse("update_not_finite", message)
            return
        if bases is not None:
            self.dc_uncompensated += sum(1 for s, base in zip(sigmas, bases) if s > 0 and base is None)
        self.samples = min(self.samples + samples, MAX_RUN_SAMPLES)
        now = self._now()
        self.first_update_at = self.first_update_at or now
        self.last_update_at = now
        for p, s in zip(pendings, sigmas):
            self.staleness.add(s)
            info = self.learners.get(p.learner_id)  # None: forgotten (beyond learner_history)
            if info is not None:
                info.applied += 1
                info.staleness_sum += s
            p.settle("applied", s, release=False)

    def _steps(self, rates: tuple[float, ...], momentum: float) -> tuple[Sequence[Group], SGD]:
        """The kernel's groups for an update whose learning rates are ``rates`` (one per
        group) and whose momentum is ``momentum``, and the settings that bound them all (the
        largest rate and weight decay). The last update's again while its settings were the
        same (a constant schedule's always): building them costs a small update a few microseconds."""
        key = (*rates, momentum)
        if self._last_steps is None or self._last_steps[0] != key:
            layout, cfg = self.layout, self.config
            assert layout is not None, "an update needs the store, so the layout exists"
            span = self.shard.range(layout.size)
            steps = tuple(steps_for(self.groups, layout, span, rates, momentum, cfg.nesterov))
            lr, decay = max(g.sgd.lr for g in steps), max(g.sgd.weight_decay for g in steps)
            self._last_steps = (key, steps, SGD(lr, momentum, decay, cfg.nesterov))
        return self._last_steps[1], self._last_steps[2]

    def _magnitudes(
        self, pendings: list[PendingGradient], stamps: list[int], bases: list[np.ndarray | None] | None
    ) -> list[float]:
        """A bound on max |g| of each gradient as the update uses it, and on every intermediate
        value of its delay compensation (``bases``: the kept version each is compensated with,
        or None): |g ⊙ g ⊙ (θ_t − θ_j)| ≤ m²·(W_t + W_j), W_j the bound of max |θ| recorded at
        clock j (:attr:`_bound_at`, kept for the versions' span only)."""
        if bases is None:
            return [p.magnitude for p in pendings]
        lam = float(np.float32(self.config.dc_lambda))  # as the kernel rounds it
        found = []
        for p, stamp, base in zip(pendings, stamps, bases):
            m = p.magnitude
            if base is None:
                found.append(m)
                continue
            width = self._weights_bound + self._bound_at.get(stamp, math.inf)
            term = m * m * width
            found.append(math.inf if max(m * m, width, term, term * lam) > SAFE_MAGNITUDE else m + lam * term)
        return found

    def _bounds(self, magnitudes: list[float], scales: list[float], sgd: SGD) -> tuple[float, float]:
        """Upper bounds of max |θ| and max |v| after this update, and (through them) of every
        intermediate value of its float32 arithmetic (infinite when a factor is out of range).
        ``magnitudes``: a bound on max |g| of each gradient."""
        if max(sgd.lr, sgd.weight_decay, *(abs(s) for s in scales)) > SAFE_MAGNITUDE:
            return math.inf, math.inf
        d = sum(abs(s) * m for s, m in zip(scales, magnitudes)) + sgd.weight_decay * self._weights_bound
        if sgd.momentum:
            v = sgd.momentum * self._momentum_bound + d
            step = d + sgd.momentum * v if sgd.nesterov else v
        else:
            v, step = self._momentum_bound, d
        return self._weights_bound + sgd.lr * step, max(v, step)

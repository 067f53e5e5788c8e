"""Synchronization protocols: I/O-free state machines that decide when gradients make an update.

The server feeds events — a learner joined or left, a learner received weights stamped j
(it is now computing on them), a gradient arrived — and gets back a :class:`Decision`: the
batches to apply now, in order (each batch is one update, c = its length), the gradients
dropped, and for the pushing learner whether its reply must wait for its gradient to be
applied. :meth:`SyncProtocol.pull_floor` says which clock a learner's next weights must be
newer than. Nothing here does I/O or reads a clock, so everything is testable by feeding
events; time-based protocols take an injectable ``now``.

λ is the number of registered learners at the moment; every protocol recomputes c when it
changes, so a learner leaving (or crashing) never deadlocks a round.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "AdaptiveSoftsync",
    "Async",
    "Backup",
    "Bounded",
    "Decision",
    "Gradient",
    "Hardsync",
    "Softsync",
    "SyncProtocol",
    "overlap_breaks",
]


@dataclass(eq=False)
class Gradient:
    """A pushed gradient as the protocol sees it; ``payload`` is opaque (the server's buffer)."""

    learner: int
    stamp: int
    payload: Any = None


@dataclass
class Decision:
    updates: list[list[Gradient]] = field(default_factory=list)
    dropped: list[Gradient] = field(default_factory=list)
    wait_applied: bool = False  # the pusher's reply waits until its gradient is applied or dropped


class SyncProtocol:
    """Base class: membership bookkeeping and the update clock. Subclasses decide batching.

    Hooks a subclass (or a plugin) overrides: ``on_push``, ``on_membership`` (a learner
    joined or left) and ``on_pulled`` (a learner started computing on newer weights; only
    protocols that hold gradients for the sake of computing learners care) return the
    batches that are ready; the base class advances ``clock`` by one per batch. A protocol
    that holds gradients also overrides ``release_held`` (called when the run stops).
    """

    name = "?"
    #: False for a protocol whose rounds wait for no learner (async): no hung learner to evict
    waits_for_members = True
    #: True for a protocol that answers every push at once: ``push`` applies the gradient
    #: (a batch of one) or drops it, never holds it or sets ``wait_applied``, and
    #: ``pull_floor`` is always −1. The server may then answer a small push+pull from the
    #: transport's callback, without a task switch (see ``Session.express``).
    answers_at_once = False

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.clock = 0
        self.members: set[int] = set()
        self.computing: dict[int, int] = {}  # learner -> stamp of the weights it works on

    @property
    def learners(self) -> int:
        return len(self.members)

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name}

    def statistics(self) -> dict[str, Any]:
        """What the protocol reports beside the server's statistics (``stats()``); none by default."""
        return {}

    def start_at(self, clock: int) -> None:
        """Continue the update clock from ``clock`` (a run resumed from a checkpoint)."""
        if self.members:
            raise RuntimeError("the clock can only be set before any learner joins")
        self.clock = clock

    # -- events ---------------------------------------------------------------------------
    def join(self, learner: int) -> Decision:
        self.members.add(learner)
        return self._ready(self.on_membership())

    def leave(self, learner: int) -> Decision:
        self.members.discard(learner)
        self.computing.pop(learner, None)
        return self._ready(self.on_membership())

    def pulled(self, learner: int, stamp: int) -> Decision:
        """The learner received weights stamped ``stamp`` and computes on them."""
        if learner in self.members:
            self.computing[learner] = stamp
        return self._ready(self.on_pulled())

    def push(self, grad: Gradient) -> Decision:
        if grad.stamp > self.clock:
            raise ValueError(f"gradient stamp {grad.stamp} is ahead of the clock {self.clock}")
        self.computing.pop(grad.learner, None)
        decision = self.on_push(grad)
        self._ready(decision.updates, into=decision)
        return decision

    def pull_floor(self, learner: int) -> int:
        """A learner's next weights must have a clock greater than this (−1: any)."""
        return -1

    def waits_for(self, learner: int) -> bool:
        """Whether an update waits for a gradient of ``learner`` now (so a hung one would stall
        the others: ``--learner-timeout`` may evict it). Default: every member, where
        :attr:`waits_for_members`."""
        return self.waits_for_members and learner in self.members

    def release_held(self) -> list[Gradient]:
        """Give up every gradient held for a later update (the run stopped): they are returned
        and forgotten, and the server answers their pushes ``dropped``."""
        return []

    # -- for subclasses -------------------------------------------------------------------
    def on_push(self, grad: Gradient) -> Decision:
        raise NotImplementedError

    def on_membership(self) -> list[list[Gradient]]:
        return []

    def on_pulled(self) -> list[list[Gradient]]:
        return []

    def _ready(self, batches: list[list[Gradient]], into: Decision | None = None) -> Decision:
        decision = into or Decision(updates=batches)
        self.clock += len(batches)
        return decision


class Softsync(SyncProtocol):
    """n-softsync: every c = ⌊λ/n⌋ gradients, from any learners, make an update; no barrier
    (so no learner is waited for, and none evicted: a slow one's gradients still count)."""

    name = "softsync"
    waits_for_members = False

    def __init__(self, n: int = 1, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(now)
        if n < 1:
            raise ConfigError(f"softsync needs n >= 1, got {n}")
        self.n = n
        self.pending: list[Gradient] = []

    @property
    def c(self) -> int:
        return max(1, self.learners // self.n)

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name, "n": self.n}

    def _take_full_batches(self) -> list[list[Gradient]]:
        batches: list[list[Gradient]] = []
        while self.pending and len(self.pending) >= self.c:
            batch, self.pending = self.pending[: self.c], self.pending[self.c :]
            batches.append(batch)
            self._batched(batch, self.clock + len(batches) - 1)
        return batches

    def _batched(self, batch: list[Gradient], clock: int) -> None:
        """``batch`` makes the update at ``clock`` (a hook; c may change after it)."""

    def on_push(self, grad: Gradient) -> Decision:
        self.pending.append(grad)
        return Decision(updates=self._take_full_batches())

    def release_held(self) -> list[Gradient]:
        held, self.pending = self.pending, []
        return held

    def on_membership(self) -> list[list[Gradient]]:
        return self._take_full_batches()


class AdaptiveSoftsync(Softsync):
    """n-softsync whose n follows the measured staleness toward ``target`` (docs/protocols.md):
    after every :data:`WINDOW` updates, if the mean σ of their gradients, m, is outside
    target·(1 ± :data:`BAND`), n becomes ⌊n·target/m + 1/2⌋ (λ when m = 0), kept within
    [1, max(1, λ)]. n starts at ⌊target + 3/2⌋ (homogeneous learners settle at σ ≈ n − 1).
    :attr:`trajectory` holds (clock from which it holds, n) for every n used."""

    name = "adaptive"
    #: updates between two decisions
    WINDOW = 32
    #: the tolerated relative distance of the measured mean σ from the target
    BAND = 0.25
    #: the target without ``--staleness-target``
    DEFAULT_TARGET = 2.0

    def __init__(self, target: float = DEFAULT_TARGET, now: Callable[[], float] = time.monotonic) -> None:
        if not (isinstance(target, (int, float)) and 0 < target < float("inf")):
            raise ConfigError(f"adaptive softsync needs a staleness target > 0, got {target!r}")
        super().__init__(math.floor(target + 1.5), now)
        self.target = float(target)
        self.trajectory: list[tuple[int, int]] = [(0, self.n)]
        self._sigmas = 0  # the sum of σ over the window's gradients
        self._gradients = 0
        self._updates = 0

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name, "n": self.n, "staleness_target": self.target}

    def statistics(self) -> dict[str, Any]:
        return {"n_trajectory": [list(point) for point in self.trajectory]}

    def start_at(self, clock: int) -> None:
        super().start_at(clock)
        self.trajectory = [(clock, self.n)]

    def _batched(self, batch: list[Gradient], clock: int) -> None:
        """Count the σ of an update's gradients; decide n at the end of each window."""
        self._sigmas += sum(clock - g.stamp for g in batch)
        self._gradients += len(batch)
        self._updates += 1
        if self._updates < self.WINDOW:
            return
        mean = self._sigmas / self._gradients
        self._sigmas = self._gradients = self._updates = 0
        if abs(mean - self.target) <= self.BAND * self.target:
            return
        top = max(1, self.learners)
        n = top if mean == 0 else min(top, max(1, math.floor(self.n * self.target / mean + 0.5)))
        if n != self.n:
            self.n = n
            self.trajectory.append((clock + 1, n))


class Async(Softsync):
    """Downpour async SGD: every gradient is an update (c = 1)."""

    name = "async"
    answers_at_once = True

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(1, now)

    @property
    def c(self) -> int:
        return 1

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name}  # no n: c is always 1


class Hardsync(SyncProtocol):
    """One gradient from every learner of the round, for the current clock; learners wait.

    A round's participants are the learners registered when it began, and a learner that
    joins before any gradient of the round arrived; a learner joining later is counted from
    the next update. A newcomer never waits for weights: its first pull is answered at once
    (a gradient it computes on them for a round it is not part of is dropped). So no learner
    waits before it has pushed, and no waits can go round in a circle: with sharded servers,
    a newcomer that waited on one shard for a round that needs, on that shard, a learner that
    itself waits on another shard for the newcomer's gradient would deadlock them. A late
    gradient (stamp older than the clock) or a second one in a round is dropped and counted.
    """

    name = "hardsync"

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(now)
        self.round: set[int] | None = None  # participants of the round for self.clock
        self.got: dict[int, Gradient] = {}
        self.last_stamp: dict[int, int] = {}

    def needed(self) -> int:
        """Gradients that complete the current round."""
        assert self.round is not None
        return len(self.round)

    def join(self, learner: int) -> Decision:
        if self.round is not None and not self.got:
            self.round.add(learner)  # no gradient of this round yet: take part in it
        return super().join(learner)

    def leave(self, learner: int) -> Decision:
        self.last_stamp.pop(learner, None)  # nothing per learner outlives its membership
        return super().leave(learner)

    def pull_floor(self, learner: int) -> int:
        return self.last_stamp.get(learner, -1)

    def waits_for(self, learner: int) -> bool:
        """The round in progress waits for its participants that have not pushed yet."""
        return self.round is not None and learner in self.round and learner not in self.got

    def _start_round(self) -> None:
        self.round = set(self.members)
        self.got = {}

    def on_push(self, grad: Gradient) -> Decision:
        self.last_stamp[grad.learner] = grad.stamp
        if self.round is None:
            self._start_round()
        assert self.round is not None
        if grad.stamp < self.clock or grad.learner not in self.round or grad.learner in self.got:
            return Decision(dropped=[grad])
        self.got[grad.learner] = grad
        return Decision(updates=self._complete())

    def release_held(self) -> list[Gradient]:
        held, self.got = list(self.got.values()), {}
        return held

    def on_membership(self) -> list[list[Gradient]]:
        if self.round is None:
            return []
        self.round &= self.members | set(self.got)  # leavers that already pushed still count
        return self._complete()

    def _complete(self) -> list[list[Gradient]]:
        assert self.round is not None
        if not self.round:  # everyone of the round left without a gradient
            self.round = None
            return []
        if len(self.got) < self.needed():
            return []
        batch = list(self.got.values())
        self.round = set(self.members)  # the next round: everyone registered now
        self.got = {}
        return [batch]


class Backup(Hardsync):
    """Hardsync with b backup learners: the update happens after λ − b gradients of the
    round; the b late ones (stamped with an older clock) are dropped and counted."""

    name = "backup"

    def __init__(self, b: int = 1, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(now)
        if b < 0:
            raise ConfigError(f"backup needs b >= 0, got {b}")
        self.b = b

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name, "backup": self.b}

    def needed(self) -> int:
        assert self.round is not None
        return max(1, len(self.round) - self.b)


class Bounded(SyncProtocol):
    """Bounded staleness (stale-synchronous): no gradient is applied with σ > s.

    A gradient that arrives with σ > s already (its learner computed on weights older than
    the server counted on: it overlaps its exchanges, or pushed while its weights were still
    on their way) is dropped. Others are applied on arrival (c = 1) unless advancing the clock would leave a
    learner still computing on weights older than clock + 1 − s; then the gradient is held
    and **the pusher waits at push** (its reply is deferred until its gradient is applied).
    Waiting at push, not at pull, is what keeps the bound: it is applying the fast learner's
    gradient that would make the slow learner's gradient too stale. When several held
    gradients would cross the bound together they form one update (c > 1), so s = 0
    degenerates to a barrier instead of a deadlock.
    """

    name = "bounded"

    def __init__(self, s: int = 4, now: Callable[[], float] = time.monotonic) -> None:
        super().__init__(now)
        if s < 0:
            raise ConfigError(f"the staleness bound must be >= 0, got {s}")
        self.s = s
        self.held: list[Gradient] = []

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name, "staleness_bound": self.s}

    def on_push(self, grad: Gradient) -> Decision:
        if self.clock - grad.stamp > self.s:
            return Decision(dropped=[grad])
        self.held.append(grad)
        return Decision(updates=self._drain(), wait_applied=True)

    def on_membership(self) -> list[list[Gradient]]:
        return self._drain()

    def on_pulled(self) -> list[list[Gradient]]:
        return self._drain()  # a slow learner moving on may free held gradients

    def release_held(self) -> list[Gradient]:
        held, self.held = self.held, []
        return held

    def _drain(self) -> list[list[Gradient]]:
        batches: list[list[Gradient]] = []
        clock = self.clock
        while self.held:
            oldest_computing = min(self.computing.values(), default=None)
            if oldest_computing is not None and clock + 1 - oldest_computing > self.s:
                break  # a learner still computing would exceed the bound: wait for it
            self.held.sort(key=lambda g: g.stamp)
            batch = [self.held[0]] + [g for g in self.held[1:] if clock + 1 - g.stamp > self.s]
            self.held = [g for g in self.held if g not in batch]
            batches.append(batch)
            clock += 1
        return batches


def overlap_breaks(protocol: dict[str, Any]) -> str | None:
    """Why learners that overlap their exchanges with computing (each gradient computed on the
    weights of the exchange before: σ ≥ 1) cannot train under ``protocol`` (its description,
    :meth:`SyncProtocol.describe`, as a WELCOME carries it), or None where they can."""
    name = protocol.get("protocol")
    if name in (Hardsync.name, Backup.name):
        return (
            f"{name} drops every gradient computed on weights older than its round's, as an overlapping learner's are"
        )
    if name == Bounded.name and protocol.get("staleness_bound") == 0:
        return "bounded with a staleness bound of 0 drops every gradient with σ > 0, as an overlapping learner's are"
    return None

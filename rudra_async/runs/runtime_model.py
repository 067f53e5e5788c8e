"""A discrete-event model of a run's wall time, from measured costs (docs/study/runtime_model.md).

λ learners and one server share ``cores`` CPU cores, processor-sharing: whatever is running
at a moment (a learner computing or exchanging, the server handling a push) gets
min(1, cores/running) of a core. The server's handling of a push, and a learner's taking of
its reply, cost ``switch_s`` more when they start while another process runs: the process
cannot take over the core its sender just left (on a VM, an interrupt to another virtual
CPU; a cold cache). A push that waited in the server's queue is read right after the one
before it, without a wake-up, so it pays no switch. A learner's step is its compute
(``compute_s`` of CPU for one mini-batch), then its side of the exchange (``client_s`` of CPU, half before its push
leaves, half after the reply arrives), each message ``latency_s`` on the wire. The server is
one thread: pushes queue and are handled in arrival order, each costing ``server_s`` of CPU,
and the push that completes an update also its update, ``update_s + (c − 1)·combine_s``;
hardsync's other pushes of a round cost ``hold_s`` more (the request is held, then
resumed and answered after the update). A woken process also refills the caches that the
others' work evicted while it was away: ``cold_s·(1 − exp(−w/cold_tau_s))`` more CPU, w being
the CPU seconds the other processes ran per core since its last job ended, when there are
more processes than cores (this is what makes many learners per core slower than processor
sharing alone would; with a core each, nothing evicts a process's caches).
The protocol decides when an update is made and when a push is answered: ``async``
(c = 1, answered after its update), ``softsync`` (c = max(1, ⌊λ/n⌋), answered at once),
``hardsync`` (c = λ, every push of a round answered after the round's update). With
``overlap`` (train's ``--overlap``) a learner computes its next gradient while its exchange
runs and pushes it when that exchange is over.

:func:`simulate` runs it for a number of updates and returns updates/s, samples/s and the
mean staleness. Nothing here measures; ``benchmarks/runtime_model.py`` calibrates the costs
on the machine at hand and validates the model against real runs.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError


@dataclass(frozen=True)
class Costs:
    """What one step costs, in seconds (CPU seconds but for ``latency_s``)."""

    compute_s: float  # a learner's forward and backward on one mini-batch
    client_s: float  # a learner's side of one push+pull
    server_s: float  # the server's handling of one push, update excluded
    update_s: float  # the server's update with one gradient
    combine_s: float = 0.0  # each further gradient of an update
    latency_s: float = 0.0  # one message on the wire
    switch_s: float = 0.0  # waking a process while another runs
    hold_s: float = 0.0  # hardsync: the server's extra CPU for each push it holds until the round's update
    cold_s: float = 0.0  # the most a woken process spends more refilling its caches
    cold_tau_s: float = 0.0  # the others' CPU seconds per core that evict 1 − 1/e of them

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ConfigError(f"runtime model: {name} must be >= 0, got {value}")
        if self.cold_s and not self.cold_tau_s:
            raise ConfigError("runtime model: cold_s needs cold_tau_s > 0")

    def refill_s(self, others_per_core: float) -> float:
        """A woken process's cache refill after the others ran ``others_per_core`` CPU
        seconds per core since its last job: ``cold_s·(1 − exp(−others_per_core/cold_tau_s))``."""
        return self.cold_s * -math.expm1(-others_per_core / self.cold_tau_s) if self.cold_s else 0.0


@dataclass(frozen=True)
class Prediction:
    updates_per_s: float
    samples_per_s: float
    staleness_mean: float
    wall_s: float


def gradients_per_update(protocol: str, learners: int, n: int | None = None) -> int:
    """c for ``protocol`` with λ = ``learners``."""
    if protocol == "async":
        return 1
    if protocol == "hardsync":
        return learners
    if protocol == "softsync":
        return max(1, learners // (n or 1))
    raise ConfigError(f"the runtime model knows async, softsync and hardsync, not {protocol!r}")


class _Cpu:
    """Processor sharing: jobs (owner → CPU seconds left) run at min(1, cores/running) each."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.left: dict[Any, float] = {}
        self.work = 0.0  # CPU seconds run so far, all jobs together

    def rate(self) -> float:
        return min(1.0, self.cores / len(self.left)) if self.left else 1.0

    def next_done(self) -> float:
        """Seconds until the first job ends (inf: none runs)."""
        return min(self.left.values()) / self.rate() if self.left else float("inf")

    def advance(self, dt: float) -> list[Any]:
        """Run every job for ``dt`` seconds; the owners whose jobs ended."""
        work = dt * self.rate()
        self.work += work * len(self.left)
        done = []
        for owner in list(self.left):
            self.left[owner] -= work
            if self.left[owner] <= 1e-12:
                del self.left[owner]
                done.append(owner)
        return done


def simulate(
    costs: Costs,
    learners: int,
    protocol: str = "async",
    *,
    cores: float,
    batch_size: int,
    n: int | None = None,
    updates: int = 2000,
    overlap: bool = False,
) -> Prediction:
    """The steady state of a run of ``learners`` homogeneous learners (the first tenth of the
    updates is left out of the rates, as a start-up). ``overlap``: each learner computes its
    next gradient, on the weights it has, while its exchange runs (its compute and its
    exchange are two jobs on the CPU), and pushes it once that exchange is over."""
    if learners < 1 or cores <= 0 or updates < 10:
        raise ConfigError("runtime model: needs learners >= 1, cores > 0 and updates >= 10")
    c = gradients_per_update(protocol, learners, n)
    cpu = _Cpu(cores)
    timers: list[tuple[float, int, Any]] = []  # (time, order, event)
    order = itertools.count()
    now = 0.0
    clock = 0  # the server's update clock
    stamp = [0] * learners  # the clock of the last weights each learner received
    computing_on = [0] * learners  # the clock of the weights its compute uses
    pushed = [0] * learners  # the clock of the weights its gradient in flight was computed on
    exchanging = [False] * learners
    ready = [False] * learners  # overlap: a gradient waits for the exchange in flight
    sending = [False] * learners  # its exchange's CPU is the half before the push (else after the reply)
    queue: deque[int] = deque()  # pushes waiting for the server
    serving: int | None = None  # the learner whose push the server handles
    held: list[tuple[int, int]] = []  # (learner, its gradient's stamp) of the update being gathered
    sigmas: list[int] = []
    marks: list[tuple[float, int, int]] = []  # (time, clock, gradients) after each update
    gradients = 0
    last_ran: dict[Any, float] = {}  # a process → cpu.work when its last job ended
    crowded = learners + 1 > cores  # else each process keeps a core of its own: no cache refill

    def process(owner: Any) -> Any:
        """The process a job runs in: the server, or learner i (its compute and its exchange)."""
        return owner[1] if isinstance(owner, tuple) else owner

    def start(owner: Any, seconds: float, woken: bool = False) -> None:
        if woken and cpu.left:
            seconds += costs.switch_s
            ran = last_ran.get(process(owner))
            if ran is not None and crowded:
                seconds += costs.refill_s((cpu.work - ran) / cores)
        if seconds > 0:
            cpu.left[owner] = seconds
        else:
            heapq.heappush(timers, (now, next(order), ("done", owner)))

    def after(delay: float, event: Any) -> None:
        heapq.heappush(timers, (now + delay, next(order), event))

    def compute(learner: int) -> None:
        computing_on[learner] = stamp[learner]
        start(learner, costs.compute_s)

    def launch(learner: int) -> None:
        """The learner's gradient just computed starts its exchange (overlap: and the next compute)."""
        exchanging[learner], sending[learner] = True, True
        pushed[learner] = computing_on[learner]
        start(("exchange", learner), costs.client_s / 2)
        if overlap:
            compute(learner)

    def reply(learner: int) -> None:
        stamp[learner] = clock
        after(costs.latency_s, ("arrive", learner))

    def serve_next(woken: bool = True) -> None:
        """Handle the next queued push, if the server is free (``woken``: it was idle)."""
        nonlocal serving
        if serving is None and queue:
            serving = queue.popleft()
            completes = len(held) + 1 == c
            if completes:
                work = costs.server_s + costs.update_s + (c - 1) * costs.combine_s
            else:
                work = costs.server_s + (costs.hold_s if protocol == "hardsync" else 0.0)
            start("server", work, woken=woken)

    for i in range(learners):
        compute(i)
    while clock < updates:
        dt = min(cpu.next_done(), (timers[0][0] - now) if timers else float("inf"))
        if dt == float("inf"):
            raise RuntimeError("runtime model: nothing left to happen (a protocol deadlock)")
        now += dt
        ended = cpu.advance(dt)
        while timers and timers[0][0] <= now + 1e-15:
            _, _, event = heapq.heappop(timers)
            kind, who = event
            if kind == "done":
                ended.append(who)
            elif kind == "push":
                queue.append(who)
            else:  # "arrive": the reply reached the learner
                start(("exchange", who), costs.client_s / 2, woken=True)
        for owner in ended:
            last_ran[process(owner)] = cpu.work
            if owner == "server":
                learner, serving = serving, None
                assert learner is not None
                held.append((learner, pushed[learner]))
                gradients += 1
                if len(held) == c:  # the update
                    sigmas.extend(clock - j for _, j in held)
                    clock += 1
                    marks.append((now, clock, gradients))
                    for g in [g for g, _ in held] if protocol != "softsync" else [learner]:
                        reply(g)
                    held = []
                elif protocol == "softsync":
                    reply(learner)
                serve_next(woken=False)  # a push that waited in the queue: read without a wake-up
            elif isinstance(owner, int):  # a compute ended
                if exchanging[owner]:
                    ready[owner] = True
                else:
                    launch(owner)
            else:
                learner = owner[1]
                if sending[learner]:  # the push leaves
                    sending[learner] = False
                    after(costs.latency_s, ("push", learner))
                else:  # the reply is taken: the exchange is over
                    exchanging[learner] = False
                    if not overlap:
                        compute(learner)
                    elif ready[learner]:
                        ready[learner] = False
                        launch(learner)
        serve_next()
    skip = len(marks) // 10
    t0, clock0, grads0 = marks[skip]
    t1, clock1, grads1 = marks[-1]
    span = t1 - t0
    if span <= 0:
        raise ConfigError("runtime model: every cost is 0, so a run takes no time")
    return Prediction(
        updates_per_s=(clock1 - clock0) / span,
        samples_per_s=(grads1 - grads0) * batch_size / span,
        staleness_mean=sum(sigmas[skip * c :]) / max(1, len(sigmas[skip * c :])),
        wall_s=now,
    )

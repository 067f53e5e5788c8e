"""In-process simulation for accuracy studies: λ learners as tasks, one deterministic clock.

A 2-core machine cannot time 30 learner processes honestly, but accuracy does not depend
on wall time, only on the order in which gradients reach the server. Here λ learners are
coroutines sharing one process and talking to a real :class:`ParameterServer` over the
in-memory transport, so the same protocol, LR policy and kernel code runs. A seeded
discrete-event scheduler decides who computes when: each learner's gradient takes a
virtual duration (1 ± jitter for homogeneous learners; per-learner speed factors drawn
log-normally when ``heterogeneity`` > 0), and the next learner is released only when
every other one is either waiting for its turn or blocked by the protocol. The run is
reproducible: the same seed gives the same gradients in the same order.

Times reported by a simulation are virtual; runtime figures come only from real processes.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from typing import Any

import numpy as np

from ..client import Client
from ..config import TrainConfig
from ..errors import ConfigError, RemoteError, RudraError
from ..options import to_flat
from ..server import ParameterServer
from .train import summarize

#: scheduling points a released learner may take before the scheduler calls it stuck
MAX_SPINS = 100_000
#: a learner reports its buffers (BatchNorm's) every this many steps, as DistributedOptimizer's default
REPORT_EVERY = 50
#: refusals of a gradient by the server's guards when training diverges: the gradient is lost and
#: the learner goes on (counted in the results' ``rejected``), so a study records the diverged
#: point rather than stopping
DIVERGED = ("gradient_outlier", "update_not_finite")

#: settings of learner processes and of how they reach their servers: a simulation (one
#: server, its learners as tasks of one process, the in-memory transport) does not use them
PROCESS_ONLY = (
    "shards",
    "transport",
    "timeout",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "data",
    "loss",
    "device",
    "overlap",
    "group_size",
    "threads",
    "reconnect",
    "tensorboard",
)


def check_simulated(cfg: TrainConfig) -> None:
    """Refuse (ConfigError) a run that sets any of :data:`PROCESS_ONLY` to other than its default."""
    given, default = to_flat(cfg), to_flat(TrainConfig())
    unused = [key for key in PROCESS_ONLY if given[key] != default[key]]
    if unused:
        names = ", ".join(unused)
        raise ConfigError(f"a simulation ignores {names} (one server, learners in one process); use mode = 'processes'")


class Scheduler:
    def __init__(self, server: ParameterServer) -> None:
        self.server = server
        self.now = 0.0
        self.queue: list[tuple[float, int, int]] = []  # (time, tie-break, learner index)
        self.turns: dict[int, asyncio.Future[None]] = {}
        self.state: dict[int, str] = {}  # "turn" (waiting for it), "busy", "request", "done"
        self.ids: dict[int, int] = {}  # learner index -> server learner id
        self._seq = 0

    def at(self, index: int, when: float) -> asyncio.Future[None]:
        """Register ``index``'s next gradient as due at virtual time ``when``."""
        fut = asyncio.get_running_loop().create_future()
        self.turns[index] = fut
        self.state[index] = "turn"
        heapq.heappush(self.queue, (when, self._seq, index))
        self._seq += 1
        return fut

    def _quiet(self) -> bool:
        blocked = self.server.blocked
        return all(
            s in ("turn", "done") or (s == "request" and self.ids.get(i) in blocked) for i, s in self.state.items()
        )

    async def run(self) -> None:
        while any(s != "done" for s in self.state.values()):
            spins = 0
            while not self._quiet():
                await asyncio.sleep(0)
                spins += 1
                if spins > MAX_SPINS:
                    raise RudraError(f"simulation stuck: learner states {self.state}")
            if not self.queue:
                if all(s == "done" for s in self.state.values()):
                    return
                proto = {
                    k: (sorted(v) if isinstance(v, (set, dict)) else v)
                    for k, v in vars(self.server.core.protocol).items()
                    if k not in ("now", "pending", "held")
                }
                raise RudraError(f"simulation deadlock at clock {self.server.clock}: every learner waits ({proto})")
            when, _, index = heapq.heappop(self.queue)
            self.now = max(self.now, when)
            self.state[index] = "busy"
            self.turns.pop(index).set_result(None)


async def _learner(
    index: int,
    cfg: TrainConfig,
    url: str,
    dataset: Any,
    steps: int | None,
    sched: Scheduler,
    duration: np.ndarray,
) -> None:
    import torch

    from ..learner.data import minibatches
    from ..learner.evaluation import bind, build_model
    from ..learner.state import ModelState

    model = build_model(cfg.learner.model, dataset, cfg.learner.seed)
    flat = bind(model)
    state = ModelState(model, flat.params)  # BatchNorm's buffers, as a learner process reports them
    client = await Client.connect(
        url, flat.layout, flat.host_weights, name=f"sim-{index}", index=index, state=state.layout if state else None
    )
    sched.ids[index] = client.learner_id
    if state:
        state.load(await client.exchange_state(state.values(), every=True, reply=True))
    client.weights = flat.host_weights  # pulled weights land in the model
    w = await client.pull()
    x, y = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    batches = minibatches(len(y), cfg.learner.batch_size, index, cfg.learners, cfg.learner.seed)
    step = 0
    try:
        while not w.stop and (steps is None or step < steps):
            await sched.at(index, sched.now + duration[step % len(duration)])
            idx = torch.from_numpy(next(batches))
            flat.zero_grad()
            loss_value = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss_value.backward()
            loss = loss_value.item()
            sched.state[index] = "request"
            try:
                w = await client.push_pull(flat.gradients(), w.timestamp, step, len(idx), loss)
            except RemoteError as exc:
                if exc.code == "stopped":
                    break
                if exc.code not in DIVERGED:
                    raise
                w = await client.pull()  # the server kept its weights: a diverging run goes on, as a run of a study
            step += 1
            if state.has_buffers and step % REPORT_EVERY == 0:
                await client.exchange_state(state.buffers(), every=False, reply=False)
    finally:
        sched.state[index] = "done"
        if state.has_buffers and not client.conn.is_closed:
            await client.exchange_state(state.buffers(), every=False, reply=False)
        await client.close()


async def simulate(cfg: TrainConfig, jitter: float = 0.05, heterogeneity: float = 0.0) -> dict[str, Any]:
    """Run ``cfg`` as a simulation; returns the same results as ``train`` plus ``virtual_time``."""
    import torch

    from ..learner import data as datasets

    cfg.validate()
    check_simulated(cfg)
    torch.set_num_threads(1)
    dataset = datasets.load(cfg.learner.dataset)
    steps = cfg.steps_per_learner(len(dataset.y_train))
    started = time.monotonic()
    rng = np.random.default_rng([cfg.learner.seed, 7919])
    speed = np.exp(rng.normal(0.0, heterogeneity, cfg.learners)) if heterogeneity else np.ones(cfg.learners)
    budget = steps or max(1, (cfg.updates or 1000) * 4)
    async with ParameterServer(cfg.server_config("memory://", len(dataset.y_train))) as server:
        sched = Scheduler(server)
        tasks = []
        for i in range(cfg.learners):
            sched.state[i] = "request"
            durations = speed[i] * np.clip(1.0 + jitter * rng.standard_normal(min(budget, 100_000)), 0.1, None)
            tasks.append(
                asyncio.create_task(
                    _learner(
                        i,
                        cfg,
                        server.addresses[0],
                        dataset,
                        steps,
                        sched,
                        durations,
                    )
                )
            )
        runner = asyncio.create_task(sched.run())
        try:
            await asyncio.gather(runner, *tasks)  # the first failure propagates at once
        except BaseException:
            for t in (runner, *tasks):
                t.cancel()
            raise
        results = summarize(cfg, server, dataset)
    return {
        **results,
        "transport": "memory",  # what the simulation used, whatever the configuration says
        "mode": "simulated",
        "virtual_time": sched.now,
        "wall_s": time.monotonic() - started,
        "heterogeneity": heterogeneity,
    }

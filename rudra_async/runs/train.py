"""One-command local run: a server in this process and λ learner processes beside it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from ..config import ServerConfig
from ..layout import Shard
from ..errors import ConfigError, RudraError
from ..server import ParameterServer
from ..transports import transport_for
from ..transports.base import format_host_port


@dataclass
class TrainConfig:
    """A local run. ``server`` holds the protocol, optimizer and LR settings; its listen
    address and update budget are set by the run."""

    learners: int = 4
    batch_size: int = 32
    epochs: float = 30.0
    updates: int | None = None  # overrides epochs: stop the run at this many updates
    seed: int = 0
    model: str = "mlp"
    dataset: str = "digits"
    server: ServerConfig = field(default_factory=ServerConfig)
    transport: str = "tcp"  # tcp, shm, or a plugin's scheme (e.g. ucx)
    host: str = "127.0.0.1"
    learner_threads: int = 1
    timeout: float = 900.0  # the whole run; learners are killed past it
    shards: int = 1  # servers in the group, each holding one part of the parameters (all in this process)

    def validate(self) -> "TrainConfig":
        if self.learners < 1:
            raise ConfigError(f"need at least one learner, got {self.learners}")
        self.server.validate().check_learners(self.learners)
        if transport_for(self.listen_url()).in_process:
            raise ConfigError(f"transport {self.transport!r} cannot reach learner processes; use tcp, shm or ucx")
        if self.shards < 1:
            raise ConfigError(f"need at least one shard, got {self.shards}")
        self.server.check_shards(self.shards)
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be >= 1, got {self.batch_size}")
        if self.updates is None and not self.epochs > 0:
            raise ConfigError(f"epochs must be > 0, got {self.epochs}")
        return self

    def server_config(self, listen: str, n_train: int, shard: Shard = Shard()) -> ServerConfig:
        return replace(self.server.for_shard(shard, listen), max_updates=self.updates,
                       samples_per_epoch=self.server.samples_per_epoch or n_train)

    def listen_url(self) -> str:
        """Where the run's server listens: a fresh name or port on this machine."""
        if self.transport == "shm":
            return "shm://"
        return format_host_port(self.transport, self.host, 0)

    def steps_per_learner(self, n_train: int) -> int | None:
        """Epochs count samples over all learners: each does epochs·N/(λμ) steps."""
        if self.updates is not None:
            return None
        return max(1, math.ceil(self.epochs * n_train / (self.learners * self.batch_size)))


def learner_command(cfg: TrainConfig, url: str, index: int, steps: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "rudra_async", "learner", "--connect", url, "--model", cfg.model,
           "--dataset", cfg.dataset, "--batch-size", str(cfg.batch_size), "--seed", str(cfg.seed),
           "--index", str(index), "--threads", str(cfg.learner_threads), "--name", f"learner-{index}", "--json"]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    return cmd


async def train(cfg: TrainConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job and return the results (see README for the keys)."""
    from ..learner import data as datasets

    cfg.validate()
    dataset = datasets.load(cfg.dataset)
    steps = cfg.steps_per_learner(len(dataset.y_train))
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.learner_threads), "MKL_NUM_THREADS": str(cfg.learner_threads)}
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(ParameterServer(
            cfg.server_config(cfg.listen_url(), len(dataset.y_train), Shard(i, cfg.shards)))) for i in range(cfg.shards)]
        server = servers[0]  # progress, statistics and timing come from shard 0
        url = ",".join(s.addresses[0] for s in servers)
        procs = [
            await asyncio.create_subprocess_exec(*learner_command(cfg, url, i, steps), stdout=asyncio.subprocess.PIPE, env=env)
            for i in range(cfg.learners)
        ]
        ticker = asyncio.create_task(_report_progress(server, started, progress)) if progress else None
        try:
            outputs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), cfg.timeout)
        except asyncio.TimeoutError:
            raise RudraError(f"the run did not finish within {cfg.timeout:g} s; learners were stopped") from None
        finally:
            if ticker:
                ticker.cancel()
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        wall = time.monotonic() - started
        failed = [i for i, p in enumerate(procs) if p.returncode != 0]
        if len(failed) == len(procs):
            raise RudraError(f"every learner failed (exit codes {[p.returncode for p in procs]})")
        summaries = [json.loads(out.decode().strip().splitlines()[-1]) for (out, _), p in zip(outputs, procs) if p.returncode == 0]
        train_s = (server.last_update_at or started) - (server.first_update_at or started)
        weights = np.concatenate([s.store.weights for s in servers])  # type: ignore[union-attr]
        results = summarize(cfg, server, dataset, weights)
    return {**results, "mode": "processes", "wall_s": wall, "train_s": train_s,
            "samples_per_s": server.samples_seen / train_s if train_s > 0 else 0.0,
            "learners_failed": failed, "learner_summaries": summaries}


def summarize(cfg: TrainConfig, server: ParameterServer, dataset: Any,
              weights: np.ndarray | None = None) -> dict[str, Any]:
    """The results of a finished run: configuration, final test accuracy, statistics.
    ``weights``: the whole model's (default: the server's; a shard group's, joined)."""
    from ..learner.training import FlatModel, build_model, evaluate

    model = build_model(cfg.model, dataset, cfg.seed)
    FlatModel(model).load(server.store.weights if weights is None else weights)  # type: ignore[union-attr]
    accuracy, test_loss = evaluate(model, dataset.x_test, dataset.y_test)
    stats = server.stats()
    return {
        "protocol": cfg.server.protocol,
        "transport": cfg.transport,
        "protocol_options": cfg.server.protocol_kwargs(),
        "lr_policy": cfg.server.lr_policy,
        "lr": cfg.server.lr,
        "learners": cfg.learners,
        "shards": cfg.shards,
        "batch_size": cfg.batch_size,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "updates": stats["updates"],
        "gradients": stats["gradients"],
        "dropped": stats["dropped"],
        "samples": stats["samples"],
        "test_accuracy": accuracy,
        "test_error": 1.0 - accuracy,
        "test_loss": test_loss,
        "staleness_mean": stats["staleness_mean"],
        "staleness_max": stats["staleness_max"],
        "staleness_histogram": stats["staleness_histogram"],
        "per_learner": stats["learners"],
        "loss_curve": stats["loss_curve"],
        "config": asdict(cfg),
    }


async def _report_progress(server: ParameterServer, started: float, progress: Callable[[str], None]) -> None:
    last = 0
    while True:
        await asyncio.sleep(1.0)
        clock = server.clock
        live = sum(1 for l in server.learners.values() if l.connected)
        progress(
            f"[{time.monotonic() - started:6.1f}s] updates {clock:6d} ({clock - last:5d}/s)  "
            f"mean staleness {server.staleness.mean:5.2f}  learners {live}"
        )
        last = clock

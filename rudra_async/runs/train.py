"""One-command local run: a server in this process and λ learner processes beside it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from .. import security
from ..config import ServerConfig, TrainConfig
from ..errors import RudraError
from ..layout import Shard
from ..options import to_args
from ..server import ParameterServer


def learner_security_args(server: ServerConfig, tls_ca: str | None) -> list[str]:
    """The flags a run's learners need to reach its servers: the secret file (a secret in
    the environment is inherited) and TLS (a client certificate when the servers ask for one:
    the servers' own)."""
    args = ["--secret-file", server.secret_file] if server.secret_file else []
    if tls_ca:
        args += ["--tls-ca", tls_ca]
        if server.tls_client_ca and server.tls_cert:
            args += ["--tls-cert", server.tls_cert, *(["--tls-key", server.tls_key] if server.tls_key else [])]
    return args


def learner_command(cfg: TrainConfig, url: str, index: int, steps: int | None) -> list[str]:
    options = replace(cfg.learner, steps=steps)
    return [
        sys.executable,
        "-m",
        "rudra_async",
        "learner",
        "--connect",
        url,
        "--index",
        str(index),
        "--name",
        f"learner-{index}",
        "--json",
        *learner_security_args(cfg.server, cfg.tls_ca),
        *to_args(options),
    ]


async def train(cfg: TrainConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job and return the results (see README for the keys)."""
    from ..learner import data as datasets

    cfg.validate()
    dataset = datasets.load(cfg.learner.dataset)
    steps = cfg.steps_per_learner(len(dataset.y_train))
    started = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.learner.threads), "MKL_NUM_THREADS": str(cfg.learner.threads)}
    secret = security.load_secret(cfg.server.secret_file)
    if secret is None:  # a run authenticates its own learners even on loopback (other users share this host)
        token = secrets.token_hex(32)
        env[security.SECRET_ENV] = token
        secret = token.encode()
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(
                ParameterServer(
                    cfg.server_config(cfg.listen_url(), len(dataset.y_train), Shard(i, cfg.shards)), secret=secret
                )
            )
            for i in range(cfg.shards)
        ]
        server = servers[0]  # progress, statistics and timing come from shard 0
        url = ",".join(s.addresses[0] for s in servers)
        procs = [
            await asyncio.create_subprocess_exec(
                *learner_command(cfg, url, i, steps), stdout=asyncio.subprocess.PIPE, env=env
            )
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
        summaries = [
            json.loads(out.decode().strip().splitlines()[-1])
            for (out, _), p in zip(outputs, procs)
            if p.returncode == 0
        ]
        train_s = (server.core.last_update_at or started) - (server.core.first_update_at or started)
        weights = np.concatenate([s.core.store.weights for s in servers])  # type: ignore[union-attr]
        results = summarize(cfg, server, dataset, weights)
    return {
        **results,
        "mode": "processes",
        "wall_s": wall,
        "train_s": train_s,
        "samples_per_s": server.core.samples / train_s if train_s > 0 else 0.0,
        "learners_failed": failed,
        "learner_summaries": summaries,
    }


def summarize(
    cfg: TrainConfig, server: ParameterServer, dataset: Any, weights: np.ndarray | None = None
) -> dict[str, Any]:
    """The results of a finished run: configuration, final test accuracy, statistics.
    ``weights``: the whole model's (default: the server's; a shard group's, joined)."""
    from ..learner.training import FlatModel, build_model, evaluate

    model = build_model(cfg.learner.model, dataset, cfg.learner.seed)
    FlatModel(model).load(server.core.store.weights if weights is None else weights)  # type: ignore[union-attr]
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
        "batch_size": cfg.learner.batch_size,
        "dataset": cfg.learner.dataset,
        "model": cfg.learner.model,
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
        live = sum(1 for info in server.core.learners.values() if info.connected)
        progress(
            f"[{time.monotonic() - started:6.1f}s] updates {clock:6d} ({clock - last:5d}/s)  "
            f"mean staleness {server.core.staleness.mean:5.2f}  learners {live}"
        )
        last = clock

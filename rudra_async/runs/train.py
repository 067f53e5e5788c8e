"""One-command local run: a server in this process and λ learner processes beside it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, replace
from typing import Any, TypeVar

import numpy as np

from .. import advice, eventloop, security
from ..config import LearnerConfig, TrainConfig
from ..errors import RudraError, RunStopped
from ..layout import Shard
from ..options import from_flat
from ..server import ParameterServer
from .learners import LearnerGroup, warm_up

T = TypeVar("T")


def run_train(progress: Callable[[str], None] | None = None, **settings: Any) -> dict[str, Any]:
    """``rudra-async train`` as a call, for a notebook or a script: ``settings`` are the
    command's settings by their Python names (``learners=2, protocol="hardsync", epochs=5``;
    an unknown name or a wrong type is a ConfigError naming the nearest valid one; the
    ``RUDRA_ASYNC_TRAIN_*`` variables are not read). Blocks until the run ends and returns
    the results (the dict ``--results`` writes). From a thread that runs an event loop (a
    notebook's cell), the run gets a thread and a loop of its own; signals stop a run only
    on the main thread without a running loop (:class:`RunStopped`)."""
    cfg = from_flat(TrainConfig, settings, exclude=TrainConfig.SET_BY_RUN, where="train()")
    if asyncio._get_running_loop() is None:
        return eventloop.run(train(cfg, progress))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rudra-async-train") as pool:
        return pool.submit(eventloop.run, train(cfg, progress)).result()


def learner_configs(cfg: TrainConfig, url: str, steps: int | None) -> list[LearnerConfig]:
    """The configuration of every learner of the run: its options, and what it needs to reach
    the run's servers: the secret file (a generated secret goes through the environment) and
    TLS (a client certificate when the servers ask for one: the servers' own)."""
    server, client_cert = cfg.server, bool(cfg.tls_ca and cfg.server.tls_client_ca)
    size = cfg.learner.group_size
    meet = group_addresses(cfg.pushers) if size > 1 else []
    return [
        LearnerConfig(
            connect=url,
            index=i,
            learners=cfg.learners,
            group_rank=i % size,
            group_address=meet[i // size] if meet else None,
            host_learners=cfg.learners,
            name=f"learner-{i}",
            passes=cfg.passes_per_learner(),
            secret_file=server.secret_file,
            tls_ca=cfg.tls_ca,
            tls_cert=server.tls_cert if client_cert else None,
            tls_key=server.tls_key if client_cert else None,
            options=replace(cfg.learner, steps=steps, progress_every=0.0),
        )
        for i in range(cfg.learners)
    ]


def group_addresses(groups: int) -> list[str]:
    """A loopback address for each learner group to meet at (a port free now)."""
    with contextlib.ExitStack() as held:  # every port held until all are chosen: no two alike
        probes = [held.enter_context(socket.socket()) for _ in range(groups)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [f"127.0.0.1:{probe.getsockname()[1]}" for probe in probes]


async def train(cfg: TrainConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job and return the results (see README for the keys). Stopped by SIGINT or
    SIGTERM (on the main thread), the run stops in order and raises :class:`RunStopped`
    carrying the results it reached (None if no model existed yet)."""
    from ..learner import data as datasets

    cfg.validate()
    advice.warn(cfg.server, cfg.pushers, cfg.learner.overlap)
    warm_up()  # learners' imports (torch) start now, beside the server's start-up
    started = time.monotonic()
    dataset = datasets.load(cfg.learner.dataset) if cfg.learner.data is None else None
    n_train = len(dataset.y_train) if dataset is not None else None
    steps = cfg.steps_per_learner(n_train or 0)
    secret = security.load_secret(cfg.server.secret_file)
    generated = None
    if secret is None:  # a run authenticates its own learners even on loopback (other users share this host)
        generated = secrets.token_hex(32)
        secret = generated.encode()
    results: dict[str, Any] | None = None
    with _SignalStop() as stop:
        async with contextlib.AsyncExitStack() as stack:
            servers = [
                await stack.enter_async_context(
                    ParameterServer(cfg.server_config(cfg.listen_url(), n_train, Shard(i, cfg.shards)), secret=secret)
                )
                for i in range(cfg.shards)
            ]

            def close_servers(sig: signal.Signals) -> None:
                for s in servers:
                    s.request_close(f"the run got {sig.name}")

            stop.on_signal = close_servers
            server = servers[0]  # progress, statistics and timing come from shard 0
            group = LearnerGroup(learner_configs(cfg, ",".join(s.addresses[0] for s in servers), steps), generated)
            ticker = asyncio.create_task(_report_progress(server, started, progress)) if progress else None
            try:
                summaries = await stop.interruptible(group.run(cfg.timeout))
            finally:
                if ticker:
                    ticker.cancel()
            wall = time.monotonic() - started
            failed = group.failed
            if len(failed) == cfg.learners and not stop.received:
                raise RudraError(f"every learner failed (exit codes {group.exit_codes})")
            if all(s.core.store is not None for s in servers):  # (a stop may come before the model)
                train_s = (server.core.last_update_at or started) - (server.core.first_update_at or started)
                weights = np.concatenate([s.core.store.weights for s in servers])  # type: ignore[union-attr]
                results = {
                    **summarize(cfg, server, dataset, weights),
                    "mode": "processes",
                    "wall_s": wall,
                    "train_s": train_s,
                    "samples_per_s": server.core.samples / train_s if train_s > 0 else 0.0,
                    "learners_failed": [] if stop.received else failed,
                    "learner_summaries": summaries or [],
                    "first_update_unix": time.time() - (time.monotonic() - (server.core.first_update_at or started)),
                    "stopped_by": stop.received[0].name if stop.received else None,
                }
            # leaving the stack closes the servers, writing the final checkpoint
        stop.raise_if_received(results)  # also one that came while the results were made or the servers closed
    assert results is not None
    return results


class _SignalStop:
    """While entered (on the main thread), SIGINT and SIGTERM are recorded and cancel the work
    :meth:`interruptible` runs (the learners), so that a run stops in order: its learners
    stopped, its servers closed (writing the final checkpoint), then :meth:`raise_if_received`
    says so. Without it, SIGTERM killed the process with its learners left running. Off the
    main thread (which alone gets signals) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        #: called at the first signal, before the work is cancelled (the run's servers are
        #: told to close, so that learners cut off by the stop are not logged as crashes)
        self.on_signal: Callable[[signal.Signals], object] | None = None
        self._running: asyncio.Future[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> _SignalStop:
        if threading.current_thread() is threading.main_thread():
            self._loop = asyncio.get_running_loop()
            for sig in self.SIGNALS:
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            for sig in self.SIGNALS:
                self._loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received.append(sig)
        if self.on_signal is not None and len(self.received) == 1:
            self.on_signal(sig)
        if self._running is not None and len(self.received) == 1:  # once: a second must not cut the stop short
            self._running.cancel()

    async def interruptible(self, work: Coroutine[Any, Any, T]) -> T | None:
        """``work``'s result; None if a signal came before or while it ran (it is then cancelled)."""
        if self.received:
            work.close()
            return None
        self._running = task = asyncio.ensure_future(work)
        try:
            return await task
        except asyncio.CancelledError:
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python 3.11+
            if task.cancelled() and self.received and not (cancelling and cancelling()):
                return None  # cancelled by the signal, not by this task's owner
            raise
        finally:
            self._running = None

    def raise_if_received(self, results: dict[str, Any] | None = None) -> None:
        """:class:`RunStopped` naming the signal and carrying ``results``, if one came."""
        if self.received:
            name = self.received[0].name
            if results is not None:
                results["stopped_by"] = name
            raise RunStopped(f"the run was stopped by {name}", results)


def summarize(
    cfg: TrainConfig, server: ParameterServer, dataset: Any, weights: np.ndarray | None = None
) -> dict[str, Any]:
    """The results of a finished run: configuration, final test accuracy (with a built-in
    data set; None with --data), statistics. ``weights``: the whole model's (default: the
    server's; a shard group's, joined)."""
    from ..learner.evaluation import build_model, evaluate, load_whole

    accuracy: float | None = None
    test_loss: float | None = None
    if dataset is not None:
        model = build_model(cfg.learner.model, dataset, cfg.learner.seed)
        core = server.core
        state = core.state if core.state is not None and core.state.values is not None else None
        assert core.layout is not None and core.store is not None, "a finished run has weights"
        flat = core.store.weights if weights is None else weights
        load_whole(model, core.layout, flat, state.layout if state else None, (state.values or []) if state else [])
        accuracy, test_loss = evaluate(model, dataset.x_test, dataset.y_test)
    stats = server.stats()
    return {
        "protocol": cfg.server.protocol,
        "transport": cfg.transport,
        "protocol_options": cfg.server.protocol_kwargs(),
        "lr_policy": cfg.server.lr_policy,
        "lr": cfg.server.lr,
        "learners": cfg.learners,
        "group_size": cfg.learner.group_size,
        "shards": cfg.shards,
        "batch_size": cfg.learner.batch_size,
        "dataset": cfg.learner.data or cfg.learner.dataset,
        "model": cfg.learner.model,
        "updates": stats["updates"],
        "gradients": stats["gradients"],
        "dropped": stats["dropped"],
        "samples": stats["samples"],
        "test_accuracy": accuracy,
        "test_error": None if accuracy is None else 1.0 - accuracy,
        "test_loss": test_loss,
        "staleness_mean": stats["staleness_mean"],
        "staleness_max": stats["staleness_max"],
        "staleness_histogram": stats["staleness_histogram"],
        "rejected": stats["rejected"],
        **{key: stats[key] for key in ("dc_uncompensated", "n_trajectory") if key in stats},
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

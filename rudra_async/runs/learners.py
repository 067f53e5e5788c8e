"""Learner processes for a local run, started so that importing PyTorch is paid about once.

A fork server (``multiprocessing``'s ``forkserver``) is started as the run begins and
imports the learner's modules (torch included) while the parameter server starts; every
learner is then forked from it, already warm, instead of being a fresh interpreter that
imports torch again (λ imports competing for the cores). The fork server has no event
loop and no threads, so forking it is safe. Each learner runs
:func:`~rudra_async.learner.loop.run_learner` and reports its summary through a queue.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue
import signal
import sys
from multiprocessing import forkserver
from multiprocessing.process import BaseProcess
from typing import Any

from ..config import LearnerConfig
from ..errors import RudraError
from ..eventloop import outlast

#: what the fork server imports before any learner is forked from it
PRELOAD = ["rudra_async.learner.loop", "rudra_async.learner.data"]


def warm_up() -> None:
    """Start the fork server now, so its imports overlap the caller's own start-up."""
    mp.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def _learner(cfg: LearnerConfig, results: mp.Queue[tuple[int, dict[str, Any]]], secret: str | None) -> None:
    """A learner process: train, report the summary; a refusal is one line on stderr, exit 2.
    ``secret``: the run's generated secret, which the learner reads as RUDRA_ASYNC_SECRET.
    SIGINT is ignored: Ctrl-C reaches the whole process group, and the run stops its learners."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ..learner.loop import run_learner
    from ..security import SECRET_ENV

    if secret is not None:
        os.environ[SECRET_ENV] = secret
    try:
        results.put((cfg.index, run_learner(cfg)))
    except RudraError as exc:
        print(f"error: learner {cfg.index}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


class LearnerGroup:
    """λ learner processes forked from the warm fork server; ``secret`` (a run's generated
    one) reaches them through their environment, never through a command line."""

    def __init__(self, configs: list[LearnerConfig], secret: str | None = None) -> None:
        ctx = mp.get_context("forkserver")
        self._results: mp.Queue[tuple[int, dict[str, Any]]] = ctx.Queue()
        self.procs: list[BaseProcess] = [
            ctx.Process(target=_learner, args=(cfg, self._results, secret), name=cfg.name, daemon=True)
            for cfg in configs
        ]

    async def run(self, timeout: float) -> list[dict[str, Any]]:
        """Start every learner, wait for all to end (killing them past ``timeout`` seconds),
        and return the summaries of those that succeeded, in index order."""
        deadline = asyncio.get_running_loop().time() + timeout
        starting: asyncio.Future[None] | None = None
        try:
            for p in self.procs:
                starting = asyncio.ensure_future(asyncio.to_thread(p.start))
                await asyncio.shield(starting)  # the first start waits for the fork server's imports
            while any(p.exitcode is None for p in self.procs):
                if asyncio.get_running_loop().time() > deadline:
                    raise RudraError(f"the run did not finish within {timeout:g} s; learners were stopped")
                await asyncio.sleep(0.05)
        finally:
            if starting is not None:  # a start under way ends first, even if cancelled again
                await outlast(starting)
            self.kill()
        summaries: dict[int, dict[str, Any]] = {}
        while True:
            try:
                index, summary = self._results.get_nowait()
            except queue.Empty:
                break
            summaries[index] = summary
        return [summaries[i] for i in sorted(summaries)]

    @property
    def failed(self) -> list[int]:
        """Indexes of the learners that did not exit cleanly."""
        return [i for i, p in enumerate(self.procs) if p.exitcode != 0]

    @property
    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self.procs]

    def kill(self) -> None:
        """Stop the learners still running (idempotent)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)

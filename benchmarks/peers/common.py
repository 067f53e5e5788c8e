"""What every process of the peer benchmark shares: the workloads and the step board.

Stdlib and numpy only: the MXNet workers import this file from their own virtual
environment (numpy < 1.24, no torch, no rudra_async).

The **board** is one small file in /dev/shm that the driver creates and every learner maps:
a control word (the driver sets it to ask learners to stop) and, per learner, a step counter
with a ring of step-completion times and push+pull latencies. A learner writes its entry
after each step (a few stores, no system call); the driver reads the counters to know when
every learner is warm and, after the measured window, the times, so start-up (importing
torch or mxnet, connecting, the first steps) never counts. ``time.monotonic()`` is the
system-wide CLOCK_MONOTONIC on Linux, comparable across processes.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from itertools import pairwise

import numpy as np

#: workload (a0): the parameter count of workload (a)'s MLP, so (a0) is (a) without compute
MLP_SIZES = (1024, 4096, 4096, 1024)
A0_PARAMS = sum(i * o + o for i, o in pairwise(MLP_SIZES))  # 25,175,040
SMALL_PARAMS = 1_000

#: per-learner batch of each training workload
BATCH = {"a": 8, "b": 32}

#: one compute thread per process everywhere
SINGLE_THREAD_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MXNET_CPU_WORKER_NTHREADS": "1",
    "MXNET_OMP_MAX_THREADS": "1",
}

LR = 1e-6  # small enough that (a0)'s fixed gradient never overflows the weights
TRAIN_LR = 0.01
MOMENTUM = 0.9


@dataclass
class Spec:
    """One process's part in one measured point (passed to it as JSON on the command line)."""

    system: str  # rudra, ddp, rpc, mxnet, reference
    workload: str  # a0, small, a, b
    role: str  # server, learner, scheduler, ...
    rank: int = 0
    learners: int = 1
    board: str = ""
    capacity: int = 0
    address: str = ""  # rudra: the server's URL; ddp/rpc: host:port of the rendezvous
    mode: str = ""  # rudra: async | hardsync | softsync; rpc: async | sync; mxnet: dist_async | dist_sync
    n: int = 0  # softsync's n
    overlap: bool = False  # rudra training learners: DistributedOptimizer(overlap=True)
    tiny: bool = False  # a tiny model for tests

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        return cls(**json.loads(text))


def params_of(workload: str, tiny: bool) -> int:
    """(a0)/small: the size of the one flat parameter vector."""
    if workload == "small":
        return SMALL_PARAMS
    return 10_000 if tiny else A0_PARAMS


def mlp_sizes(tiny: bool) -> tuple[int, ...]:
    return (16, 32, 32, 16) if tiny else MLP_SIZES


# -- the board ------------------------------------------------------------------------------
_CTRL = 8  # float64 words before the first learner's entry: [stop, reserved...]


def _entry_words(capacity: int) -> int:
    return 8 + 2 * capacity  # [count, pid, reserved x6] + times + latencies


def board_words(learners: int, capacity: int) -> int:
    return _CTRL + learners * _entry_words(capacity)


class Board:
    """The shared step board (see the module docstring)."""

    def __init__(self, path: str, learners: int, capacity: int, create: bool = False) -> None:
        self.path, self.learners, self.capacity = path, learners, capacity
        if create:
            with open(path, "wb") as f:
                f.truncate(board_words(learners, capacity) * 8)
        self.words = np.memmap(path, np.float64, "r+", shape=(board_words(learners, capacity),))

    def _entry(self, rank: int) -> np.ndarray:
        start = _CTRL + rank * _entry_words(self.capacity)
        return self.words[start : start + _entry_words(self.capacity)]

    # -- the driver's side
    def count(self, rank: int) -> int:
        return int(self._entry(rank)[0])

    def pid(self, rank: int) -> int:
        return int(self._entry(rank)[1])

    def counts(self) -> list[int]:
        return [self.count(r) for r in range(self.learners)]

    def stop(self) -> None:
        self.words[0] = 1.0

    def steps(self, rank: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(completion times, latencies, count) of the steps still in this learner's ring, oldest first."""
        e = self._entry(rank)
        count, cap = int(e[0]), self.capacity
        kept = min(count, cap)
        order = (np.arange(count - kept, count) % cap) + 8
        return e[order].copy(), e[order + cap].copy(), count

    def close(self) -> None:
        del self.words


class Recorder:
    """A learner's writer on the board."""

    def __init__(self, spec: Spec) -> None:
        self.board = Board(spec.board, spec.learners, spec.capacity) if spec.board else None
        self.n = 0
        if self.board is not None:
            self.entry = self.board._entry(spec.rank)
            self.entry[1] = os.getpid()
            self.times = self.entry[8 : 8 + spec.capacity]
            self.lats = self.entry[8 + spec.capacity :]
            self.cap = spec.capacity
            self.ctrl = self.board.words

    def step(self, latency: float = float("nan")) -> None:
        """One step done now; ``latency``: its push+pull time (NaN where it cannot be separated)."""
        if self.board is None:
            self.n += 1
            return
        i = self.n % self.cap
        self.times[i] = time.monotonic()
        self.lats[i] = latency
        self.n += 1
        self.entry[0] = self.n  # after the data it counts

    @property
    def stopped(self) -> bool:
        return self.board is not None and self.ctrl[0] != 0.0


def apply_single_thread_env() -> None:
    os.environ.update(SINGLE_THREAD_ENV)

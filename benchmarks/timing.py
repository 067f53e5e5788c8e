"""Timing helper shared by the benchmark scripts (run them as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], reps: int, warmup: bool = True) -> float:
    """Median wall time of ``fn()`` over ``reps`` calls (after one untimed call if ``warmup``)."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

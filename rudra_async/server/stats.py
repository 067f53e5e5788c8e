"""Run statistics: the staleness histogram and per-learner gradient counts; a rate-limited log."""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any


class StalenessHistogram:
    """Counts of σ = clock − gradient timestamp over every gradient folded in."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def add(self, sigma: int) -> None:
        self.counts[sigma] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def mean(self) -> float:
        t = self.total
        return sum(s * c for s, c in self.counts.items()) / t if t else 0.0

    @property
    def max(self) -> int:
        return max(self.counts) if self.counts else 0

    def fraction_at_most(self, bound: int) -> float:
        t = self.total
        return sum(c for s, c in self.counts.items() if s <= bound) / t if t else 1.0

    def to_dict(self) -> dict[str, int]:
        return {str(s): self.counts[s] for s in sorted(self.counts)}

    def load(self, counts: dict[str, int]) -> None:
        """Continue from :meth:`to_dict` of a checkpointed run."""
        self.counts = Counter({int(s): int(c) for s, c in counts.items()})

    def summary(self) -> dict[str, Any]:
        return {"staleness_mean": self.mean, "staleness_max": self.max, "staleness_histogram": self.to_dict()}


class RateLimitedLog:
    """Log lines at most ``burst`` per ``period`` seconds; the ones left out are counted and
    the count is reported with the next line that goes out (a flood of refusals must not
    flood the log or cost the event loop more than the refusals themselves)."""

    def __init__(self, logger: logging.Logger, burst: int = 32, period: float = 1.0) -> None:
        self.logger, self.burst, self.period = logger, burst, period
        self._window_start = 0.0
        self._in_window = 0
        self.suppressed = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._window_start >= self.period:
            self._window_start, self._in_window = now, 0
        if self._in_window >= self.burst:
            self.suppressed += 1
            return
        self._in_window += 1
        if self.suppressed:
            fmt += " (%d similar lines suppressed)"
            args = (*args, self.suppressed)
            self.suppressed = 0
        self.logger.warning(fmt, *args)

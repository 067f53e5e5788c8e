"""Run statistics: the staleness histogram and per-learner gradient counts."""

from __future__ import annotations

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

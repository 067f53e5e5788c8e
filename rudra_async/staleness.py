"""The staleness histogram: counts of σ = clock − gradient timestamp, and its checkpointed
form (``{"σ": count}``)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from .errors import quoted
from .schema import INT64_MAX, is_count

_SIGMA_KEY = re.compile(r"0|[1-9][0-9]{0,18}")  # as :meth:`StalenessHistogram.to_dict` writes σ


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
    def sum(self) -> int:
        return sum(s * c for s, c in self.counts.items())

    @property
    def mean(self) -> float:
        t = self.total
        return self.sum / t if t else 0.0

    @property
    def max(self) -> int:
        return max(self.counts) if self.counts else 0

    def fraction_at_most(self, bound: int) -> float:
        t = self.total
        return sum(c for s, c in self.counts.items() if s <= bound) / t if t else 1.0

    def to_dict(self) -> dict[str, int]:
        return {str(s): self.counts[s] for s in sorted(self.counts)}

    def load(self, counts: Any) -> None:
        """Continue from :meth:`to_dict` of a checkpointed run; raises ValueError (and
        changes nothing) if ``counts`` is not one (see :func:`parse_histogram`)."""
        self.counts = parse_histogram(counts)

    def summary(self) -> dict[str, Any]:
        return {"staleness_mean": self.mean, "staleness_max": self.max, "staleness_histogram": self.to_dict()}


def parse_histogram(raw: Any) -> Counter[int]:
    """The counts of a :meth:`StalenessHistogram.to_dict` map: ``{"σ": count}``, each σ a
    decimal string (no sign, no leading zero) and each count an int, both in [0, 2^63−1].
    Raises ValueError naming the first entry that is not."""
    if not isinstance(raw, dict):
        raise ValueError(f"the staleness histogram must be a map, got {type(raw).__name__}")
    counts: Counter[int] = Counter()
    for key, count in raw.items():
        if not (isinstance(key, str) and _SIGMA_KEY.fullmatch(key) and int(key) <= INT64_MAX):
            raise ValueError(f"staleness histogram key {quoted(key)} is not a staleness in [0, 2^63-1]")
        if not is_count(count):
            raise ValueError(
                f"staleness histogram count {quoted(count)} of staleness {key} is not an int in [0, 2^63-1]"
            )
        counts[int(key)] = count
    return counts

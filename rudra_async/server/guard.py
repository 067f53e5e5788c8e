"""The outlier guard: a pushed gradient far larger than the run's own recent gradients is
refused (``gradient_outlier``). One push of a finite but huge gradient (float16's 65,504 where
gradients are ~0.1; 1e30) wrecks the model with momentum, and the next periodic checkpoint
with it; a learner that knows the secret could send one, as could a broken one."""

from __future__ import annotations

import bisect
from collections import deque

#: max |g| of this many accepted gradients make the median a push is compared with
WINDOW = 256
#: the guard refuses nothing before this many gradients were accepted
WARMUP = 32


class OutlierGuard:
    """Compares a gradient's max |g| with ``factor`` × the median of the max |g| of the last
    :data:`WINDOW` accepted gradients (the upper median of an even count), once
    :data:`WARMUP` were accepted; ``factor`` 0 turns it off."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    def why(self, magnitude: float) -> str | None:
        """Why a gradient of max |g| ``magnitude`` is refused, or None."""
        if not self.factor or len(self._sorted) < WARMUP:
            return None
        median = self._sorted[len(self._sorted) // 2]
        if magnitude > self.factor * median:
            return (
                f"max |g| {magnitude:.6g} is more than {self.factor:g} times the median {median:.6g} of the last "
                f"{len(self._sorted)} accepted gradients (--grad-outlier-factor)"
            )
        return None

    def accepted(self, magnitude: float) -> None:
        """A gradient of max |g| ``magnitude`` was accepted."""
        if not self.factor:
            return
        self._recent.append(magnitude)
        bisect.insort(self._sorted, magnitude)
        if len(self._recent) > WINDOW:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

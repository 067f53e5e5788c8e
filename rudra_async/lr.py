"""Learning-rate policies and schedules.

An update folds c gradients as θ ← θ − (1/c) Σ α(σ_l) g_l (momentum and weight decay on
top, see :mod:`rudra_async.kernels`). Here α(σ) = base(t) · policy(σ): the **schedule**
gives the base rate at update t (α0, step decay, warm-up, linear scaling), the **policy**
the per-gradient factor from its staleness σ.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

__all__ = [
    "Constant",
    "LRPolicy",
    "MeanStaleness",
    "Schedule",
    "Staleness",
    "StalenessPlusOne",
]


class LRPolicy:
    """Per-gradient factor from staleness. ``observe`` sees every applied gradient's σ first."""

    name = "?"

    def observe(self, sigma: int) -> None:
        pass

    def factor(self, sigma: int) -> float:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this policy (JSON-like values); empty if stateless."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state` of a checkpointed run."""


class Constant(LRPolicy):
    name = "constant"

    def factor(self, sigma: int) -> float:
        return 1.0


class Staleness(LRPolicy):
    """α0/σ for σ > 0, α0 at σ = 0 (Zhang et al., IJCAI 2016)."""

    name = "staleness"

    def factor(self, sigma: int) -> float:
        return 1.0 / sigma if sigma > 0 else 1.0


class StalenessPlusOne(LRPolicy):
    """α0/(σ + 1), the variant of public re-implementations."""

    name = "staleness-plus-one"

    def factor(self, sigma: int) -> float:
        return 1.0 / (sigma + 1)


class MeanStaleness(LRPolicy):
    """α0/⟨σ⟩ with ⟨σ⟩ over the last ``window`` gradients (0: the whole run), at least 1."""

    name = "mean-staleness"

    def __init__(self, window: int = 0) -> None:
        if window < 0:
            raise ConfigError(f"mean-staleness window must be >= 0, got {window}")
        self.window = window
        self._recent: deque[int] = deque(maxlen=window or None)  # only kept with a window
        self._sum = 0
        self._count = 0

    def observe(self, sigma: int) -> None:
        if self.window:
            if len(self._recent) == self.window:
                self._sum -= self._recent[0]
                self._count -= 1
            self._recent.append(sigma)
        self._sum += sigma
        self._count += 1

    def state(self) -> dict[str, Any]:
        return {"sum": self._sum, "count": self._count, "recent": list(self._recent)}

    def load_state(self, state: dict[str, Any]) -> None:
        recent = [int(s) for s in state.get("recent", [])][-self.window :] if self.window else []
        if self.window:  # the window's own sums (the checkpointed run may have had another window)
            self._recent = deque(recent, maxlen=self.window)
            self._sum, self._count = sum(recent), len(recent)
        else:
            self._sum, self._count = int(state.get("sum", 0)), int(state.get("count", 0))

    @property
    def mean(self) -> float:
        return self._sum / self._count if self._count else 0.0

    def factor(self, sigma: int) -> float:
        return 1.0 / max(1.0, self.mean)


@dataclass
class Schedule:
    """The base rate at update ``t`` (and epoch ``e``, when known).

    - ``decay_at``: milestones (in updates, or epochs if ``decay_unit == "epochs"``) after
      which the rate is multiplied by ``decay``;
    - ``warmup``: the rate ramps linearly over the first ``warmup`` updates;
    - ``scale_ref_batch``: the linear scaling rule, α × (samples in the update)/ref; for
      hardsync that is α × μλ/μ_ref.
    """

    base: float
    decay_at: Sequence[float] = field(default_factory=tuple)
    decay: float = 0.1
    decay_unit: str = "updates"
    warmup: int = 0
    scale_ref_batch: int | None = None

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ConfigError(f"learning rate must be > 0, got {self.base}")
        if self.decay_unit not in ("updates", "epochs"):
            raise ConfigError(f"decay unit must be 'updates' or 'epochs', got {self.decay_unit!r}")
        if not 0 < self.decay <= 1:
            raise ConfigError(f"decay factor must be in (0, 1], got {self.decay}")
        if self.warmup < 0:
            raise ConfigError(f"warm-up must be >= 0 updates, got {self.warmup}")
        if self.scale_ref_batch is not None and self.scale_ref_batch < 1:
            raise ConfigError(f"the reference batch must be >= 1, got {self.scale_ref_batch}")
        self.decay_at = tuple(sorted(self.decay_at))

    def rate(
        self, update: int, epoch: float | None = None, batch_samples: int | None = None, base: float | None = None
    ) -> float:
        """The rate for the update numbered ``update`` (0-based), from ``base`` (default: the
        schedule's own; a parameter group's base rate otherwise)."""
        alpha = self.base if base is None else base
        position = update if self.decay_unit == "updates" else epoch
        if position is None:
            if self.decay_at:
                raise ConfigError("epoch-based decay needs the epoch size (--samples-per-epoch)")
        else:
            alpha *= self.decay ** sum(1 for m in self.decay_at if position >= m)
        if self.warmup and update < self.warmup:
            alpha *= (update + 1) / self.warmup
        if self.scale_ref_batch and batch_samples:
            alpha *= batch_samples / self.scale_ref_batch
        return alpha

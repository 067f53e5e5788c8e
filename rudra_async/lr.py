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

from .errors import ConfigError, quoted
from .schema import all_counts, is_count

__all__ = [
    "Compensated",
    "Constant",
    "LRPolicy",
    "MeanStaleness",
    "Schedule",
    "Staleness",
    "StalenessPlusOne",
]


class LRPolicy:
    """Per-gradient factor from staleness. ``observe`` sees every applied gradient's σ first.

    A policy may also set the update's momentum (:meth:`momentum`) and scale its rate
    (:meth:`rate_factor`); both are asked after the update's σ are observed."""

    name = "?"

    def observe(self, sigma: int) -> None:
        pass

    def factor(self, sigma: int) -> float:
        raise NotImplementedError

    def momentum(self, beta: float) -> float:
        """The momentum of this update, from the configured β (default: β)."""
        return beta

    def rate_factor(self, clock: int) -> float:
        """A factor of this update's rate η_t (default 1)."""
        return 1.0

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


#: the longest mean-staleness window: a checkpoint keeps the window's values (see
#: ``checkpoint._MAX_VALUES``, which leaves room for as many more)
MAX_WINDOW = 1 << 23


class MeanStaleness(LRPolicy):
    """α0/⟨σ⟩ with ⟨σ⟩ over the last ``window`` gradients (0: the whole run), at least 1.

    :meth:`state` describes itself: ``window``; ``sum`` and ``count`` of every σ observed
    in the run; ``recent``, the last min(``window``, ``count``) of them. :meth:`load_state`
    continues from the state of a run with another window where that state has the values
    the new mean needs (a smaller window, or 0: the whole run), and raises ValueError where
    it has not (a larger window than the checkpoint's, or any after one of 0, once the run
    has observed more values than the checkpoint kept)."""

    name = "mean-staleness"

    def __init__(self, window: int = 0) -> None:
        if not 0 <= window <= MAX_WINDOW:
            raise ConfigError(f"mean-staleness window must be in [0, {MAX_WINDOW}], got {window}")
        self.window = window
        self._recent: deque[int] = deque(maxlen=window or None)  # only kept with a window
        self._recent_sum = 0
        self._sum = 0  # of the whole run
        self._count = 0

    def observe(self, sigma: int) -> None:
        if self.window:
            if len(self._recent) == self.window:
                self._recent_sum -= self._recent[0]
            self._recent.append(sigma)
            self._recent_sum += sigma
        self._sum += sigma
        self._count += 1

    def state(self) -> dict[str, Any]:
        return {"window": self.window, "sum": self._sum, "count": self._count, "recent": list(self._recent)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state` (or that of an earlier version: see
        :func:`read_mean_staleness`); raises ValueError, changing nothing, if ``state`` is
        not one or lacks the values this window needs."""
        saved = read_mean_staleness(state)
        if self.window:
            needed = min(self.window, saved.count)
            if len(saved.recent) < needed:
                raise ValueError(
                    f"mean-staleness: the checkpoint keeps the last {len(saved.recent)} of the run's {saved.count} "
                    f"staleness values (window {saved.window}); a window of {self.window} needs the last {needed}: "
                    f"resume with --mean-staleness-window 0" + (f" or at most {saved.window}" if saved.window else "")
                )
            recent = saved.recent[-self.window :]
        elif not saved.whole_run:
            raise ValueError(
                "mean-staleness: the checkpoint (of an earlier version, written with a window) keeps only the "
                "window's staleness values, not the whole run's: resume with --mean-staleness-window > 0"
            )
        else:
            recent = []
        self._recent = deque(recent, maxlen=self.window or None)
        self._recent_sum = sum(recent)
        self._sum, self._count = saved.sum, saved.count

    @property
    def mean(self) -> float:
        if self.window:
            return self._recent_sum / len(self._recent) if self._recent else 0.0
        return self._sum / self._count if self._count else 0.0

    def factor(self, sigma: int) -> float:
        return 1.0 / max(1.0, self.mean)


class Compensated(LRPolicy):
    """The default: a run tuned for one process trains as it did, asynchronously. Asynchrony
    adds momentum of its own (Mitliagkas et al. 2016), and with the configured momentum it
    makes a stale update overshoot; so, with ⟨σ⟩ the mean of the last :data:`WINDOW`
    observed σ (this update's included):

    - momentum β_t = 1 − (1 − β)(⟨σ⟩ + 1), at least 0 (β itself at ⟨σ⟩ = 0): momentum's
      time constant 1/(1 − β) shrinks by ⟨σ⟩ + 1, so its long-run step η/(1 − β_t) by as much;
    - a warm-up while staleness first appears: η_t × min(1, (t + 1)/(:data:`WARMUP` · ⟨σ⟩))
      at clock t (1 at ⟨σ⟩ = 0);
    - f(σ) = 1.

    Without staleness (hardsync, one learner) it is ``constant`` exactly."""

    name = "compensated"
    WINDOW = 128  # observed σ the mean is taken over
    WARMUP = 64  # updates of warm-up per unit of mean staleness

    def __init__(self) -> None:
        self._staleness = MeanStaleness(self.WINDOW)

    def observe(self, sigma: int) -> None:
        self._staleness.observe(sigma)

    def factor(self, sigma: int) -> float:
        return 1.0

    def momentum(self, beta: float) -> float:
        mean = self._staleness.mean
        return beta if mean == 0 else max(0.0, 1.0 - (1.0 - beta) * (mean + 1.0))

    def rate_factor(self, clock: int) -> float:
        mean = self._staleness.mean
        return 1.0 if mean == 0 else min(1.0, (clock + 1) / (self.WARMUP * mean))

    def state(self) -> dict[str, Any]:
        return self._staleness.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self._staleness.load_state(state)


@dataclass(frozen=True)
class SavedMeanStaleness:
    """A :class:`MeanStaleness` state read back and checked (:func:`read_mean_staleness`).
    ``whole_run`` False: ``sum`` and ``count`` are only those of ``recent`` (a file of an
    earlier version written with a window, whose ``window`` is unknown: None)."""

    window: int | None
    sum: int
    count: int
    recent: list[int]
    whole_run: bool = True


#: the keys of a :class:`MeanStaleness` state: a checkpoint's ``lr_policy`` map with any of
#: them is read as one, whatever policy the resuming server has
MEAN_STALENESS_KEYS = ("window", "sum", "count", "recent")


def read_mean_staleness(state: Any) -> SavedMeanStaleness:
    """Read a :meth:`MeanStaleness.state` map: ``window``, ``sum``, ``count``: ints in
    [0, 2^63−1]; ``recent``: a list of min(``window``, ``count``) such ints whose sum is at
    most ``sum``. A map without ``window`` is one of an earlier version: ``sum`` and
    ``count`` (default 0) of the whole run and no ``recent`` if written without a window,
    else ``recent`` (the window's values) and their ``sum`` and ``count``. Raises ValueError
    naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"the mean-staleness state must be a map, got {type(state).__name__}")
    recent = state.get("recent", [])
    if not isinstance(recent, list) or not all_counts(recent):
        raise ValueError("mean-staleness 'recent' must be a list of ints in [0, 2^63-1]")
    for key in ("window", "sum", "count"):
        if key in state and not is_count(state[key]):
            raise ValueError(f"mean-staleness {key!r} must be an int in [0, 2^63-1], got {quoted(state[key])}")
    if "window" not in state:  # an earlier version's
        if recent:  # written with a window: its sum and count were the window's
            return SavedMeanStaleness(None, sum(recent), len(recent), recent, whole_run=False)
        return SavedMeanStaleness(0, state.get("sum", 0), state.get("count", 0), [])
    if "sum" not in state or "count" not in state:
        raise ValueError("mean-staleness state has a 'window' but no 'sum' or 'count'")
    window, total, count = state["window"], state["sum"], state["count"]
    if len(recent) != min(window, count) or sum(recent) > total or (total and not count):
        raise ValueError(
            f"mean-staleness state is inconsistent: {len(recent)} recent values summing to {sum(recent)}, "
            f"window {window}, {count} values summing to {total}"
        )
    return SavedMeanStaleness(window, total, count, recent)


def check_policy_state(state: Any) -> None:
    """Check a checkpoint's ``lr_policy`` entry whatever policy will load it: a map (what
    :meth:`LRPolicy.state` returns); one with any of :data:`MEAN_STALENESS_KEYS` must be a
    valid :class:`MeanStaleness` state. Raises ValueError naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"the LR policy's state must be a map, got {type(state).__name__}")
    if any(key in state for key in MEAN_STALENESS_KEYS):
        read_mean_staleness(state)


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

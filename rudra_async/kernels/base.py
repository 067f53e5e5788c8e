"""What every update backend shares: the settings of one parameter group (:class:`SGD`),
the groups of a flat vector (:class:`Group`), the :class:`Updater` interface, and the
checks of a pushed gradient (:func:`max_abs`). The formula is in :mod:`rudra_async.kernels`."""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SGD:
    """The optimizer settings of one update, as ``torch.optim.SGD`` names them (dampening 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True)
class Group:
    """Values [lo, hi) of the flat vector and the settings of their update."""

    lo: int
    hi: int
    sgd: SGD


#: what an update applies: one SGD for the whole vector, or one per group (covering it in order)
Steps = SGD | Sequence[Group]


def as_groups(steps: Steps, size: int) -> Sequence[Group]:
    """``steps`` as groups that cover [0, size) in order, without gaps or overlaps."""
    if isinstance(steps, SGD):
        return (Group(0, size, steps),)
    edge = 0
    for g in steps:
        if g.lo != edge or g.hi < g.lo:
            raise ValueError(f"groups must cover [0, {size}) in order; a group spans [{g.lo}, {g.hi})")
        edge = g.hi
    if edge != size:
        raise ValueError(f"groups must cover [0, {size}); they end at {edge}")
    return steps


def within(steps: Steps, size: int, span: tuple[int, int] | None = None) -> list[Group]:
    """The groups of ``steps`` (covering [0, size)) cut to ``span`` = [lo, hi) (None: the
    whole vector), empty ones left out."""
    lo, hi = span or (0, size)
    if not 0 <= lo <= hi <= size:
        raise ValueError(f"span [{lo}, {hi}) is not within [0, {size})")
    whole = lo == 0 and hi == size  # the groups as they are (making new ones costs a small update ~2 µs)
    cut = (g if whole else Group(max(g.lo, lo), min(g.hi, hi), g.sgd) for g in as_groups(steps, size))
    return [g for g in cut if g.lo < g.hi]


class Updater(abc.ABC):
    """Owns the momentum buffer (and, on a GPU, the master weights) of one flat parameter vector.

    ``apply`` reads the current weights from ``w`` (host) and writes the new ones into
    ``w_out`` (host; may be ``w`` itself); ``steps`` is one :class:`SGD` or one per group.
    A backend with :attr:`partial` also takes a ``span`` [lo, hi): it then computes only those
    values; an update computed in spans that cover the vector in order, each once, cut at
    multiples of :attr:`grain`, equals the whole update bit for bit. The others take only
    ``span=None``.
    """

    #: whether :meth:`apply` computes a part of the vector (``span``)
    partial = False
    #: spans cut at multiples of this many values give the whole update's bits
    grain = 1

    def __init__(self, size: int) -> None:
        self.size = size

    @abc.abstractmethod
    def apply(
        self,
        w: np.ndarray,
        w_out: np.ndarray,
        grads: Sequence[np.ndarray],
        scales: Sequence[float],
        steps: Steps,
        span: tuple[int, int] | None = None,
    ) -> None: ...

    @property
    @abc.abstractmethod
    def momentum(self) -> np.ndarray:
        """A snapshot of the momentum buffer in host memory, owned by the caller."""

    @abc.abstractmethod
    def load_momentum(self, v: np.ndarray) -> None:
        """Replace the momentum buffer (``size`` float32 values), e.g. from a checkpoint."""

    def max_abs(self, a: np.ndarray) -> float:
        """:func:`max_abs` of a host array (a pushed gradient), as fast as this backend can:
        the same value whatever the backend (max and min are exact)."""
        return max_abs(a)


class HostUpdater(Updater):
    """An updater whose momentum lives in host memory (``self._v``)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._v: np.ndarray = np.zeros(size, np.float32)

    @property
    def momentum(self) -> np.ndarray:
        snapshot: np.ndarray = self._v.copy()
        return snapshot

    def load_momentum(self, v: np.ndarray) -> None:
        check_momentum(v, self.size)
        self._v[:] = v


#: values per block of :func:`max_abs` (1 MiB of float32): its second reduction reads the cache
MAX_ABS_BLOCK = 1 << 18


def max_abs(a: np.ndarray) -> float:
    """max |a| of an array as a Python float; NaN if ``a`` holds a NaN, 0.0 if it is empty.
    Block by block, max then min of each block, so the array is read from memory once (no
    temporary)."""
    if not a.size:
        return 0.0
    flat, found = a.reshape(-1), 0.0
    for lo in range(0, flat.size, MAX_ABS_BLOCK):
        block = flat[lo : lo + MAX_ABS_BLOCK]  # the ufuncs' reduce: not ndarray.max's Python wrapper
        high, low = float(np.maximum.reduce(block)), float(np.minimum.reduce(block))
        if math.isnan(high) or math.isnan(low):
            return math.nan
        found = max(found, abs(high), abs(low))
    return found


def check_batch(grads: Sequence[np.ndarray], scales: Sequence[float], size: int) -> None:
    if not grads or len(grads) != len(scales):
        raise ValueError("need one scale per gradient and at least one gradient")
    for g in grads:
        if g.size != size or g.dtype not in (np.float32, np.float16):
            raise ValueError(f"gradients must be float32/float16 of {size} values, got {g.dtype} × {g.size}")


def check_momentum(v: np.ndarray, size: int) -> None:
    if v.dtype != np.float32 or v.size != size:
        raise ValueError(f"momentum must be float32 of {size} values, got {v.dtype} × {v.size}")

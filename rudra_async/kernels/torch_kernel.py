"""The torch CPU backend: torch's fused SGD kernel (the one behind ``SGD(fused=True)``)
over the host buffers, viewed without copies. For c > 1 the scaled gradients are first
summed block by block, so the combined gradient stays in cache."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from .base import SGD, Group, HostUpdater, Steps, check_batch, max_abs, within

BLOCK = 1 << 20  # 4 MiB of float32 per operand: few Python calls, still cache-friendly
#: below this many values numpy's max_abs is as fast or faster (1K–256K: 3–10% faster, timeit)
AMINMAX_MIN_VALUES = 1 << 20
#: host buffers whose tensor views an updater keeps (the weight store passes its few buffers again and again)
VIEWS_KEPT = 8


def grid(lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) cut at the multiples of BLOCK. torch's fused SGD may round a value
    differently depending on where it sits in a call (its vectorized body or its tail), so
    every call covers one block of this fixed grid: an update then gives the same bits
    whether it is computed whole or in spans cut at multiples of BLOCK."""
    while lo < hi:
        edge = min((lo // BLOCK + 1) * BLOCK, hi)
        yield lo, edge
        lo = edge


def _cut(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``t[lo:hi]``, or ``t`` itself where that is all of it (a slice costs a small update ~1 µs)."""
    return t if lo == 0 and hi == t.shape[0] else t[lo:hi]


class TorchUpdater(HostUpdater):
    partial = True
    grain = BLOCK

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._vt = torch.from_numpy(self._v)  # shares memory with the host momentum
        self._scratch = threading.local()  # a combined gradient's block, one per thread: spans may run side by side
        self._views: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        self._views_lock = threading.Lock()

    def apply(
        self,
        w: np.ndarray,
        w_out: np.ndarray,
        grads: Sequence[np.ndarray],
        scales: Sequence[float],
        steps: Steps,
        span: tuple[int, int] | None = None,
    ) -> None:
        check_batch(grads, scales, self.size)
        lo, hi = span or (0, self.size)
        groups = within(steps, self.size, (lo, hi))
        wt, out = self._tensor(w), self._tensor(w_out)
        if out.data_ptr() != wt.data_ptr():
            _cut(out, lo, hi).copy_(_cut(wt, lo, hi))
        gs = [torch.from_numpy(g) for g in grads]
        for group in groups:
            self._apply_group(out, gs, scales, group)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        """A tensor sharing ``a``'s memory: the same one again for the same array object (kept
        with it, so its id cannot be reused meanwhile), which saves a small update most of its cost."""
        with self._views_lock:  # spans of one update may run on several threads
            kept = self._views.get(id(a))
            if kept is not None and kept[0] is a:
                return kept[1]
            if len(self._views) >= VIEWS_KEPT:
                self._views.pop(next(iter(self._views)))
            t = torch.from_numpy(a)
            self._views[id(a)] = (a, t)
            return t

    def _block(self) -> torch.Tensor:
        """This thread's scratch block for a combined gradient."""
        d: torch.Tensor | None = getattr(self._scratch, "d", None)
        if d is None:
            d = self._scratch.d = torch.empty(min(BLOCK, max(self.size, 1)), dtype=torch.float32)
        return d

    def max_abs(self, a: np.ndarray) -> float:
        """``torch.aminmax``: min and max in one vectorized pass, about 1.6× faster on one
        thread than numpy's two reductions per block at 25M values (``benchmarks/kernels.py``). A NaN
        anywhere makes both NaN. A small, read-only or non-contiguous array goes the numpy way."""
        if a.size < AMINMAX_MIN_VALUES or not a.flags.writeable or not a.flags.c_contiguous:
            return max_abs(a)
        low, high = torch.aminmax(torch.from_numpy(a.reshape(-1)))
        lo, hi = float(low), float(high)
        return math.nan if math.isnan(lo) or math.isnan(hi) else max(abs(lo), abs(hi))

    def _apply_group(self, out: torch.Tensor, gs: list[torch.Tensor], scales: Sequence[float], group: Group) -> None:
        sgd = group.sgd
        unit = len(gs) == 1 and scales[0] == 1.0 and gs[0].dtype == torch.float32  # no combined gradient to make
        for lo, hi in grid(group.lo, group.hi):
            if unit:
                self._step(_cut(out, lo, hi), _cut(gs[0], lo, hi), _cut(self._vt, lo, hi), sgd)
                continue
            d = self._block()[: hi - lo]
            if gs[0].dtype == torch.float32:
                torch.mul(gs[0][lo:hi], scales[0], out=d)
            else:  # float16: widen first, so the product is computed in float32
                d.copy_(gs[0][lo:hi])
                d.mul_(scales[0])
            for g, s in zip(gs[1:], scales[1:]):  # in-place add computes in float32
                d.add_(g[lo:hi], alpha=s)
            self._step(_cut(out, lo, hi), d, _cut(self._vt, lo, hi), sgd)

    @staticmethod
    def _step(w: torch.Tensor, d: torch.Tensor, v: torch.Tensor, sgd: SGD) -> None:
        torch._fused_sgd_(
            [w],
            [d],
            [v] if sgd.momentum else [],
            weight_decay=sgd.weight_decay,
            momentum=sgd.momentum,
            lr=sgd.lr,
            dampening=0.0,
            nesterov=sgd.nesterov,
            maximize=False,
            is_first_step=False,
        )

"""The numpy backend: the reference. In place, cache-sized blocks, no full-size temporaries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import SGD, HostUpdater, Steps, check_batch, within

#: values per block (1 MiB of float32 per array): on this project's 2-core host an update of
#: 25M values took ~16 ms on two part threads against ~26 ms with 64Ki-value blocks
#: (``python benchmarks/kernels.py --blocks``); the result does not depend on it
BLOCK = 1 << 18


def apply(
    w: np.ndarray, w_out: np.ndarray, v: np.ndarray, grads: Sequence[np.ndarray], scales: Sequence[float], sgd: SGD
) -> None:
    """One fused pass over one group (see :mod:`rudra_async.kernels`), block by block."""
    lr, momentum, weight_decay, nesterov = sgd.lr, sgd.momentum, sgd.weight_decay, sgd.nesterov
    n = w.size
    m = min(BLOCK, n)
    d = np.empty(m, np.float32)
    u = np.empty(m, np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        k = hi - lo
        db, ub, wb = d[:k], u[:k], w[lo:hi]
        _scaled(grads[0][lo:hi], scales[0], out=db)
        for g, s in zip(grads[1:], scales[1:]):
            _scaled(g[lo:hi], s, out=ub)
            db += ub
        if weight_decay:
            np.multiply(wb, np.float32(weight_decay), out=ub)
            db += ub
        step = db
        if momentum:
            vb = v[lo:hi]
            vb *= np.float32(momentum)
            vb += db
            if nesterov:
                np.multiply(vb, np.float32(momentum), out=ub)
                db += ub
            else:
                step = vb
        np.multiply(step, np.float32(-lr), out=ub)
        np.add(wb, ub, out=w_out[lo:hi])


def _scaled(g: np.ndarray, scale: float, out: np.ndarray) -> None:
    """``out = scale · g`` computed in float32: a float16 ``g`` is widened first (NumPy 1.x
    would otherwise multiply in float16, its value-based casting ignoring the scalar's type)."""
    if g.dtype == np.float32:
        np.multiply(g, np.float32(scale), out=out)
    else:
        np.copyto(out, g, casting="safe")
        out *= np.float32(scale)


class NumpyUpdater(HostUpdater):
    partial = True

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
        for g in within(steps, self.size, span):
            part = slice(g.lo, g.hi)
            apply(w[part], w_out[part], self._v[part], [x[part] for x in grads], scales, g.sgd)

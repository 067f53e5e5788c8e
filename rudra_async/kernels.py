"""Update kernels: fold c scaled gradients, momentum and weight decay into the weights.

``apply`` is the one entry point. It follows ``torch.optim.SGD`` (dampening 0)::

    d = sum_l scales[l] * grads[l] + weight_decay * w
    v = momentum * v + d                       (v starts at 0, so the first v is d)
    step = d + momentum * v if nesterov else v
    w_out = w - lr * step

``w_out`` may be ``w`` itself (in place) or another buffer (used when readers still hold
``w``). The numpy path works in cache-sized blocks with no full-size temporaries.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

BLOCK = 1 << 16


def apply(
    w: np.ndarray,
    w_out: np.ndarray,
    v: np.ndarray,
    grads: Sequence[np.ndarray],
    scales: Sequence[float],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> None:
    if not grads or len(grads) != len(scales):
        raise ValueError("need one scale per gradient and at least one gradient")
    n = w.size
    m = min(BLOCK, n)
    d = np.empty(m, np.float32)
    u = np.empty(m, np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        k = hi - lo
        db, ub, wb = d[:k], u[:k], w[lo:hi]
        np.multiply(grads[0][lo:hi], np.float32(scales[0]), out=db, casting="unsafe")
        for g, s in zip(grads[1:], scales[1:]):
            np.multiply(g[lo:hi], np.float32(s), out=ub, casting="unsafe")
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

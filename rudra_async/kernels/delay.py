"""Delay compensation (DC-ASGD, Zheng et al., ICML 2017): a gradient computed on older weights
corrected by the first-order term of its change since (docs/protocols.md#delay-compensation---dc-lambda)::

    g̃ = g + λ_dc · g ⊙ g ⊙ (θ_now − θ_then)

computed on the host in float32, for every backend, before the backend's own arithmetic."""

from __future__ import annotations

import numpy as np

BLOCK = 1 << 16  # values per block: the temporaries stay in cache


def delay_compensated(g: np.ndarray, now: np.ndarray, then: np.ndarray, dc_lambda: float) -> np.ndarray:
    """g̃ as a new float32 array, each element computed as documented: u = g ⊗ g,
    u = u ⊗ (now ⊖ then), u = u ⊗ λ_dc (rounded to float32 once), g̃ = g ⊕ u. A float16
    ``g`` is widened to float32 first (exactly)."""
    n = g.size
    if now.size != n or then.size != n:
        raise ValueError(f"a gradient of {n} values cannot be compensated with weights of {now.size} and {then.size}")
    lam = np.float32(dc_lambda)
    out = np.empty(n, np.float32)
    m = min(BLOCK, max(n, 1))
    wide = np.empty(m, np.float32)
    diff = np.empty(m, np.float32)
    for lo in range(0, n, BLOCK):
        hi = min(lo + BLOCK, n)
        k = hi - lo
        gb, ub, db = wide[:k], out[lo:hi], diff[:k]
        np.copyto(gb, g[lo:hi], casting="safe")
        np.multiply(gb, gb, out=ub)
        np.subtract(now[lo:hi], then[lo:hi], out=db)
        ub *= db
        ub *= lam
        ub += gb
    return out

"""Settings where training is known to fail: the rule behind the warnings that ``server``,
``train`` and ``launch`` give at start (docs/own_training.md#guard-rails), and behind the
candidates ``rudra-async advise`` excludes (rudra_async.runs.advise).

Asynchronous learners compute on weights σ updates old. With momentum β, a stale gradient's
step is repeated by the momentum buffer for about 1/(1 − β) updates after the learner's
weights were taken, so the server overshoots; with β = 0.9 the linear stability limit of
the rate falls by a factor of about 38 at σ = 1 already. Measured (docs/own_training.md):
with a rate that does not shrink at σ = 1 (``constant``, and ``staleness`` or
``mean-staleness``, which are 1 there), asynchronous runs at λ = 2–8 with momentum 0.9
collapse to chance accuracy on a BatchNorm CNN and at λ ≥ 4 on MLPs, where ``compensated``
(the default) trains to the single-process accuracy.
"""

from __future__ import annotations

import logging

from .config import ServerConfig
from .sync import AdaptiveSoftsync

__all__ = ["FAILING_POLICIES", "expected_staleness", "risks", "warn"]

log = logging.getLogger(__name__)

#: policies whose rate is not reduced at σ = 1 (``constant`` at no σ)
FAILING_POLICIES = ("constant", "staleness", "mean-staleness")


def expected_staleness(
    protocol: str,
    learners: int,
    *,
    n: int | None = None,
    staleness_bound: int | None = None,
    staleness_target: float | None = None,
    overlap: bool = False,
) -> float | None:
    """The mean σ a run of homogeneous learners settles at: 0 for hardsync and backup; λ/c − 1
    for softsync (c = max(1, ⌊λ/n⌋) gradients per update: each learner's gradient waits for
    the others' λ/c − 1 updates; async is λ-softsync); bounded as async, at most its bound.
    Overlapping learners push one exchange later: λ/c more. ``adaptive`` steers σ to its
    target, overlap included. None for a plugin's protocol."""
    if protocol in ("hardsync", "backup"):
        return 0.0
    if protocol == "adaptive":
        return staleness_target or AdaptiveSoftsync.DEFAULT_TARGET
    if protocol not in ("async", "softsync", "bounded"):
        return None
    per_update = max(1, learners // n) if protocol == "softsync" and n else 1
    sigma = learners / per_update - 1
    if protocol == "bounded" and staleness_bound is not None:
        sigma = min(sigma, staleness_bound)
    return sigma + (learners / per_update if overlap else 0.0)


def risks(server: ServerConfig, learners: int | None = None, overlap: bool = False) -> list[str]:
    """Why these settings are expected to fail, with the remedy (empty: none known). A
    warning when the momentum is above 0 and the expected staleness σ̂
    (:func:`expected_staleness`; λ: ``learners``, else ``--expected-learners``, else 2) is at
    least 1 under ``constant``, or in [1, 2) under ``staleness`` or ``mean-staleness``
    (which are 1 at σ = 1)."""
    lam = learners or server.expected_learners or 2
    sigma = expected_staleness(
        server.protocol,
        lam,
        n=server.n,
        staleness_bound=server.staleness_bound,
        staleness_target=server.staleness_target,
        overlap=overlap,
    )
    if sigma is None or sigma < 1 or not server.momentum or server.lr_policy not in FAILING_POLICIES:
        return []
    if server.lr_policy != "constant" and sigma >= 2:  # α0/σ and α0/⟨σ⟩ shrink from σ = 2 on
        return []
    known = "" if learners or server.expected_learners else " (with 2 learners; more make it worse)"
    return [
        f"--lr-policy {server.lr_policy} with --momentum {server.momentum:g} under --protocol {server.protocol}"
        f"{' with --overlap' if overlap else ''}: gradients will be about {sigma:g} updates stale{known}, and a "
        "rate that does not shrink for them lets the momentum overshoot: in the measurements of "
        "docs/own_training.md such runs collapse to chance accuracy. Use --lr-policy compensated (the default), "
        "or lower --momentum."
    ]


def warn(server: ServerConfig, learners: int | None = None, overlap: bool = False) -> None:
    """Log each of :func:`risks` as a warning (at start, before any learner trains)."""
    for message in risks(server, learners, overlap):
        log.warning("%s", message)

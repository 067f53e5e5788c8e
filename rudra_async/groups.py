"""Parameter groups: runs of consecutive tensors of the layout that share a learning rate
and a weight decay, as ``torch.optim`` parameter groups do (momentum and nesterov are the
server's, one for all). The learner that brings the initial weights declares them in its
HELLO (``groups``); by default there is one group with the server's ``--lr`` and
``--weight-decay``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RequestError, quoted
from .kernels import SGD, Group
from .layout import Layout


@dataclass(frozen=True)
class ParamGroup:
    """``tensors`` consecutive tensors (in layout order) updated with ``lr`` (the group's
    base rate α0, which the schedule scales) and ``weight_decay``."""

    tensors: int
    lr: float
    weight_decay: float

    def to_wire(self) -> list[Any]:
        return [self.tensors, self.lr, self.weight_decay]


def default_groups(layout: Layout, lr: float, weight_decay: float) -> tuple[ParamGroup, ...]:
    """One group for the whole layout."""
    return (ParamGroup(len(layout.tensors), lr, weight_decay),)


def parse_groups(raw: Any, layout: Layout) -> tuple[ParamGroup, ...]:
    """``[[tensors, lr, weight_decay], ...]`` covering every tensor of ``layout`` in order;
    raises :class:`RequestError` (``bad_groups``) naming what is wrong."""

    def bad(why: str) -> RequestError:
        return RequestError(f"groups: {why}", code="bad_groups")

    if not isinstance(raw, list) or not raw:
        raise bad("must be a non-empty list of [tensors, lr, weight_decay]")
    groups = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise bad(f"bad entry {quoted(item)}; expected [tensors, lr, weight_decay]")
        tensors, lr, decay = item
        if not isinstance(tensors, int) or isinstance(tensors, bool) or tensors < 1:
            raise bad(f"tensors must be an integer >= 1, got {quoted(tensors)}")
        if not _number(lr) or not lr > 0:
            raise bad(f"lr must be a finite number > 0, got {quoted(lr)}")
        if not _number(decay) or decay < 0:
            raise bad(f"weight_decay must be a finite number >= 0, got {quoted(decay)}")
        groups.append(ParamGroup(tensors, float(lr), float(decay)))
    if sum(g.tensors for g in groups) != len(layout.tensors):
        raise bad(f"cover {sum(g.tensors for g in groups)} tensors; the layout has {len(layout.tensors)}")
    return tuple(groups)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def steps_for(
    groups: Sequence[ParamGroup],
    layout: Layout,
    shard_range: tuple[int, int],
    rates: Sequence[float],
    momentum: float,
    nesterov: bool,
) -> list[Group]:
    """The kernel's groups for one update of the values ``shard_range`` holds: ``rates[i]``
    is group i's learning rate for this update (the schedule applied to its base rate)."""
    lo, hi = shard_range
    steps, tensor = [], 0
    for g, rate in zip(groups, rates):
        first, last = layout.tensors[tensor], layout.tensors[tensor + g.tensors - 1]
        tensor += g.tensors
        start, end = max(first.offset, lo), min(last.offset + last.size, hi)
        if start < end:
            steps.append(Group(start - lo, end - lo, SGD(rate, momentum, g.weight_decay, nesterov)))
    return steps

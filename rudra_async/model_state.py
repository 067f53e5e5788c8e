"""The model's state besides its trained parameters: frozen parameters and buffers
(BatchNorm's running statistics, ...), kept by the server so that its checkpoint holds the
whole model. Pure: no I/O.

A learner declares its state tensors in HELLO (``state``: ``[name, dtype, shape, kind]``
each, kind ``"frozen"`` or ``"buffer"``); the first HELLO that declares them sets the run's
:class:`StateLayout`, and a later one must declare the same (``layout_mismatch`` naming
the first tensor that differs). Values travel in STATE messages (docs/wire.md):
:class:`RunState` takes the first complete set as the run's values, and combines the
buffers that learners report afterwards (:meth:`RunState.report`, the rule in
docs/protocols.md#the-models-state).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import RequestError, quoted
from .layout import MAX_NAME, MAX_TENSOR_DIMS
from .wire import ALLOWED_DTYPES, MAX_SEGMENTS

__all__ = ["KINDS", "RunState", "StateLayout", "StateTensor"]

KINDS = ("frozen", "buffer")


@dataclass(frozen=True)
class StateTensor:
    """One state tensor: ``dtype`` in numpy's notation (``"<f4"``), ``kind`` one of :data:`KINDS`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str

    @property
    def nbytes(self) -> int:
        return int(np.dtype(self.dtype).itemsize * np.prod(self.shape, dtype=np.int64))

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.kind]

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} ({self.dtype}, shape {list(self.shape)})"


@dataclass(frozen=True)
class StateLayout:
    """The run's state tensors, in order (a model's ``state_dict`` order)."""

    tensors: tuple[StateTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_wire(self) -> list[list[Any]]:
        return [t.to_wire() for t in self.tensors]

    def buffers(self) -> tuple[StateTensor, ...]:
        return tuple(t for t in self.tensors if t.kind == "buffer")

    @classmethod
    def from_wire(cls, raw: Any) -> StateLayout:
        """Parse ``[[name, dtype, shape, kind], ...]`` (at most :data:`MAX_SEGMENTS` tensors,
        distinct names); raises :class:`RequestError` (``bad_layout``) naming the entry."""
        if not isinstance(raw, list) or len(raw) > MAX_SEGMENTS:
            raise RequestError(f"state must be a list of at most {MAX_SEGMENTS} entries", code="bad_layout")
        tensors, names = [], set()
        for item in raw:
            ok = (
                isinstance(item, list)
                and len(item) == 4
                and isinstance(item[0], str)
                and 0 < len(item[0]) <= MAX_NAME
                and item[1] in ALLOWED_DTYPES
                and isinstance(item[2], list)
                and len(item[2]) <= MAX_TENSOR_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[2])
                and item[3] in KINDS
            )
            if not ok:
                raise RequestError(
                    f"bad state entry {quoted(item)}; expected [name, dtype, shape, kind] with a dtype of "
                    f"docs/wire.md, at most {MAX_TENSOR_DIMS} sizes >= 0 and kind 'frozen' or 'buffer'",
                    code="bad_layout",
                )
            if item[0] in names:
                raise RequestError(f"state tensor {item[0]!r} is declared twice", code="bad_layout")
            names.add(item[0])
            tensors.append(StateTensor(item[0], item[1], tuple(item[2]), item[3]))
        return cls(tuple(tensors))

    def mismatch(self, other: StateLayout) -> str | None:
        """Why ``other`` (a learner's) is not this run's state layout, naming the first tensor
        that differs; None when they are equal."""
        for mine, theirs in zip(self.tensors, other.tensors):
            if mine != theirs:
                return f"the run's {mine.describe()} is the learner's {theirs.describe()}"
        if len(self.tensors) != len(other.tensors):
            longer, who = (self, "the run") if len(self.tensors) > len(other.tensors) else (other, "the learner")
            extra = longer.tensors[min(len(self.tensors), len(other.tensors))]
            return f"{who} has {extra.describe()}, which the other lacks"
        return None

    def check_arrays(self, tensors: Sequence[StateTensor], arrays: Sequence[np.ndarray]) -> None:
        """``bad_shape`` unless ``arrays`` are ``tensors``' values: one each, of its dtype and shape."""
        if len(arrays) != len(tensors):
            raise RequestError(f"expected {len(tensors)} state segments, got {len(arrays)}", code="bad_shape")
        for t, a in zip(tensors, arrays):
            if a.dtype.str != t.dtype or a.shape != t.shape:
                raise RequestError(
                    f"state tensor {t.name!r} must be {t.dtype} of shape {list(t.shape)}, got {a.dtype.str} "
                    f"of shape {list(a.shape)}",
                    code="bad_shape",
                )


class RunState:
    """The run's state values (None until a learner sends them all) and the buffers reported.

    The run's value of a floating-point buffer is the mean of the newest report of each of
    the ``L`` learners that reported most recently, ``L`` being the most learners registered
    at once so far (:meth:`report`'s ``peak``): summed in float64 in the order of the
    learners' ids, divided by their number, rounded to the buffer's dtype. A buffer of
    another dtype (an integer count, a bool) takes the newest report. Frozen parameters keep
    the values they were seeded with."""

    def __init__(self, layout: StateLayout, values: list[np.ndarray] | None = None) -> None:
        self.layout = layout
        self.values = values
        self._reports: OrderedDict[int, list[np.ndarray]] = OrderedDict()  # learner id -> its buffers, newest last

    @property
    def seeded(self) -> bool:
        return self.values is not None

    def seed(self, arrays: Sequence[np.ndarray]) -> None:
        """The run's first values: every tensor's, in layout order (copied)."""
        self.layout.check_arrays(self.layout.tensors, arrays)
        self.values = [np.array(a, copy=True) for a in arrays]

    def report(self, learner_id: int, buffers: Sequence[np.ndarray], peak: int) -> None:
        """A learner's buffers, in layout order (copied), combined into the run's values."""
        kept = self.layout.buffers()
        self.layout.check_arrays(kept, buffers)
        assert self.values is not None, "buffers are reported once the state is seeded"
        self._reports.pop(learner_id, None)
        self._reports[learner_id] = [np.array(a, copy=True) for a in buffers]
        while len(self._reports) > max(1, peak):
            self._reports.popitem(last=False)
        newest = buffers
        by_id = [self._reports[i] for i in sorted(self._reports)]
        index = {t.name: i for i, t in enumerate(self.layout.tensors)}
        for k, t in enumerate(kept):
            if np.dtype(t.dtype).kind == "f":
                total = np.zeros(t.shape, np.float64)
                for values in by_id:
                    total += values[k]
                combined = (total / len(by_id)).astype(t.dtype)
            else:
                combined = np.array(newest[k], copy=True)
            self.values[index[t.name]] = combined

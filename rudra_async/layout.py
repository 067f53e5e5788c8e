"""Parameter layout: named tensors packed end to end into one flat float32 buffer.

Parameters are addressed by (shard, offset); rudra-async runs one shard today, and the
layout is what a sharded server will split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .errors import RequestError


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    tensors: tuple[Tensor, ...]
    dtype: str = "<f4"
    shard: int = 0

    @classmethod
    def from_shapes(cls, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> "Layout":
        tensors, off = [], 0
        for name, shape in named_shapes:
            t = Tensor(str(name), tuple(int(d) for d in shape), off)
            tensors.append(t)
            off += t.size
        return cls(tuple(tensors))

    @property
    def size(self) -> int:
        return sum(t.size for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def to_wire(self) -> list[list[Any]]:
        return [[t.name, list(t.shape)] for t in self.tensors]

    @classmethod
    def from_wire(cls, raw: Any) -> "Layout":
        """Parse ``[[name, shape], ...]``; raises :class:`RequestError` (``bad_layout``)."""
        if not isinstance(raw, list) or not raw:
            raise RequestError("layout must be a non-empty list of [name, shape]", code="bad_layout")
        items = []
        for item in raw:
            ok = (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and isinstance(item[1], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1])
            )
            if not ok:
                raise RequestError(f"bad layout entry {item!r}; expected [name, shape]", code="bad_layout")
            items.append((item[0], tuple(item[1])))
        return cls.from_shapes(items)

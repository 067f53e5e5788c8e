"""Parameter layout: named tensors packed end to end into one flat float32 buffer, and its
split into shards.

A server group of S shards splits the flat buffer into S contiguous ranges whose lengths
differ by at most one (:meth:`Shard.range`); shard i holds the i-th. Ranges ignore tensor
boundaries, so shards stay balanced whatever the model's largest tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, RequestError, quoted

__all__ = [
    "Layout",
    "Shard",
    "Tensor",
]


MAX_TENSOR_DIMS = 32  # dimensions of a tensor, and of a wire segment (numpy 1.x's limit; numpy 2 allows 64)
MAX_NAME = 1024  # characters of a tensor's name (PyTorch's are dotted paths: tens of characters)


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
    def from_shapes(cls, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> Layout:
        tensors, off = [], 0
        for name, shape in named_shapes:
            t = Tensor(str(name), tuple(int(d) for d in shape), off)
            tensors.append(t)
            off += t.size
        return cls(tuple(tensors))

    @functools.cached_property
    def size(self) -> int:  # cached: read on every push (a frozen dataclass still has a __dict__)
        return sum(t.size for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def to_wire(self) -> list[list[Any]]:
        return [[t.name, list(t.shape)] for t in self.tensors]

    @classmethod
    def from_wire(cls, raw: Any) -> Layout:
        """Parse ``[[name, shape], ...]``; raises :class:`RequestError` (``bad_layout``)."""
        if not isinstance(raw, list) or not raw:
            raise RequestError("layout must be a non-empty list of [name, shape]", code="bad_layout")
        items = []
        for item in raw:
            ok = (
                isinstance(item, list)
                and len(item) == 2
                and isinstance(item[0], str)
                and len(item[0]) <= MAX_NAME
                and isinstance(item[1], list)
                and len(item[1]) <= MAX_TENSOR_DIMS
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1])
            )
            if not ok:
                raise RequestError(
                    f"bad layout entry {quoted(item)}; expected [name, shape], a name of at most {MAX_NAME} "
                    f"characters and at most {MAX_TENSOR_DIMS} sizes >= 0",
                    code="bad_layout",
                )
            items.append((item[0], tuple(item[1])))
        return cls.from_shapes(items)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based); ``Shard()`` is the whole model."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.index, int) and isinstance(self.count, int) and 0 <= self.index < self.count):
            raise ConfigError(f"shard must be I/N with 0 <= I < N, got {self.index}/{self.count}")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"I/N"``, e.g. ``"0/4"``."""
        index, _, count = text.partition("/")
        try:
            return cls(int(index), int(count))
        except ValueError:
            raise ConfigError(f"shard must be I/N, e.g. 0/4; got {text!r}") from None

    def to_wire(self) -> list[int]:
        return [self.index, self.count]

    @classmethod
    def from_wire(cls, raw: Any) -> Shard:
        """``[index, count]``, or None for the whole model; raises :class:`RequestError`."""
        if raw is None:
            return cls()
        try:
            index, count = raw
            return cls(index, count)
        except (TypeError, ValueError, ConfigError):
            raise RequestError(
                f"shard must be [index, count] with 0 <= index < count, got {quoted(raw)}", code="bad_request"
            ) from None

    def range(self, size: int) -> tuple[int, int]:
        """The [lo, hi) range of a flat buffer of ``size`` values that this shard holds."""
        if self.count > size:
            raise ConfigError(f"cannot split {size} parameters into {self.count} shards")
        q, r = divmod(size, self.count)
        lo = self.index * q + min(self.index, r)
        return lo, lo + q + (self.index < r)

    def layout(self, full: Layout) -> Layout:
        """The layout of this shard's slice: one flat tensor named after the range."""
        lo, hi = self.range(full.size)
        if self.count == 1:
            return full
        return Layout((Tensor(f"shard {self}: [{lo}:{hi}]", (hi - lo,), 0),), full.dtype, self.index)

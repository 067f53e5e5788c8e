"""The server's state: flat weights, momentum and the clock, with torn-free publication.

Readers (a pull reply being written to a socket) *lease* the current weights buffer. An
update writes in place when nobody holds a lease, otherwise into a spare buffer that is
then published, so a reader never sees a half-applied update and no copy is made on the
common path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..kernels import Steps, Updater, make_updater
from ..layout import Layout


class WeightStore:
    """``kernel`` names the update backend (see :func:`rudra_async.kernels.resolve`)."""

    def __init__(
        self,
        layout: Layout,
        initial: np.ndarray,
        kernel: str = "numpy",
        allocate: Callable[[int], np.ndarray] | None = None,
        free: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        """``allocate(nbytes)``/``free(buffer)`` provide the published buffers (e.g. shared
        memory a transport can send without copying); plain memory by default."""
        if initial.size != layout.size:
            raise ValueError(f"initial weights have {initial.size} values, layout needs {layout.size}")
        self.layout = layout
        self.clock = 0
        self._allocate = allocate or (lambda nbytes: np.empty(nbytes, np.uint8))
        self._free = free
        self._buffers: list[np.ndarray] = []
        self._current: np.ndarray = self._new_buffer()
        self._current[:] = np.asarray(initial, np.float32).reshape(-1)
        self.updater: Updater = make_updater(kernel, layout.size)
        self._leases: dict[int, int] = {}  # id(buffer) -> readers
        self._spares: list[np.ndarray] = []

    @property
    def weights(self) -> np.ndarray:
        """The published weights (read-only view; valid until the next update)."""
        view: np.ndarray = self._current.view()
        view.flags.writeable = False
        return view

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[int, np.ndarray]]:
        """Hold the current (clock, weights) unchanged for the duration of the block."""
        buf, key = self._current, id(self._current)
        self._leases[key] = self._leases.get(key, 0) + 1
        try:
            yield self.clock, buf
        finally:
            self._leases[key] -= 1
            if not self._leases[key]:
                del self._leases[key]
                if buf is not self._current:
                    self._spares.append(buf)

    def apply(self, grads: Sequence[np.ndarray], scales: Sequence[float], steps: Steps, *, check: bool = False) -> bool:
        """Fold the gradients into the weights and advance the clock.

        With ``check``, the new weights are computed into a spare buffer and the momentum is
        saved first; if any new weight or momentum value is not finite, both stay as they
        were (the clock still advances) and False is returned."""
        src = self._current
        if not check:
            dst = src if id(src) not in self._leases else self._spare()
            self.updater.apply(src, dst, grads, scales, steps)
            self._current = dst
            self.clock += 1
            return True
        saved = self.updater.momentum
        dst = self._spare()
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is what the check is for
            self.updater.apply(src, dst, grads, scales, steps)
        self.clock += 1
        if np.isfinite(dst).all() and np.isfinite(self.updater.momentum).all():
            self._current = dst
            if id(src) not in self._leases:
                self._spares.append(src)
            return True
        self.updater.load_momentum(saved)
        self._spares.append(dst)
        return False

    def _spare(self) -> np.ndarray:
        return self._spares.pop() if self._spares else self._new_buffer()

    def _new_buffer(self) -> np.ndarray:
        buf = self._allocate(4 * self.layout.size).view(np.float32)
        self._buffers.append(buf)
        return buf

    def close(self) -> None:
        """Give the buffers back to their allocator (views stay readable). Idempotent."""
        if self._free is not None:
            for buf in self._buffers:
                self._free(buf)
        self._buffers.clear()

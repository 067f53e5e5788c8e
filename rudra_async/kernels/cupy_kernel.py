"""The CuPy (CUDA) backend: weights and momentum live on the GPU; one RawKernel
(:mod:`.cuda_source`) folds the c scaled gradients, weight decay and momentum in a single
pass, in place on the device copies.

Gradients arrive in host memory; each is staged through a reused pinned buffer and copied
to its own device buffer on its own stream, so the copy of gradient k+1 overlaps the copy
of gradient k, and the kernel starts when all have landed. The new weights are copied
back into the host buffer the server publishes for pulls; the device copy is reloaded
from ``w`` whenever ``w`` is not the buffer the previous ``apply`` wrote.

Only imported when :func:`rudra_async.kernels.resolve` saw ``cupy.is_available()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from . import Group, Steps, Updater, as_groups, check_batch, check_momentum
from .cuda_source import KERNEL_SOURCES, kernel_name

_THREADS = 256


class CupyUpdater(Updater):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._w = cp.empty(size, cp.float32)  # master weights
        self._synced_with = 0  # address of the host buffer the last apply wrote (= self._w)
        self._v = cp.zeros(size, cp.float32)
        self._grads: list[cp.ndarray] = []  # device buffers, one per gradient slot, reused
        self._pinned: list[np.ndarray] = []  # pinned host staging, one per slot, reused
        self._streams: list[cp.cuda.Stream] = []
        self._kernels = {dt: cp.RawKernel(src, kernel_name(dt)) for dt, src in KERNEL_SOURCES.items()}
        self._pointers: dict[tuple[int, int, int], cp.ndarray] = {}  # (c, lo, itemsize) -> gradient pointers at lo
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._blocks = min(sms * 8, (size + _THREADS - 1) // _THREADS) or 1  # grid-stride: a few waves suffice

    def _slots(self, c: int) -> None:
        while len(self._grads) < c:
            self._grads.append(cp.empty(self.size, cp.float32))  # float32-sized: fits float16 too
            mem = cp.cuda.alloc_pinned_memory(self.size * 4)
            self._pinned.append(np.frombuffer(mem, np.float32, self.size))
            self._streams.append(cp.cuda.Stream(non_blocking=True))

    def apply(
        self,
        w: np.ndarray,
        w_out: np.ndarray,
        grads: Sequence[np.ndarray],
        scales: Sequence[float],
        steps: Steps,
        span: tuple[int, int] | None = None,
    ) -> None:
        if span is not None:
            raise ValueError("the CuPy backend updates the whole vector at once (span must be None)")
        check_batch(grads, scales, self.size)
        dtype = grads[0].dtype
        if any(g.dtype != dtype for g in grads):
            grads = [g.astype(np.float32) for g in grads]
            dtype = np.dtype(np.float32)
        if w.ctypes.data != self._synced_with:  # the host weights are not the ones the device holds
            self._w.set(w)
        self._slots(len(grads))
        kernel_done = cp.cuda.get_current_stream().record()  # a fold still reading the slots
        for k, g in enumerate(grads):
            self._streams[k].wait_event(kernel_done)
            staging = self._pinned[k].view(np.uint8)[: g.nbytes]
            staging[:] = np.ascontiguousarray(g).view(np.uint8).reshape(-1)
            dev = self._grads[k].view(cp.uint8)[: g.nbytes]
            dev.set(staging, stream=self._streams[k])
        for s in self._streams[: len(grads)]:
            s.synchronize()
        for group in as_groups(steps, self.size):
            self.fold(len(grads), dtype, scales, group)
        self._w.get(out=w_out)
        self._synced_with = w_out.ctypes.data

    def fold(
        self,
        c: int,
        dtype: np.dtype[Any],
        scales: Sequence[float],
        group: Group,
    ) -> None:
        """The device-only part: one kernel over one group of the first ``c`` device gradient
        buffers (the gradient pointers offset to the group's first value)."""
        sgd, lo, n = group.sgd, group.lo, group.hi - group.lo
        if n == 0:
            return
        key = (c, lo, np.dtype(dtype).itemsize)
        if key not in self._pointers:
            starts = [g.data.ptr + lo * key[2] for g in self._grads[:c]]
            self._pointers[key] = cp.asarray(np.array(starts, np.uint64))
        scale_arr = cp.asarray(np.asarray(scales, np.float32))
        blocks = min(self._blocks, (n + _THREADS - 1) // _THREADS)
        self._kernels[np.dtype(dtype)](
            (blocks,),
            (_THREADS,),
            (
                self._w[lo : group.hi],
                self._v[lo : group.hi],
                self._pointers[key],
                scale_arr,
                np.int32(c),
                np.float32(sgd.lr),
                np.float32(sgd.momentum),
                np.float32(sgd.weight_decay),
                np.int32(bool(sgd.nesterov)),
                np.int64(n),
            ),
        )

    @property
    def momentum(self) -> np.ndarray:
        host: np.ndarray = cp.asnumpy(self._v)
        return host

    def load_momentum(self, v: np.ndarray) -> None:
        check_momentum(v, self.size)
        self._v.set(v)

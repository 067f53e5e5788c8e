"""The CuPy (CUDA) backend: weights and momentum live on the GPU; one RawKernel
(:mod:`.cuda_source`) folds the c scaled gradients, weight decay and momentum in a single
pass, in place on the device copies.

Gradients arrive in host memory; each is staged through a reused pinned buffer and copied
to its own device buffer on its own stream, so the copy of gradient k+1 overlaps the copy
of gradient k, and the kernel starts when all have landed. The new weights are copied
back into the host buffer the server publishes for pulls; the device copy is reloaded
from ``w`` whenever ``w`` is not the array object the previous ``apply`` wrote.

The kernels are compiled without multiply-add contraction (``--fmad=false``), so each
product and sum rounds on its own, in the order of the numpy reference: the two backends
agree bit for bit. The kernel is memory-bound, so this costs no time.

Only imported when :func:`rudra_async.kernels.resolve` saw ``cupy.is_available()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import cupy as cp
import numpy as np

from .base import Group, Steps, Updater, as_groups, check_batch, check_momentum
from .cuda_source import KERNEL_SOURCES, kernel_name

_THREADS = 256
#: NVRTC options of the kernels: no fused multiply-add (one rounding per operation, as numpy)
OPTIONS = ("--fmad=false",)
_compiled: dict[np.dtype[Any], Any] = {}  # gradient dtype -> RawKernel, compiled


def compiled_kernels() -> dict[np.dtype[Any], Any]:
    """The kernel variants (gradient dtype → ``cupy.RawKernel``), all compiled for the
    current device by the first call. CuPy would compile each at its first launch, i.e. in
    the first update; :func:`rudra_async.kernels.resolve` calls this instead, so a host
    where they cannot compile (no NVRTC, a driver too old) is found out when the backend is
    chosen. Raises what compiling raises."""
    if not _compiled:
        kernels = {dt: cp.RawKernel(src, kernel_name(dt), options=OPTIONS) for dt, src in KERNEL_SOURCES.items()}
        for kernel in kernels.values():
            kernel.compile()
        _compiled.update(kernels)
    return _compiled


class CupyUpdater(Updater):
    """Holds the master weights and the momentum on the device.

    Every copy and kernel runs on the updater's own stream (whatever the calling thread's
    current stream is: the server creates the updater and reads or loads the momentum on
    its event loop's thread, and applies updates on its update thread); ``apply``,
    ``momentum`` and ``load_momentum`` return once that stream has finished their work.

    ``apply`` trusts its device weights only when ``w`` *is* (the same Python object as)
    the ``w_out`` of the previous ``apply``; otherwise it loads ``w`` first. So the caller
    must not change that array's values between the two calls (another array object, even
    one over the same memory, is always loaded).
    """

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._kernels = compiled_kernels()
        self._stream = cp.cuda.Stream(non_blocking=False)  # every copy and kernel of this updater
        self._pointers: dict[tuple[int, int, int], cp.ndarray] = {}  # (c, lo, itemsize) -> gradient pointers at lo
        self._grads: list[cp.ndarray] = []  # device buffers, one per gradient slot, reused
        self._pinned: list[np.ndarray] = []  # pinned host staging, one per slot, reused
        self._streams: list[cp.cuda.Stream] = []  # one per slot, for its copy
        self._last_out: np.ndarray | None = None  # the w_out of the last apply, whose values self._w holds
        with self._stream:
            self._w = cp.empty(size, cp.float32)  # master weights
            self._v = cp.zeros(size, cp.float32)
        self._stream.synchronize()
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._blocks = min(sms * 8, (size + _THREADS - 1) // _THREADS) or 1  # grid-stride: a few waves suffice

    def _slots(self, c: int) -> None:
        while len(self._grads) < c:
            with self._stream:
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
        last_out, self._last_out = self._last_out, None  # until this apply completes, self._w is no host array's
        self._slots(len(grads))
        with self._stream:
            if w is not last_out:  # the device does not hold these weights
                self._w.set(w)
            slots_free = self._stream.record()  # after the previous fold, which read the slots
            for k, g in enumerate(grads):
                self._streams[k].wait_event(slots_free)
                staging = self._pinned[k].view(np.uint8)[: g.nbytes]
                staging[:] = np.ascontiguousarray(g).view(np.uint8).reshape(-1)
                dev = self._grads[k].view(cp.uint8)[: g.nbytes]
                dev.set(staging, stream=self._streams[k])
            for s in self._streams[: len(grads)]:
                s.synchronize()  # the staging buffers are free again; the fold below reads the slots
            for group in as_groups(steps, self.size):
                self.fold(len(grads), dtype, scales, group)
            self._w.get(stream=self._stream, out=w_out)
        self._stream.synchronize()
        self._last_out = w_out

    def fold(
        self,
        c: int,
        dtype: np.dtype[Any],
        scales: Sequence[float],
        group: Group,
    ) -> None:
        """The device-only part: one kernel over one group of the first ``c`` device gradient
        buffers (the gradient pointers offset to the group's first value), queued on the
        updater's stream (it does not wait for the kernel)."""
        sgd, lo, n = group.sgd, group.lo, group.hi - group.lo
        if n == 0:
            return
        with self._stream:
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
        host: np.ndarray = self._v.get(stream=self._stream)
        self._stream.synchronize()
        return host

    def load_momentum(self, v: np.ndarray) -> None:
        check_momentum(v, self.size)
        self._v.set(v, stream=self._stream)
        self._stream.synchronize()

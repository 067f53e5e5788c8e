"""The CuPy (CUDA) backend: weights and momentum live on the GPU; one RawKernel folds the
c scaled gradients, weight decay and momentum in a single pass.

Gradients arrive in host memory; each is staged through a reused pinned buffer and copied
to its own device buffer on its own stream, so the copy of gradient k+1 overlaps the copy
of gradient k, and the kernel starts when all have landed. The new weights are copied
back into the host buffer the server publishes for pulls.

Only imported when :func:`rudra_async.kernels.resolve` saw ``cupy.is_available()``.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from . import Updater, check_batch

_SOURCE = r"""
#include <cuda_fp16.h>
extern "C" __global__ void sgd_fold_%(name)s(
    const float* __restrict__ w, float* __restrict__ w_out, float* __restrict__ v,
    const unsigned long long* __restrict__ grads, const float* __restrict__ scales, const int c,
    const float lr, const float momentum, const float weight_decay, const int nesterov,
    const long long n)
{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        float d = 0.0f;
        for (int k = 0; k < c; ++k) {
            const %(gtype)s* g = reinterpret_cast<const %(gtype)s*>(grads[k]);
            d += scales[k] * %(load)s;
        }
        const float wi = w[i];
        d += weight_decay * wi;
        float step = d;
        if (momentum != 0.0f) {
            const float vi = momentum * v[i] + d;
            v[i] = vi;
            step = nesterov ? d + momentum * vi : vi;
        }
        w_out[i] = wi - lr * step;
    }
}
"""
_VARIANTS = {
    np.dtype(np.float32): ("f32", "float", "g[i]"),
    np.dtype(np.float16): ("f16", "__half", "__half2float(g[i])"),
}
KERNEL_SOURCES = {dt: _SOURCE % {"name": n, "gtype": t, "load": ld} for dt, (n, t, ld) in _VARIANTS.items()}
_THREADS = 256


class CupyUpdater(Updater):
    name = "cupy"

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._w = cp.empty(size, cp.float32)  # master weights, loaded from the host on first use
        self._loaded = False
        self._v = cp.zeros(size, cp.float32)
        self._grads: list[cp.ndarray] = []  # device buffers, one per gradient slot, reused
        self._pinned: list[np.ndarray] = []  # pinned host staging, one per slot, reused
        self._streams: list[cp.cuda.Stream] = []
        self._kernels = {dt: cp.RawKernel(src, f"sgd_fold_{_VARIANTS[dt][0]}") for dt, src in KERNEL_SOURCES.items()}
        device = cp.cuda.Device()
        self._blocks = device.attributes["MultiProcessorCount"] * 8

    def _slots(self, c: int) -> None:
        while len(self._grads) < c:
            self._grads.append(cp.empty(self.size, cp.float32))  # float32-sized: fits float16 too
            mem = cp.cuda.alloc_pinned_memory(self.size * 4)
            self._pinned.append(np.frombuffer(mem, np.float32, self.size))
            self._streams.append(cp.cuda.Stream(non_blocking=True))

    def apply(self, w, w_out, grads, scales, lr, momentum=0.0, weight_decay=0.0, nesterov=False) -> None:
        check_batch(grads, scales, self.size)
        dtype = grads[0].dtype
        if any(g.dtype != dtype for g in grads):
            grads = [g.astype(np.float32) for g in grads]
            dtype = np.dtype(np.float32)
        if not self._loaded:
            self._w.set(w)
            self._loaded = True
        self._slots(len(grads))
        for k, g in enumerate(grads):
            staging = self._pinned[k].view(np.uint8)[: g.nbytes]
            staging[:] = g.view(np.uint8).reshape(-1)
            dev = self._grads[k].view(cp.uint8)[: g.nbytes]
            dev.set(staging, stream=self._streams[k])
        for s in self._streams[: len(grads)]:
            s.synchronize()
        self.fold(len(grads), dtype, scales, lr, momentum, weight_decay, nesterov)
        self._w.get(out=w_out)

    def fold(self, c: int, dtype: np.dtype, scales, lr, momentum, weight_decay, nesterov) -> None:
        """The device-only part: one kernel over the first ``c`` device gradient buffers."""
        ptr_arr = cp.asarray(np.array([g.data.ptr for g in self._grads[:c]], np.uint64))
        scale_arr = cp.asarray(np.asarray(scales, np.float32))
        blocks = min(self._blocks, (self.size + _THREADS - 1) // _THREADS) or 1
        self._kernels[np.dtype(dtype)](
            (blocks,), (_THREADS,),
            (self._w, self._w, self._v, ptr_arr, scale_arr, np.int32(c), np.float32(lr),
             np.float32(momentum), np.float32(weight_decay), np.int32(bool(nesterov)), np.int64(self.size)),
        )

    @property
    def momentum(self) -> np.ndarray:
        return cp.asnumpy(self._v)

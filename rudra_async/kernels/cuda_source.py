"""The CUDA C source of the fused update kernel (no cupy import, so it can be compiled and
checked on machines without a GPU: ``tests/core/test_cuda_source.py``).

One thread per element in a grid-stride loop, in place on the master weights ``w`` and the
momentum ``v``::

    d = Σ_k scales[k] · g_k[i] + weight_decay · w[i]                           (the decay if not 0)
    v[i] = momentum · v[i] + d;  step = nesterov ? d + momentum · v[i] : v[i]   (if momentum)
    w[i] -= lr · step

each product and sum one float32 operation in the numpy reference's order (CuPy compiles it
with ``--fmad=false``: see ``cupy_kernel.OPTIONS``), so the two agree bit for bit, signed
zeros included (NaN payloads aside).

``grads`` is an array of ``c`` device pointers; each gradient is float32 or float16 (one
kernel variant per dtype; float16 is widened before the multiply, by one PTX ``cvt``, so
the source needs no CUDA headers: CuPy's wheels compile it with NVRTC alone).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_TEMPLATE = r"""
#ifndef RUDRA_HOST_EMULATION
// float16 -> float32 in PTX: no cuda_fp16.h, which CuPy wheels do not ship (NVRTC would need a toolkit's headers)
__device__ __forceinline__ float rudra_h2f(const unsigned short h) {
    float f;
    asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"(h));
    return f;
}
#endif
extern "C" __global__ void sgd_fold_%(name)s(
    float* __restrict__ w, float* __restrict__ v,
    const unsigned long long* __restrict__ grads, const float* __restrict__ scales, const int c,
    const float lr, const float momentum, const float weight_decay, const int nesterov,
    const long long n)
{
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        float d = 0.0f;
        for (int k = 0; k < c; ++k) {
            const %(gtype)s* g = reinterpret_cast<const %(gtype)s*>(grads[k]);
            const float term = scales[k] * %(load)s;
            d = k == 0 ? term : d + term;  // not 0 + term: that turns a -0 into +0
        }
        const float wi = w[i];
        if (weight_decay != 0.0f) {
            d += weight_decay * wi;
        }
        float step = d;
        if (momentum != 0.0f) {
            const float vi = momentum * v[i] + d;
            v[i] = vi;
            step = nesterov ? d + momentum * vi : vi;
        }
        w[i] = wi - lr * step;
    }
}
"""

#: gradient dtype -> (kernel name suffix, CUDA element type, element load expression)
VARIANTS: dict[np.dtype[Any], tuple[str, str, str]] = {
    np.dtype(np.float32): ("f32", "float", "g[i]"),
    np.dtype(np.float16): ("f16", "unsigned short", "rudra_h2f(g[i])"),  # raw float16 bits
}


def kernel_name(dtype: np.dtype[Any]) -> str:
    return f"sgd_fold_{VARIANTS[np.dtype(dtype)][0]}"


#: gradient dtype -> complete CUDA source of its kernel variant
KERNEL_SOURCES = {dt: _TEMPLATE % {"name": n, "gtype": t, "load": ld} for dt, (n, t, ld) in VARIANTS.items()}

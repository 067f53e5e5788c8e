"""The CUDA kernel source, checked without a GPU.

1. Host emulation: the exact source CuPy compiles is built by the C++ compiler behind a
   small shim (``__global__`` → nothing, ``blockIdx``/``threadIdx`` → globals, the PTX
   float16 conversion → ``_Float16``) and launched over a small grid, one emulated thread after another. Threads
   of this kernel touch disjoint elements, so any order is a valid schedule; the result
   must equal ``torch.optim.SGD``. This checks the arithmetic and the grid-stride coverage,
   not CuPy's launch or copies (the ``gpu`` tests in test_kernels.py do that on a device).
2. ``nvcc`` compiles every variant to PTX for a current architecture, where nvcc exists.
"""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from helpers import random_batches, sgd_reference

from rudra_async.kernels import SGD, Group, make_updater
from rudra_async.kernels.cuda_source import KERNEL_SOURCES, kernel_name

SHIM = r"""
#include <cstdint>
#include <cstring>
#define RUDRA_HOST_EMULATION
struct rudra_dim3 { unsigned x; };
static rudra_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
static inline float rudra_h2f(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
"""
LAUNCHER = r"""
extern "C" void launch(unsigned grid, unsigned block, float* w, float* v, const unsigned long long* grads,
                       const float* scales, int c, float lr, float momentum, float weight_decay, int nesterov,
                       long long n) {
    gridDim.x = grid; blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < block; ++t) {
            blockIdx.x = b; threadIdx.x = t;
            %(kernel)s(w, v, grads, scales, c, lr, momentum, weight_decay, nesterov, n);
        }
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """dtype -> the kernel variant built for the host, as a ctypes function."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the host emulation")
    root = tmp_path_factory.mktemp("cuda_emulation")
    built = {}
    for dtype, source in KERNEL_SOURCES.items():
        src, lib = root / f"{kernel_name(dtype)}.cpp", root / f"{kernel_name(dtype)}.so"
        src.write_text(SHIM + source + LAUNCHER % {"kernel": kernel_name(dtype)})
        # no contraction into fused multiply-adds: CuPy compiles the kernel with --fmad=false
        subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
        fn = ctypes.CDLL(str(lib)).launch
        fn.restype = None
        fn.argtypes = [
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_float,
            ctypes.c_float,
            ctypes.c_float,
            ctypes.c_int,
            ctypes.c_longlong,
        ]
        built[dtype] = fn
    return built


def launch(fn, w, v, grads, scales, lr, momentum, weight_decay, nesterov, grid=3, block=32):
    pointers = np.array([g.ctypes.data for g in grads], np.uint64)
    scales = np.asarray(scales, np.float32)
    fn(
        grid,
        block,
        w.ctypes.data,
        v.ctypes.data,
        pointers.ctypes.data,
        scales.ctypes.data,
        len(grads),
        lr,
        momentum,
        weight_decay,
        int(nesterov),
        w.size,
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 1e-3, False), (0.9, 0.01, True)])
@pytest.mark.parametrize("c", [1, 3])
def test_kernel_source_matches_torch_sgd(emulated, dtype, momentum, weight_decay, nesterov, c):
    size = 1001  # not a multiple of the 96 emulated threads: the grid-stride loop must cover the tail
    w = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    v = np.zeros(size, np.float32)
    batches = list(random_batches(size, 10, c, dtype=dtype))
    tol = 1e-5 if dtype == np.float32 else 1e-4
    for expected, (grads, scales) in zip(sgd_reference(w, batches, 0.05, momentum, weight_decay, nesterov), batches):
        launch(emulated[np.dtype(dtype)], w, v, grads, scales, 0.05, momentum, weight_decay, nesterov)
        np.testing.assert_allclose(w, expected, rtol=tol, atol=tol)


def test_every_element_is_updated_exactly_once(emulated):
    """Gradient 1, momentum 0.5, lr 1 from w = v = 0: one visit gives v = 1, w = −1; a second would
    give v = 1.5, w = −2.5, and a missed element stays 0 (a grid of 91 threads over 1,000 values)."""
    size = 1000
    w, v = np.zeros(size, np.float32), np.zeros(size, np.float32)
    launch(
        emulated[np.dtype(np.float32)], w, v, [np.ones(size, np.float32)], [1.0], 1.0, 0.5, 0.0, False, grid=7, block=13
    )
    np.testing.assert_array_equal(v, np.ones(size, np.float32))
    np.testing.assert_array_equal(w, -np.ones(size, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("c", [1, 3])
def test_kernel_source_equals_the_numpy_reference_bit_for_bit(emulated, dtype, c):
    """Each product and sum one float32 operation in the numpy reference's order: the same
    bits, signed zeros included (a first term is not added to +0, which turns −0 into +0; a
    weight decay of 0 is left out, not added as 0 · w), over groups with their own settings."""
    size = 1001
    rng = np.random.default_rng(5)
    w = rng.standard_normal(size).astype(np.float32)
    v = rng.standard_normal(size).astype(np.float32)
    w[:24], v[:24] = np.tile([0.0, -0.0, 1.0], 8), np.tile([-0.0, 0.0, -0.0, -1.0], 6)
    groups = [Group(0, 300, SGD(0.05, 0.9, 1e-3, True)), Group(300, 301, SGD(0.5)), Group(301, size, SGD(0.01, 0.9))]
    reference = make_updater("numpy", size)
    reference.load_momentum(v)
    w_ref = w.copy()
    for grads, scales in random_batches(size, 4, c, dtype=dtype):
        for g in grads:
            g[:24] = np.tile([-0.0, 0.0, -0.0, 2.0, -0.0, -0.0], 4)
        reference.apply(w_ref, w_ref, grads, scales, groups)
        for group in groups:
            part = slice(group.lo, group.hi)
            sgd = group.sgd
            launch(
                emulated[np.dtype(dtype)],
                w[part],
                v[part],
                [g[part] for g in grads],
                scales,
                sgd.lr,
                sgd.momentum,
                sgd.weight_decay,
                sgd.nesterov,
            )
        assert w.tobytes() == w_ref.tobytes()
        assert v.tobytes() == reference.momentum.tobytes()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nvcc_compiles_the_kernel(tmp_path, dtype):
    src = tmp_path / "kernel.cu"
    src.write_text(KERNEL_SOURCES[np.dtype(dtype)])
    out = tmp_path / "kernel.ptx"
    subprocess.run(["nvcc", "--ptx", "-arch=compute_90", "-o", str(out), str(src)], check=True, timeout=120)
    assert f".entry {kernel_name(dtype)}" in out.read_text()

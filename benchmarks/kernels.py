"""Update-kernel throughput on the CPU (and, with --gpu, on a CUDA device).

CPU: parameters/s for 1M and 25M parameters with c = 1 and c = 8 gradients per update, for
the numpy and torch backends, next to torch.optim.SGD(fused=True) on the same data in the
same run: one optimizer step for c = 1, c separate steps for c = 8 (what a server without a
fused multi-gradient kernel would do).

Gradient check: the max |g| every push is measured with (``Updater.max_abs``), per backend,
at 1M and 25M values, next to one ``np.maximum.reduce`` pass over the same arrays (the
cost of reading one once) in the same run; each call reads the next of four arrays.

Block size (``--blocks``): the numpy kernel's time for one update of 25M values (c = 1,
momentum) with ``numpy_kernel.BLOCK`` set to each of 64Ki … 512Ki values, on one thread and
split in two halves over two threads (as the server's part threads split it), medians;
what ``BLOCK`` is chosen by.

GPU (--gpu): the CuPy kernel's achieved memory bandwidth (bytes it must read and write per
update / time) as a fraction of the device's copy bandwidth measured in the same run.

    python benchmarks/kernels.py [--reps 7] [--blocks] [--gpu]
"""

from __future__ import annotations

import argparse
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from timing import median_time  # benchmarks/timing.py (the script's directory is on sys.path)

from rudra_async.kernels import SGD, Group, cupy_device_available, make_updater, numpy_kernel

#: gradients the check reads in turn, as a server reads each pushed gradient once: on some
#: hosts a reduction over one 100 MB array read again and again times very differently
#: (torch.aminmax ~12 ms there, ~7 ms over arrays read in turn)
CHECK_ARRAYS = 4


def cpu(reps: int) -> None:
    print(
        f"CPU update kernels (torch threads: {torch.get_num_threads()}), median of {reps}; Gparam/s, ratio vs SGD(fused)"
    )
    for n in (1_000_000, 25_000_000):
        rng = np.random.default_rng(0)
        w = rng.standard_normal(n).astype(np.float32)
        for c in (1, 8):
            grads = [rng.standard_normal(n).astype(np.float32) for _ in range(c)]
            scales = [1.0 / c] * c
            p = torch.nn.Parameter(torch.from_numpy(w.copy()))
            opt = torch.optim.SGD([p], lr=1e-4, momentum=0.9, weight_decay=1e-4, fused=True)
            tgrads = [torch.from_numpy(g) for g in grads]

            def baseline():
                for g in tgrads:  # c separate optimizer steps
                    p.grad = g
                    opt.step()

            base = median_time(baseline, reps)
            line = f"  n={n:>10,} c={c}:  SGD(fused) x{c} {n / base / 1e9:6.2f}"
            for backend in ("numpy", "torch"):
                up, ww = make_updater(backend, n), w.copy()
                t = median_time(lambda: up.apply(ww, ww, grads, scales, SGD(1e-4, 0.9, 1e-4)), reps)
                line += f"   {backend} {n / t / 1e9:6.2f} ({base / t:4.2f}x)"
            print(line)


def check(reps: int) -> None:
    torch.set_num_threads(1)  # as the server runs the torch kernel (--kernel-threads 1)
    print(
        f"gradient check (max |g|, torch threads: 1), median of {reps}, {CHECK_ARRAYS} arrays read in turn; "
        "ms, ratio vs one np.max pass"
    )
    for n in (1_000_000, 25_000_000):
        grads = [np.random.default_rng(i).standard_normal(n).astype(np.float32) for i in range(CHECK_ARRAYS)]
        turn = itertools.cycle(grads)
        base = median_time(lambda: np.maximum.reduce(next(turn)), reps)
        line = f"  n={n:>10,}:  np.max pass {base * 1e3:7.2f}"
        for backend in ("numpy", "torch"):
            up = make_updater(backend, n)
            t = median_time(lambda: up.max_abs(next(turn)), reps)
            line += f"   {backend} {t * 1e3:7.2f} ({base / t:4.2f}x)"
        print(line)


def blocks(reps: int) -> None:
    n = 25_000_000
    half = n // 2
    rng = np.random.default_rng(0)
    w, w_out, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    grads = itertools.cycle([rng.standard_normal(n).astype(np.float32) for _ in range(CHECK_ARRAYS)])
    sgd = SGD(1e-4, 0.9)
    pool = ThreadPoolExecutor(2)

    def one_thread() -> None:
        numpy_kernel.apply(w, w_out, v, [next(grads)], [1.0], sgd)

    def two_threads() -> None:
        g = next(grads)
        parts = [(0, half), (half, n)]
        done = [pool.submit(numpy_kernel.apply, w[a:b], w_out[a:b], v[a:b], [g[a:b]], [1.0], sgd) for a, b in parts]
        for f in done:
            f.result()

    chosen = numpy_kernel.BLOCK
    print(f"numpy kernel block size (BLOCK = {chosen:,} values), n = {n:,}, c = 1, median of {reps}; ms per update")
    try:
        for shift in range(16, 20):
            numpy_kernel.BLOCK = 1 << shift
            t1, t2 = median_time(one_thread, reps), median_time(two_threads, reps)
            print(f"  BLOCK = {1 << shift:>7,}:  1 thread {t1 * 1e3:6.1f}   2 threads {t2 * 1e3:6.1f}")
    finally:
        numpy_kernel.BLOCK = chosen
        pool.shutdown()


def gpu(reps: int) -> None:
    import cupy as cp

    n = 25_000_000
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"GPU: {name}, n = {n:,} float32, median of {reps}")
    a, b = cp.ones(n * 4, cp.float32), cp.empty(n * 4, cp.float32)

    def copy():
        b[...] = a
        cp.cuda.Device().synchronize()

    copy_bw = 2 * a.nbytes / median_time(copy, reps)
    print(f"  device copy bandwidth: {copy_bw / 1e9:8.1f} GB/s")
    host_w = np.zeros(n, np.float32)
    for c in (1, 8):
        up = make_updater("cupy", n)
        grads = [np.ones(n, np.float32) for _ in range(c)]
        up.apply(host_w, host_w, grads, [1.0 / c] * c, SGD(1e-4, 0.9, 1e-4))  # load weights, fill slots

        def fold():
            up.fold(c, np.dtype(np.float32), [1.0 / c] * c, Group(0, n, SGD(1e-4, 0.9, 1e-4)))
            cp.cuda.Device().synchronize()

        t = median_time(fold, reps)
        moved = (c + 4) * 4 * n  # read c gradients, w, v; write w, v
        print(
            f"  fused kernel c={c}: {t * 1e3:7.3f} ms  {moved / t / 1e9:8.1f} GB/s  = {moved / t / copy_bw:4.2f}x copy"
        )
        t_full = median_time(
            lambda: up.apply(host_w, host_w, grads, [1.0 / c] * c, SGD(1e-4, 0.9, 1e-4)), max(3, reps // 2)
        )
        print(f"  whole update c={c} incl. host<->device copies: {t_full * 1e3:7.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gpu", action="store_true", help="also (or only, with --no-cpu) the CuPy kernel")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--blocks", action="store_true", help="only the numpy kernel's block-size sweep")
    args = ap.parse_args()
    if args.blocks:
        blocks(args.reps)
        return
    if not args.no_cpu:
        cpu(args.reps)
        check(args.reps)
    if args.gpu:
        if not cupy_device_available():
            raise SystemExit("--gpu: no CUDA device visible to CuPy")
        gpu(args.reps)


if __name__ == "__main__":
    main()

"""Every update backend equals torch.optim.SGD, and the backends agree with each other."""

import importlib.util
import itertools
import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from helpers import random_batches, sgd_reference

from rudra_async import ConfigError, kernels
from rudra_async.kernels import SGD, Group, Updater, cupy_device_available, make_updater, preload, resolve
from rudra_async.kernels.numpy_kernel import BLOCK

gpu = pytest.mark.skipif(not cupy_device_available(), reason="needs CuPy with a CUDA device")
BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.torch), pytest.param("cupy", marks=[pytest.mark.gpu, gpu])]
HAS_TORCH = importlib.util.find_spec("torch") is not None
CPU_AUTO = "torch" if HAS_TORCH else "numpy"  # what auto picks without a usable GPU


@pytest.mark.torch  # the reference is torch.optim.SGD
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("momentum, weight_decay, nesterov", [(0.0, 0.0, False), (0.9, 1e-3, False), (0.9, 0.01, True)])
@pytest.mark.parametrize("c", [1, 3])
def test_backend_matches_torch_sgd(backend, momentum, weight_decay, nesterov, c):
    size = 2 * BLOCK + 17 if c == 1 else 1000
    w0 = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    batches = list(random_batches(size, 20, c))
    up: Updater = make_updater(backend, size)
    w = w0.copy()
    for step, (expected, (grads, scales)) in enumerate(
        zip(sgd_reference(w0, batches, 0.05, momentum, weight_decay, nesterov), batches)
    ):
        out = w if step % 2 else np.empty_like(w)  # in place and out of place
        up.apply(w, out, grads, scales, SGD(0.05, momentum, weight_decay, nesterov))
        w = out
        np.testing.assert_allclose(w, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.torch  # the reference is torch.optim.SGD
@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_gradients_accumulate_in_float32(backend):
    size = 4096
    w0 = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    batches = list(random_batches(size, 10, 2, dtype=np.float16))
    expected = list(sgd_reference(w0, batches, 0.1, 0.9, 1e-3, False))[-1]
    up = make_updater(backend, size)
    w = w0.copy()
    for grads, scales in batches:
        up.apply(w, w, grads, scales, SGD(0.1, 0.9, 1e-3))
    np.testing.assert_allclose(w, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu  # and without one, numpy and torch
def test_backends_agree_with_each_other():
    size = 100_003
    w0 = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    batches = list(random_batches(size, 15, 8))
    results = {}
    for backend in ["numpy"] + (["torch"] if HAS_TORCH else []) + (["cupy"] if cupy_device_available() else []):
        up, w = make_updater(backend, size), w0.copy()
        for grads, scales in batches:
            up.apply(w, w, grads, scales, SGD(0.02, 0.9, 1e-4, True))
        results[backend] = (w, up.momentum.copy())
    ref_w, ref_v = results.pop("numpy")
    for name, (w, v) in results.items():
        np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_momentum_snapshot_and_load_resume_the_same_run(backend):
    """What a checkpoint relies on: (weights, momentum snapshot) restored into a fresh updater
    continues exactly as the uninterrupted one."""
    size = 5000
    batches = list(random_batches(size, 12, 2))
    w = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    up = make_updater(backend, size)
    for grads, scales in batches[:6]:
        up.apply(w, w, grads, scales, SGD(0.05, 0.9, 1e-3, True))
    snapshot, w_saved = up.momentum, w.copy()
    up.apply(w, w, *batches[6], SGD(0.05, 0.9, 1e-3, True))
    assert not np.array_equal(up.momentum, snapshot), "the snapshot must not follow later updates"
    for grads, scales in batches[7:]:
        up.apply(w, w, grads, scales, SGD(0.05, 0.9, 1e-3, True))
    resumed = make_updater(backend, size)
    resumed.load_momentum(snapshot)
    for grads, scales in batches[6:]:
        resumed.apply(w_saved, w_saved, grads, scales, SGD(0.05, 0.9, 1e-3, True))
    np.testing.assert_array_equal(w_saved, w)
    np.testing.assert_array_equal(resumed.momentum, up.momentum)
    with pytest.raises(ValueError, match="momentum must be float32"):
        resumed.load_momentum(np.zeros(size, np.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_weights_are_read_from_the_buffer_given(backend):
    """An updater must not keep using its own copy (the GPU's) when handed other weights."""
    size = 3000
    (g1, s1), (g2, s2) = random_batches(size, 2, 1)
    up, numpy_up = make_updater(backend, size), make_updater("numpy", size)
    w = np.ones(size, np.float32)
    for u in (up, numpy_up):
        u.apply(w.copy(), np.empty_like(w), g1, s1, SGD(0.1, 0.9))
    other, expected = np.full(size, 5.0, np.float32), np.full(size, 5.0, np.float32)
    up.apply(other, other, g2, s2, SGD(0.1, 0.9))
    numpy_up.apply(expected, expected, g2, s2, SGD(0.1, 0.9))
    np.testing.assert_allclose(other, expected, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_array_over_the_memory_of_the_last_output_is_read(backend):
    """The CuPy backend keeps its device weights only for the very array object it wrote last:
    another array at that address (as a new buffer allocated where a freed one was) holds
    other weights, which must be read."""
    size = 3000
    (g1, s1), (g2, s2) = random_batches(size, 2, 1)
    results = []
    for u in (make_updater(backend, size), make_updater("numpy", size)):
        out = np.empty(size, np.float32)
        u.apply(np.ones(size, np.float32), out, g1, s1, SGD(0.1, 0.9))
        other = out.view()  # the same memory, another array...
        other[:] = 5.0  # ...with other weights
        u.apply(other, other, g2, s2, SGD(0.1, 0.9))
        results.append(other)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)


def test_a_cupy_install_that_does_not_import_means_no_device(tmp_path, monkeypatch, caplog):
    """A broken CuPy (its import raises: two CuPy wheels, a CUDA library missing) is no
    device: auto falls back to the CPU with a warning, an explicit cupy says why it cannot."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text('raise ImportError("CuPy is not correctly installed")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # imported already: import it again
    monkeypatch.setattr(kernels, "_cuda_driver_problem", lambda: None)  # as on a host with a driver
    with caplog.at_level(logging.WARNING, "rudra_async.kernels"):
        assert not cupy_device_available()
        assert resolve("auto", "auto") == CPU_AUTO
    assert "does not import" in caplog.text
    for kernel, device in (("cupy", "auto"), ("auto", "cuda")):
        with pytest.raises(ConfigError, match=r"CuPy does not import .*not correctly installed"):
            resolve(kernel, device)


class FakeRawKernel:
    """Stands in for ``cupy.RawKernel``: records how the backend builds and compiles them."""

    made: list[tuple[str, tuple[str, ...]]]
    compiled: list[str]
    error: Exception | None = None

    def __init__(self, code, name, options=()):
        self.name = name
        FakeRawKernel.made.append((name, tuple(options)))

    def compile(self, log_stream=None):
        if FakeRawKernel.error is not None:
            raise FakeRawKernel.error
        FakeRawKernel.compiled.append(self.name)


@pytest.fixture
def fake_compiler(monkeypatch):
    """A CUDA device as far as selection sees, and FakeRawKernel as CuPy's compiler (no kernel
    compiled yet in this process)."""
    cp = pytest.importorskip("cupy")
    from rudra_async.kernels import cupy_kernel

    monkeypatch.setattr(kernels, "_cupy_device_problem", lambda: None)
    monkeypatch.setattr(cupy_kernel, "_compiled", {})
    monkeypatch.setattr(cp, "RawKernel", FakeRawKernel)
    monkeypatch.setattr(FakeRawKernel, "made", [], raising=False)
    monkeypatch.setattr(FakeRawKernel, "compiled", [], raising=False)
    monkeypatch.setattr(FakeRawKernel, "error", None)
    return FakeRawKernel


def test_cupy_is_chosen_once_both_kernels_compile_without_fused_multiply_adds(fake_compiler):
    assert resolve("cupy") == "cupy"
    assert sorted(fake_compiler.compiled) == ["sgd_fold_f16", "sgd_fold_f32"]
    assert all("--fmad=false" in options for _, options in fake_compiler.made)
    assert resolve("auto") == "cupy"
    preload("cupy")
    assert len(fake_compiler.compiled) == 2, "compiled once per process"


def test_kernels_that_do_not_compile_are_found_out_when_the_backend_is_chosen(fake_compiler, caplog):
    """CuPy compiles a RawKernel at its first launch: a host without NVRTC would pass the
    selection and fail the first update. Selection compiles both: auto then falls back to the
    CPU with a warning, an explicit cupy is a ConfigError saying why."""
    fake_compiler.error = RuntimeError("CuPy failed to load libnvrtc.so.12")
    with caplog.at_level(logging.WARNING, "rudra_async.kernels"):
        assert resolve("auto", "auto") == CPU_AUTO
    assert "does not compile" in caplog.text and "libnvrtc" in caplog.text
    for kernel, device in (("cupy", "auto"), ("auto", "cuda"), ("cupy", "cuda")):
        with pytest.raises(ConfigError, match=r"does not compile .*libnvrtc"):
            resolve(kernel, device)
    with pytest.raises(ConfigError, match="does not compile"):
        preload("cupy")


@pytest.mark.gpu
@gpu
def test_cupy_equals_the_numpy_reference_bit_for_bit():
    """Compiled without fused multiply-adds, the CUDA kernel rounds every operation as the
    numpy reference does: the same weights and momentum, bit for bit, signed zeros included.
    As the server uses it: the updater made and its momentum loaded and read on this thread,
    the updates applied on another (each thread with its own current CUDA stream)."""
    size = 70_001
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(size).astype(np.float32)
    v0 = rng.standard_normal(size).astype(np.float32)
    w0[:40], v0[:40] = np.tile([0.0, -0.0], 20), np.tile([-0.0, -0.0, 0.0, 0.0], 10)
    groups = [Group(0, 12345, SGD(0.05, 0.9, 1e-3, True)), Group(12345, 12346, SGD(0.5)), Group(12346, size, SGD(0.01))]
    runs = [  # gradient dtypes, steps
        ([np.float32], SGD(0.05)),
        ([np.float32] * 3, SGD(0.05, 0.9, 1e-3)),
        ([np.float16] * 4, SGD(0.05, 0.9, 1e-2, True)),
        ([np.float16, np.float32, np.float16], SGD(0.05, 0.9, 0.0)),
        ([np.float16] * 2, groups),
    ]
    results = {}
    for backend in ("numpy", "cupy"):
        up, w = make_updater(backend, size), w0.copy()
        up.load_momentum(v0)
        r = np.random.default_rng(1)
        with ThreadPoolExecutor(1) as update_thread:
            for step, (dtypes, steps) in enumerate(runs * 2):
                grads = [r.standard_normal(size).astype(dt) for dt in dtypes]
                for g in grads:
                    g[:40] = np.tile([-0.0, -0.0, 0.0, 0.0, -0.0], 8)
                scales = list(r.uniform(0.1, 1.0, len(grads)) / len(grads))
                out = w if step % 2 else np.empty_like(w)
                update_thread.submit(up.apply, w, out, grads, scales, steps).result()
                w = out
                results.setdefault(backend, []).append((w.copy(), up.momentum))
    for step, ((w_ref, v_ref), (w_gpu, v_gpu)) in enumerate(zip(results["numpy"], results["cupy"])):
        assert w_gpu.tobytes() == w_ref.tobytes(), f"weights differ after update {step}"
        assert v_gpu.tobytes() == v_ref.tobytes(), f"momentum differs after update {step}"


def test_kernel_rejects_bad_batches():
    w = np.zeros(4, np.float32)
    with pytest.raises(ValueError):
        make_updater("numpy", 4).apply(w, w, [w], [1.0, 2.0], SGD(0.1))
    with pytest.raises(ValueError, match="groups must cover"):
        make_updater("numpy", 4).apply(w, w, [w], [1.0], [Group(0, 2, SGD(0.1)), Group(3, 4, SGD(0.1))])
    with pytest.raises(ValueError, match="groups must cover"):
        make_updater("torch", 4).apply(w, w, [w], [1.0], [Group(0, 3, SGD(0.1))])
    with pytest.raises(ValueError):
        make_updater("torch", 4).apply(w, w, [np.zeros(5, np.float32)], [1.0], SGD(0.1))
    with pytest.raises(ValueError):
        make_updater("numpy", 4).apply(w, w, [np.zeros(4, np.float64)], [1.0], SGD(0.1))


def test_selection():
    assert resolve("numpy", "cpu") == "numpy"
    assert resolve("torch", "auto") == "torch"
    expected_auto = "cupy" if cupy_device_available() else "torch"
    assert resolve("auto", "auto") == expected_auto
    assert resolve("auto", "cpu") == "torch"
    with pytest.raises(ConfigError, match="unknown kernel"):
        resolve("fortran")
    with pytest.raises(ConfigError, match="--kernel-device cuda needs"):
        resolve("numpy", "cuda")
    if not cupy_device_available():
        with pytest.raises(ConfigError, match=r"no CUDA (device|driver)"):
            resolve("cupy")


@pytest.mark.torch  # the reference is torch.optim.SGD
@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_groups_equal_torch_sgd_with_two_param_groups(backend):
    """Two groups with their own lr and weight decay (and a shared momentum, nesterov) over one
    flat vector: torch.optim.SGD with two parameter groups, step by step."""
    import torch

    n, split = 1000, 377
    rng = np.random.default_rng(3)
    w = rng.standard_normal(n).astype(np.float32)
    up = make_updater(backend, n)
    a = torch.nn.Parameter(torch.from_numpy(w[:split].copy()))
    b = torch.nn.Parameter(torch.from_numpy(w[split:].copy()))
    opt = torch.optim.SGD(
        [{"params": [a], "lr": 0.05, "weight_decay": 1e-3}, {"params": [b], "lr": 0.2, "weight_decay": 0.0}],
        momentum=0.9,
        nesterov=True,
    )
    for _ in range(5):
        g = rng.standard_normal(n).astype(np.float32)
        groups = [Group(0, split, SGD(0.05, 0.9, 1e-3, True)), Group(split, n, SGD(0.2, 0.9, 0.0, True))]
        up.apply(w, w, [g], [1.0], groups)
        a.grad, b.grad = torch.from_numpy(g[:split].copy()), torch.from_numpy(g[split:].copy())
        opt.step()
        np.testing.assert_allclose(w, np.concatenate([a.detach().numpy(), b.detach().numpy()]), rtol=1e-5, atol=1e-6)


@pytest.mark.torch
def test_a_server_runs_the_torch_kernel_on_the_threads_configured():
    """torch's idle worker threads spin on a core after each update, which learners on the same
    host need: a server sets torch's threads to --kernel-threads (default 1; 0 leaves them)."""
    import torch

    from rudra_async.config import ServerConfig
    from rudra_async.server.core import ServerCore

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ServerCore(ServerConfig(kernel="torch"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        ServerCore(ServerConfig(kernel="torch", kernel_threads=0))
        assert torch.get_num_threads() == 2
        ServerCore(ServerConfig(kernel="numpy", kernel_threads=1))  # no torch kernel: torch is left alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.torch
@pytest.mark.parametrize("c, unit", [(1, True), (1, False), (3, False)])  # unit: the one-call path
def test_torch_update_into_another_buffer_equals_the_update_in_place_bit_for_bit(c, unit):
    """Out of place (a reader holds the lease), the torch kernel gives the result of the
    update in place, over several of its blocks and two groups split inside a block."""
    from rudra_async.kernels.torch_kernel import BLOCK

    size = 2 * BLOCK + 5
    split = BLOCK + 1000
    steps = [Group(0, split, SGD(0.05, 0.9, 1e-3, True)), Group(split, size, SGD(0.01, 0.9, 0.0))]
    w0 = np.random.default_rng(1).standard_normal(size).astype(np.float32)
    in_place, out_of_place = make_updater("torch", size), make_updater("torch", size)
    a, b = w0.copy(), w0.copy()
    for grads, scales in random_batches(size, 4, c):
        scales = [1.0] if unit else scales
        in_place.apply(a, a, grads, scales, steps)
        out = np.full_like(b, np.nan)
        out_of_place.apply(b, out, grads, scales, steps)
        b = out
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(in_place.momentum, out_of_place.momentum)


def test_max_abs_reads_block_by_block_and_sees_a_nan_or_inf_in_any_block():
    from rudra_async.kernels.base import MAX_ABS_BLOCK, max_abs

    a = np.linspace(-3.0, 2.0, 3 * MAX_ABS_BLOCK + 5 * 7, dtype=np.float32)
    assert max_abs(a) == 3.0 and max_abs(a[: a.size // 5 * 5].reshape(-1, 5)) == 3.0 and max_abs(a[:0]) == 0.0
    a[-1] = np.nan  # in the last, partial block
    assert np.isnan(max_abs(a))
    a[-1] = -np.inf
    assert max_abs(a) == np.inf
    assert max_abs(np.array([-7.5, 2.0], np.float16)) == 7.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_measures_max_abs_exactly(backend):
    from rudra_async.kernels.base import MAX_ABS_BLOCK

    up = make_updater(backend, 4)
    a = np.linspace(-3.0, 2.0, 4 * MAX_ABS_BLOCK + 7, dtype=np.float32)  # above torch_kernel.AMINMAX_MIN_VALUES
    cases = {"blocks": a, "empty": a[:0], "2-d": a[:12].reshape(3, 4), "strided": a[::3], "f16": a.astype(np.float16)}
    frozen = a.copy()
    frozen.flags.writeable = False
    cases["read-only"] = frozen
    for where in (0, MAX_ABS_BLOCK + 1, a.size - 1):
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[where] = bad
            cases[f"{bad} at {where}"] = b
    for name, x in cases.items():
        expected = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0  # NaN propagates
        got = up.max_abs(x)
        assert (np.isnan(expected) and np.isnan(got)) or got == expected, name


@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
@pytest.mark.parametrize("c, dtype", [(1, np.float32), (3, np.float32), (2, np.float16)])
def test_an_update_computed_in_spans_equals_the_whole_update_bit_for_bit(backend, c, dtype):
    """Spans that cover the vector in order, cut at multiples of the backend's grain
    (numpy: anywhere, inside a group, at odd offsets; torch: its block grid, one cut inside
    a group), in place and into another buffer, give the whole update's weights and
    momentum exactly (unit scales too: torch's one-gradient path)."""
    size = 3 * (1 << 20) + 7
    split = (1 << 20) + 1000
    steps = [Group(0, split, SGD(0.05, 0.9, 1e-3, True)), Group(split, size, SGD(0.01, 0.9, 0.0))]
    whole, parts = make_updater(backend, size), make_updater(backend, size)
    assert parts.partial
    inner = [3, 4096, 1 << 20, split - 1, split, split + 1, 2 * (1 << 20), 2 * (1 << 20) + 999, 3 * (1 << 20)]
    cuts = [0, *(x for x in inner if x % parts.grain == 0), size]
    assert len(cuts) >= 5
    w0 = np.random.default_rng(2).standard_normal(size).astype(np.float32)
    a, b = w0.copy(), w0.copy()
    batches = list(random_batches(size, 3, c, dtype=dtype))
    if c == 1:
        batches.append(([batches[0][0][0]], [1.0]))
    for step, (grads, scales) in enumerate(batches):
        whole.apply(a, a, grads, scales, steps)
        out = b if step % 2 else np.full_like(b, np.nan)
        for lo, hi in itertools.pairwise(cuts):
            parts.apply(b, out, grads, scales, steps, span=(lo, hi))
        b = out
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.momentum, parts.momentum)
    with pytest.raises(ValueError, match="span"):
        parts.apply(b, b, grads, scales, steps, span=(5, size + 1))


@pytest.mark.skipif(kernels._cuda_driver_problem() is None, reason="this host has a CUDA driver")
def test_no_driver_means_cupy_is_never_imported():
    """Without the CUDA driver CuPy cannot see a device, so choosing a backend does not import
    it (its import costs a server about 180 MB), and an explicit cupy says why it cannot run."""
    code = "import sys; from rudra_async.kernels import resolve; resolve('auto', 'auto');print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
    with pytest.raises(ConfigError, match="no CUDA driver"):
        resolve("cupy", "auto")

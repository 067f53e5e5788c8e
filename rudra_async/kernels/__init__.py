"""Update kernels: fold c scaled gradients, momentum and weight decay into the weights.

Every backend computes, in one pass over flat float32 buffers, what ``torch.optim.SGD``
(dampening 0) does with the combined gradient::

    d    = Σ_l scales[l] · grads[l] + weight_decay · w
    v    = momentum · v + d                     (v starts at 0, so the first v is d)
    step = d + momentum · v  if nesterov else v
    w'   = w − lr · step

The settings may differ between parameter groups: contiguous ranges [lo, hi) of the flat
vector, each with its own :class:`SGD` (as ``torch.optim`` parameter groups).
Gradients may be float32 or float16 (accumulated in float32). A pushed gradient's max |g|
(the server's check) is :func:`max_abs`, or a backend's faster ``Updater.max_abs`` of the same
value. This package is the only place that imports cupy or decides the device;
:func:`resolve` picks a backend.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import sys

from ..errors import ConfigError
from .base import SGD, Group, HostUpdater, Steps, Updater, as_groups, max_abs, within

log = logging.getLogger(__name__)

__all__ = [
    "DEVICES",
    "KERNELS",
    "SGD",
    "Group",
    "HostUpdater",
    "Steps",
    "Updater",
    "as_groups",
    "cupy_device_available",
    "make_updater",
    "max_abs",
    "preload",
    "resolve",
    "within",
]

KERNELS = ("numpy", "torch", "cupy")
DEVICES = ("auto", "cpu", "cuda")


def cupy_device_available() -> bool:
    """True when CuPy imports *and* sees a CUDA device (never a try-import alone)."""
    return _cupy_device_problem() is None


def _cupy_device_problem() -> str | None:
    """Why CuPy cannot reach a CUDA device, or None when it can. A CuPy install that does not
    import (two CuPy wheels, a CUDA library missing) reads as no device, with a warning."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    problem = _cuda_driver_problem()
    if problem is not None:
        return problem
    try:
        import cupy
    except Exception as exc:
        log.warning("CuPy is installed but does not import, so it is not used: %s: %s", type(exc).__name__, exc)
        return f"CuPy does not import ({type(exc).__name__}: {exc})"
    try:
        if cupy.is_available():
            return None
    except Exception:  # a broken driver install reads as "no device"
        pass
    return "no CUDA device visible to CuPy"


#: the CUDA driver's library, which CuPy needs to see any device
CUDA_DRIVER = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


def _cuda_driver_problem() -> str | None:
    """Why the CUDA driver's library does not load, or None when it does. Checked before
    CuPy is imported: without the driver ``cupy.is_available()`` is False anyway, and the
    import alone costs about 180 MB of a server's memory and a second of its start."""
    try:
        ctypes.CDLL(CUDA_DRIVER)
    except OSError:
        return f"no CUDA driver ({CUDA_DRIVER} does not load)"
    return None


def _cupy_kernel_problem() -> str | None:
    """Why the CuPy kernels do not compile on the current device (no NVRTC, say), or None
    when they do (compiled now, once per process: see ``cupy_kernel.compiled_kernels``)."""
    try:
        from .cupy_kernel import compiled_kernels

        compiled_kernels()
    except Exception as exc:
        return f"the CuPy update kernel does not compile ({type(exc).__name__}: {exc})"
    return None


def resolve(kernel: str = "auto", device: str = "auto") -> str:
    """The backend name for the ``--kernel`` / ``--kernel-device`` pair. ``cupy`` is chosen
    only once its kernels are compiled: where they do not compile, ``auto`` falls back to a
    CPU backend (with a warning logged) and an explicit ``cupy`` or ``cuda`` is a
    :class:`ConfigError` saying why."""
    if kernel not in ("auto", *KERNELS):
        raise ConfigError(f"unknown kernel {kernel!r}; known: auto, {', '.join(KERNELS)}")
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
    if kernel == "cupy" or device == "cuda":
        if kernel not in ("auto", "cupy"):
            raise ConfigError(f"kernel {kernel!r} runs on the CPU; --kernel-device cuda needs --kernel cupy or auto")
        problem = _cupy_device_problem()
        if problem is not None:
            raise ConfigError(f"{problem} (install rudra-async[gpu] on a GPU machine)")
        problem = _cupy_kernel_problem()
        if problem is not None:
            raise ConfigError(problem)
        return "cupy"
    if kernel != "auto":
        if kernel == "torch" and importlib.util.find_spec("torch") is None:
            raise ConfigError("kernel 'torch' needs PyTorch installed")
        return kernel
    if device == "auto" and cupy_device_available():
        problem = _cupy_kernel_problem()
        if problem is None:
            return "cupy"
        log.warning("%s; the update runs on the CPU", problem)
    return "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def preload(name: str, threads: int = 0) -> None:
    """Import the named backend now (torch or CuPy take seconds to import; CuPy's kernels are
    compiled too, or a :class:`ConfigError` says why not): a server does it as it starts,
    not on its event loop when the first learner says hello. ``threads`` > 0 sets the torch
    backend's CPU threads (process-wide: ``torch.set_num_threads``)."""
    module = importlib.import_module(f"{__name__}.{name}_kernel")
    if name == "torch" and threads > 0:
        module.torch.set_num_threads(threads)
    if name == "cupy":
        problem = _cupy_kernel_problem()
        if problem is not None:
            raise ConfigError(problem)


def make_updater(name: str, size: int) -> Updater:
    """An updater for a parameter vector of ``size`` values with the named backend."""
    if name == "numpy":
        from .numpy_kernel import NumpyUpdater

        return NumpyUpdater(size)
    if name == "torch":
        from .torch_kernel import TorchUpdater

        return TorchUpdater(size)
    if name == "cupy":
        from .cupy_kernel import CupyUpdater

        return CupyUpdater(size)
    raise ConfigError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")

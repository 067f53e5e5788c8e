"""Update kernels: fold c scaled gradients, momentum and weight decay into the weights.

Every backend computes, in one pass over flat float32 buffers, what ``torch.optim.SGD``
(dampening 0) does with the combined gradient::

    d    = Σ_l scales[l] · grads[l] + weight_decay · w
    v    = momentum · v + d                     (v starts at 0, so the first v is d)
    step = d + momentum · v  if nesterov else v
    w'   = w − lr · step

Gradients may be float32 or float16 (accumulated in float32). This package is the only
place that imports cupy or decides the device; :func:`select` picks a backend.
"""

from __future__ import annotations

import abc
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError

__all__ = [
    "DEVICES",
    "KERNELS",
    "SGD",
    "HostUpdater",
    "Updater",
    "cupy_device_available",
    "make_updater",
    "resolve",
]

KERNELS = ("numpy", "torch", "cupy")
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class SGD:
    """The optimizer settings of one update, as ``torch.optim.SGD`` names them (dampening 0)."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


class Updater(abc.ABC):
    """Owns the momentum buffer (and, on a GPU, the master weights) of one flat parameter vector.

    ``apply`` reads the current weights from ``w`` (host) and writes the new ones into
    ``w_out`` (host; may be ``w`` itself).
    """

    def __init__(self, size: int) -> None:
        self.size = size

    @abc.abstractmethod
    def apply(
        self, w: np.ndarray, w_out: np.ndarray, grads: Sequence[np.ndarray], scales: Sequence[float], sgd: SGD
    ) -> None: ...

    @property
    @abc.abstractmethod
    def momentum(self) -> np.ndarray:
        """A snapshot of the momentum buffer in host memory, owned by the caller."""

    @abc.abstractmethod
    def load_momentum(self, v: np.ndarray) -> None:
        """Replace the momentum buffer (``size`` float32 values), e.g. from a checkpoint."""


class HostUpdater(Updater):
    """An updater whose momentum lives in host memory (``self._v``)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self._v: np.ndarray = np.zeros(size, np.float32)

    @property
    def momentum(self) -> np.ndarray:
        snapshot: np.ndarray = self._v.copy()
        return snapshot

    def load_momentum(self, v: np.ndarray) -> None:
        check_momentum(v, self.size)
        self._v[:] = v


def check_batch(grads: Sequence[np.ndarray], scales: Sequence[float], size: int) -> None:
    if not grads or len(grads) != len(scales):
        raise ValueError("need one scale per gradient and at least one gradient")
    for g in grads:
        if g.size != size or g.dtype not in (np.float32, np.float16):
            raise ValueError(f"gradients must be float32/float16 of {size} values, got {g.dtype} × {g.size}")


def check_momentum(v: np.ndarray, size: int) -> None:
    if v.dtype != np.float32 or v.size != size:
        raise ValueError(f"momentum must be float32 of {size} values, got {v.dtype} × {v.size}")


def cupy_device_available() -> bool:
    """True when CuPy is installed *and* sees a CUDA device (never a try-import alone)."""
    if importlib.util.find_spec("cupy") is None:
        return False
    import cupy

    try:
        return bool(cupy.is_available())
    except Exception:  # a broken driver install reads as "no device"
        return False


def resolve(kernel: str = "auto", device: str = "auto") -> str:
    """The backend name for the ``--kernel`` / ``--device`` pair."""
    if kernel not in ("auto", *KERNELS):
        raise ConfigError(f"unknown kernel {kernel!r}; known: auto, {', '.join(KERNELS)}")
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; known: {', '.join(DEVICES)}")
    if kernel == "cupy" or device == "cuda":
        if kernel not in ("auto", "cupy"):
            raise ConfigError(f"kernel {kernel!r} runs on the CPU; --device cuda needs --kernel cupy or auto")
        if not cupy_device_available():
            raise ConfigError("no CUDA device visible to CuPy (install rudra-async[gpu] on a GPU machine)")
        return "cupy"
    if kernel != "auto":
        if kernel == "torch" and importlib.util.find_spec("torch") is None:
            raise ConfigError("kernel 'torch' needs PyTorch installed")
        return kernel
    if device == "auto" and cupy_device_available():
        return "cupy"
    return "torch" if importlib.util.find_spec("torch") is not None else "numpy"


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

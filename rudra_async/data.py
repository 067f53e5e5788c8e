"""Data sets that ship with installed packages (nothing is downloaded at run time)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .errors import ConfigError


@dataclass
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def n_features(self) -> int:
        return int(np.prod(self.x_train.shape[1:]))

    @property
    def n_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)


def load_digits(test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    """scikit-learn's 1,797 8×8 digits, scaled to [0, 1], split by a fixed seeded permutation."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError:
        raise ConfigError("the digits data set needs scikit-learn: pip install 'rudra-async[learner]'") from None
    raw = sk_digits()
    x = (raw.data / 16.0).astype(np.float32)
    y = raw.target.astype(np.int64)
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test])


DATASETS = {"digits": load_digits}


def load(name: str) -> Dataset:
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}")
    return DATASETS[name]()


def minibatches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless mini-batch indices: a fresh permutation each epoch, the tail carried over."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    pending = np.empty(0, np.int64)
    while True:
        while len(pending) < batch_size:
            pending = np.concatenate([pending, rng.permutation(n)])
        yield pending[:batch_size]
        pending = pending[batch_size:]

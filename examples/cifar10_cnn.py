"""Your own model and data through the command line: a CNN on CIFAR-10 through a DataLoader.

    CIFAR10_DIR=~/data/cifar-10-batches-py rudra-async train --learners 2 --epochs 1 \\
        --model cifar10_cnn:model --data cifar10_cnn:data --batch-size 32 --lr 0.01

(run it from this directory, or put it on PYTHONPATH). CIFAR10_DIR holds the standard
python-pickle batches (data_batch_1 … data_batch_5, test_batch); nothing is downloaded.
`data(index, learners)` gives each learner its own shard of the training set.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def model() -> nn.Module:
    """conv 3→32 5×5 → pool → conv 32→64 5×5 → pool → fc 4096→128 → fc 128→10."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def data(index: int = 0, learners: int = 1, batch_size: int = 32) -> DataLoader:
    """This learner's shard of the training batches, scaled to [0, 1], shuffled each pass."""
    root = Path(os.environ.get("CIFAR10_DIR", "cifar-10-batches-py")).expanduser()
    files = sorted(root.glob("data_batch_*"))
    if not files:
        raise FileNotFoundError(f"no CIFAR-10 python batches (data_batch_*) in {root}; set CIFAR10_DIR")
    images, labels = [], []
    for path in files:
        with open(path, "rb") as fh:
            batch = pickle.load(fh, encoding="bytes")
        images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
        labels.append(np.asarray(batch[b"labels"], np.int64))
    x = torch.from_numpy(np.concatenate(images)[index::learners].astype(np.float32) / 255.0)
    y = torch.from_numpy(np.concatenate(labels)[index::learners])
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)

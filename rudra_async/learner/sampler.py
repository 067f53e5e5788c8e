"""Each learner's part of a data set: :class:`ShardSampler`, a ``DataLoader`` sampler.

    loader = DataLoader(train_set, batch_size=32, sampler=rt.ShardSampler(train_set))

Learners of one run must not all read the same samples in the same order (λ learners would
then compute λ copies of one gradient). The server gives every learner an index i and the
number of learners λ (WELCOME, and λ again with every WEIGHTS); at the start of each epoch
the sampler takes learner i's part of that epoch's permutation.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import LearnerError

if TYPE_CHECKING:
    from .api import DistributedOptimizer

_newest: weakref.ref[DistributedOptimizer] | None = None  # the newest DistributedOptimizer of this process


def register(optimizer: DistributedOptimizer) -> None:
    """Make ``optimizer`` the one samplers created without ``optimizer=`` follow."""
    global _newest
    _newest = weakref.ref(optimizer)


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


class ShardSampler(torch.utils.data.Sampler[int]):
    """This learner's part of ``data`` at each epoch (every ``iter()`` is the next epoch,
    reshuffled with ``seed``; :meth:`set_epoch` sets it, as ``DistributedSampler`` has).
    ``optimizer``: the :class:`~rudra_async.torch.DistributedOptimizer` whose learner index
    and λ to follow (default: the newest one made in this process, looked up when the loader
    is iterated, so the loader may be built first). λ and the index are read at the start of
    each epoch: a learner that joins or leaves an asynchronous run changes the parts from
    the next epoch (with ``--expected-learners``, every learner's λ stays that number).
    ``drop_last``: each part is ⌊n/λ⌋ indices instead of padding to ⌈n/λ⌉."""

    def __init__(
        self,
        data: Sized,
        optimizer: DistributedOptimizer | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.data = data
        self.optimizer = optimizer
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _assignment(self) -> tuple[int, int]:
        optimizer = self.optimizer or (_newest() if _newest is not None else None)
        if optimizer is None:
            raise LearnerError(
                "ShardSampler follows a DistributedOptimizer's learner index: make the optimizer before "
                "iterating the loader (or pass it as optimizer=)"
            )
        return optimizer.index, optimizer.learners

    def __iter__(self) -> Iterator[int]:
        index, learners = self._assignment()
        part = shard_of(len(self.data), index, learners, self.epoch, self.seed, self.shuffle)
        self.epoch += 1
        if self.drop_last:
            part = part[: len(self.data) // learners]
        return iter(part.tolist())

    def __len__(self) -> int:
        _, learners = self._assignment()
        n = len(self.data)
        return n // learners if self.drop_last else -(-n // learners)

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

import torch

from ..errors import LearnerError
from .data import shard_of

if TYPE_CHECKING:
    from .api import DistributedOptimizer

_newest: weakref.ref[DistributedOptimizer] | None = None  # the newest DistributedOptimizer of this process


def register(optimizer: DistributedOptimizer) -> None:
    """Make ``optimizer`` the one samplers created without ``optimizer=`` follow."""
    global _newest
    _newest = weakref.ref(optimizer)


class ShardSampler(torch.utils.data.Sampler[int]):
    """This learner's part of ``data`` at each epoch (every ``iter()`` is the next epoch,
    reshuffled with ``seed``; :meth:`set_epoch` sets it, as ``DistributedSampler`` has).
    ``optimizer``: the :class:`~rudra_async.torch.DistributedOptimizer` whose learner index
    and λ to follow (default: the newest one made in this process, looked up when the loader
    is iterated, so the loader may be built first). λ and the index are read at the start of
    each epoch: a learner that joins or leaves an asynchronous run changes the parts from
    the next epoch (with ``--expected-learners``, every learner's λ stays that number).
    ``drop_last``: each part is ⌊n/λ⌋ indices instead of padding to ⌈n/λ⌉. Once the
    server's run is over (``step()`` returned False) it yields nothing more, so a loop over
    the loader ends."""

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

    def _follow(self) -> DistributedOptimizer:
        optimizer = self.optimizer or (_newest() if _newest is not None else None)
        if optimizer is None:
            raise LearnerError(
                "ShardSampler follows a DistributedOptimizer's learner index: make the optimizer before "
                "iterating the loader (or pass it as optimizer=)"
            )
        return optimizer

    def __iter__(self) -> Iterator[int]:
        optimizer = self._follow()
        index, learners = optimizer.index, optimizer.learners
        part = shard_of(len(self.data), index, learners, self.epoch, self.seed, self.shuffle)
        self.epoch += 1
        if self.drop_last:
            part = part[: len(self.data) // learners]
        for i in part.tolist():
            if optimizer.stopped:  # the server's run is over: the loop over the loader ends
                return
            yield i

    def __len__(self) -> int:
        learners = self._follow().learners
        n = len(self.data)
        return n // learners if self.drop_last else -(-n // learners)

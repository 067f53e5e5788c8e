"""A learner's scalars for TensorBoard (``--tensorboard DIR``): loss, staleness,
throughput and learning rate per step, and the final test accuracy, written through
``torch.utils.tensorboard`` (the ``tensorboard`` extra). The step axis is the **server's
clock** (the update the learner's weights came from), so that every learner's runs line
up on one axis and with the server's metrics. The training loop calls
:meth:`TrainingLog.record` once per step; nothing else of the loop is known here.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..config import TENSORBOARD_MISSING as MISSING
from ..errors import ConfigError

__all__ = ["TrainingLog", "open_log", "server_step", "updates_between"]


class TrainingLog:
    """Scalars under ``directory`` (one run of TensorBoard's): ``train/loss``,
    ``train/staleness``, ``train/samples_per_s``, ``train/lr`` and ``test/accuracy``, by
    step (the server's clock)."""

    def __init__(self, directory: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(MISSING) from None
        try:
            self._writer: Any = SummaryWriter(log_dir=directory)
        except OSError as exc:
            raise ConfigError(f"--tensorboard {directory}: cannot write there ({exc.strerror})") from None

    def record(
        self,
        step: int,
        *,
        loss: float | None = None,
        staleness: float | None = None,
        samples_per_s: float | None = None,
        lr: float | None = None,
        accuracy: float | None = None,
    ) -> None:
        """The figures of one step (those given)."""
        now = time.time()
        for tag, value in (
            ("train/loss", loss),
            ("train/staleness", staleness),
            ("train/samples_per_s", samples_per_s),
            ("train/lr", lr),
            ("test/accuracy", accuracy),
        ):
            if value is not None:
                self._writer.add_scalar(tag, value, step, walltime=now)

    def close(self) -> None:
        self._writer.close()


class _NoLog:
    """What :func:`open_log` gives without a directory: records nothing."""

    def record(self, step: int, **figures: float | None) -> None:
        pass

    def close(self) -> None:
        pass


def server_step(stamp: Any) -> int:
    """The server's clock in a stamp (with shards, shard 0's): a TensorBoard step."""
    return int(stamp[0] if isinstance(stamp, tuple) else stamp)


def updates_between(stamp: Any, newer: Any) -> int:
    """Updates the server made between the weights a gradient was computed on (``stamp``)
    and those that came back with its push (``newer``), the gradient's own excepted: its
    staleness σ under async (with shards, shard 0's clock)."""

    return max(0, server_step(newer) - server_step(stamp) - 1)


def open_log(directory: str | None, name: str) -> TrainingLog | _NoLog:
    """A :class:`TrainingLog` in ``directory/name`` (one run per learner), or one that
    records nothing when ``directory`` is None."""
    if directory is None:
        return _NoLog()
    return TrainingLog(os.path.join(directory, name))

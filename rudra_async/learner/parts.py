"""A learner's parts from their names: the model, the data, the loss and the device.

Built-in names (``--model mlp``, ``--dataset digits``, ``--loss cross_entropy``) or the
user's own as ``module:function``, imported from the current directory or ``PYTHONPATH``:

- ``--model module:fn``: ``fn()`` returns an ``nn.Module``;
- ``--data module:fn``: ``fn()`` returns a ``DataLoader`` or any iterable of ``(input,
  target)`` batches of tensors or numpy arrays (without a length when len() raises
  TypeError, as a ``DataLoader`` over an ``IterableDataset`` does); it is passed ``index``
  (this learner's), ``learners`` (how many the job has), ``batch_size`` (``--batch-size``)
  and ``seed`` when it declares parameters of those names, so it can give each learner its
  shard;
- ``--loss module:fn``: ``fn(output, target)`` returns a scalar tensor.

Every failure is a one-line :class:`~rudra_async.errors.LearnerError` naming what was
looked for.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import LearnerOptions, model_for_data
from ..errors import ConfigError, LearnerError
from . import data as datasets
from . import models

Batch = tuple[torch.Tensor, torch.Tensor]
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "cross_entropy": nn.functional.cross_entropy,
    "mse": nn.functional.mse_loss,
}


@dataclass
class Parts:
    """What a learner trains: ``batches()`` is endless (the data again and again)."""

    model: nn.Module
    batches: Callable[[], Iterator[Batch]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batches_per_pass: int | None  # one pass over this learner's data; None when it has no length
    test: datasets.Dataset | None  # a built-in data set's test split, for the final accuracy


def load_user_object(spec: str, what: str) -> Any:
    """``module:attr`` imported from the current directory or ``PYTHONPATH``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise LearnerError(f"{what} {spec!r}: expected module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LearnerError(
            f"{what} {spec!r}: cannot import module {module_name!r} from the current directory or PYTHONPATH ({exc})"
        ) from None
    except Exception as exc:
        raise LearnerError(f"{what} {spec!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise LearnerError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None


def call_user(fn: Callable[..., Any], spec: str, what: str, **available: Any) -> Any:
    """``fn`` called with those of ``available`` it declares; its failure is one line naming it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    kwargs = {k: v for k, v in available.items() if k in params}
    try:
        return fn(**kwargs)
    except Exception as exc:
        raise LearnerError(f"{what} {spec!r} raised {type(exc).__name__}: {exc}") from None


def resolve_device(name: str) -> torch.device:
    """``auto`` (cuda when ``torch.cuda.is_available()``, else cpu), ``cpu``, ``cuda[:N]``, ``mps``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise LearnerError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LearnerError(f"device {name!r}: no CUDA device is available to torch")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise LearnerError(f"device {name!r}: MPS is not available to torch")
    return device


def resolve_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if name in LOSSES:
        return LOSSES[name]
    if ":" not in name:
        raise LearnerError(f"unknown loss {name!r}; known: {', '.join(LOSSES)}, or module:function")
    fn = load_user_object(name, "--loss")
    if not callable(fn):
        raise LearnerError(f"--loss {name!r} is not callable")
    return lambda output, target: call_user(lambda: fn(output, target), name, "loss function")


def scalar_loss(loss: Any, name: str) -> torch.Tensor:
    """The loss a backward pass can start from: a tensor with one value."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise LearnerError(f"loss {name!r} returned {shape}, expected a scalar tensor (reduce it, e.g. .mean())")
    return loss.reshape(())


def load_parts(opts: LearnerOptions, index: int = 0, learners: int = 1) -> Parts:
    """The model (on its device), the data and the loss that ``opts`` names."""
    device = resolve_device(opts.device)
    loss = resolve_loss(opts.loss)
    torch.manual_seed(opts.seed)  # every learner builds the same initial weights
    if opts.data is None:
        dataset = _builtin(opts.dataset)
        model = _builtin_model(opts.model, dataset)
        batches = _builtin_batches(dataset, opts.batch_size, index, learners, opts.seed, device)
        per_pass = max(1, len(dataset.y_train) // opts.batch_size)
        return Parts(model.to(device), batches, loss, per_pass, dataset)
    model = user_module(opts.model)
    data = call_user(
        load_user_object(opts.data, "--data"),
        opts.data,
        "data function",
        index=index,
        learners=learners,
        batch_size=opts.batch_size,
        seed=opts.seed,
    )
    if not isinstance(data, Iterable):
        raise LearnerError(f"data function {opts.data!r} returned {type(data).__name__}, not an iterable of batches")
    return Parts(model.to(device), _user_batches(data, opts.data, device), loss, _length(data, opts.data), None)


def user_module(spec: str) -> nn.Module:
    """The model ``--model module:function`` builds (a LearnerError for a built-in name: those
    are built for a built-in data set)."""
    if ":" not in spec:
        raise LearnerError(model_for_data(spec))
    model = call_user(load_user_object(spec, "--model"), spec, "model function")
    if not isinstance(model, nn.Module):
        raise LearnerError(f"model function {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _length(data: Iterable[Any], spec: str) -> int | None:
    """How many batches one pass over ``data`` gives; None when it has no length (e.g. a
    ``DataLoader`` over an ``IterableDataset``, which is ``Sized`` but whose len() raises
    TypeError)."""
    if not isinstance(data, Sized):
        return None
    try:
        return len(data)
    except TypeError:
        return None
    except Exception as exc:
        raise LearnerError(f"data {spec!r}: len() raised {type(exc).__name__}: {exc}") from None


def _builtin(name: str) -> datasets.Dataset:
    try:
        return datasets.load(name)
    except ConfigError as exc:
        raise LearnerError(str(exc)) from None


def _builtin_model(name: str, dataset: datasets.Dataset) -> nn.Module:
    try:
        factory = models.resolve(name)
    except ConfigError as exc:
        raise LearnerError(str(exc)) from None
    module: nn.Module = call_user(lambda: factory(dataset.n_features, dataset.n_classes), name, "model")
    return module


def _builtin_batches(
    dataset: datasets.Dataset, batch_size: int, index: int, learners: int, seed: int, device: torch.device
) -> Callable[[], Iterator[Batch]]:
    """Learner ``index`` of ``learners`` takes its part of every epoch (:func:`~.data.shard_of`)."""
    x, y = torch.from_numpy(dataset.x_train).to(device), torch.from_numpy(dataset.y_train).to(device)

    def batches() -> Iterator[Batch]:
        for idx in datasets.minibatches(len(y), batch_size, index, learners, seed):
            rows = torch.from_numpy(idx).to(device)
            yield x[rows], y[rows]

    return batches


def _user_batches(data: Iterable[Any], spec: str, device: torch.device) -> Callable[[], Iterator[Batch]]:
    def batches() -> Iterator[Batch]:
        for epoch in itertools.count():
            seen = 0
            iterator = iter(data)
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                except Exception as exc:
                    raise LearnerError(
                        f"data {spec!r} raised {type(exc).__name__} while loading a batch: {exc}"
                    ) from None
                if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                    raise LearnerError(
                        f"data {spec!r} gave a {type(batch).__name__}; each batch must be (input, target)"
                    )
                seen += 1
                yield _on_device(batch[0], spec, device), _on_device(batch[1], spec, device)
            if not seen:
                raise LearnerError(f"data {spec!r} gave no batch" + (f" in pass {epoch + 1}" if epoch else ""))

    return batches


def _on_device(value: Any, spec: str, device: torch.device) -> torch.Tensor:
    """A batch's input or target as a tensor on ``device``: a tensor, or a numpy array (converted)."""
    if isinstance(value, np.ndarray):
        try:
            value = torch.as_tensor(value)
        except TypeError as exc:
            raise LearnerError(f"data {spec!r} gave a numpy array torch cannot hold: {exc}") from None
    if not isinstance(value, torch.Tensor):
        raise LearnerError(
            f"data {spec!r} gave a batch part of type {type(value).__name__}; input and target must be "
            "tensors or numpy arrays"
        )
    return value.to(device, non_blocking=True)

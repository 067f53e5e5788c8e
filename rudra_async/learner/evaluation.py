"""Test accuracy of trained weights: a model in memory, or the weights of a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from . import data as datasets
from . import models
from .binding import FlatParameters


@torch.no_grad()
def evaluate(module: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``module`` on ``x``, ``y``."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    logits = module(torch.from_numpy(x).to(device))
    target = torch.from_numpy(y).to(device)
    loss = nn.functional.cross_entropy(logits, target).item()
    acc = (logits.argmax(1) == target).float().mean().item()
    module.train(was_training)
    return acc, loss


def evaluate_checkpoint(paths: Sequence[str], model: str = "mlp", dataset: str = "digits") -> dict[str, Any]:
    """Test accuracy and loss of the weights in a checkpoint (or in one checkpoint per shard
    of a sharded group, in any order, all of one clock: files of different clocks, from a
    crash between periodic checkpoints or from another run, would join into a model nobody
    trained), loaded into ``model``."""
    from .. import checkpoint

    states = sorted((checkpoint.load(p) for p in paths), key=lambda st: st.shard.index)
    shards = [str(st.shard) for st in states]
    count = states[0].shard.count
    if [st.shard.to_wire() for st in states] != [[i, count] for i in range(count)]:
        raise ConfigError(f"need one checkpoint for every shard of {count}, got shards {', '.join(shards)}")
    if any(st.layout != states[0].layout for st in states):
        raise ConfigError("the shards' checkpoints belong to different models")
    if len({st.clock for st in states}) > 1:
        clocks = ", ".join(f"shard {st.shard.index} at update {st.clock}" for st in states)
        raise ConfigError(f"the shards' checkpoints are of different updates ({clocks}): not one model")
    data = datasets.load(dataset)
    module = build_model(model, data, seed=0)
    flat = bind(module)
    layout = states[0].layout
    if flat.layout.to_wire() != layout.to_wire():
        raise ConfigError(
            f"the checkpoint's parameters ({len(layout.tensors)} tensors, {layout.size} values) "
            f"are not those of model {model!r} on {dataset!r} ({flat.layout.size} values)"
        )
    flat.host_weights[:] = np.concatenate([st.weights for st in states])
    accuracy, loss = evaluate(module, data.x_test, data.y_test)
    return {
        "checkpoints": list(paths),
        "clocks": [st.clock for st in states],
        "clock": states[0].clock,
        "samples": states[0].samples,
        "model": model,
        "dataset": dataset,
        "test_accuracy": accuracy,
        "test_error": 1.0 - accuracy,
        "test_loss": loss,
    }


def bind(module: nn.Module) -> FlatParameters:
    """``module``'s trainable parameters bound to flat buffers, in ``named_parameters`` order
    (the order of a learner without an optimizer: the layout the server holds)."""
    return FlatParameters([(n, p) for n, p in module.named_parameters() if p.requires_grad])


def build_model(model: str, dataset: datasets.Dataset, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every learner builds identical initial weights
    module: nn.Module = models.resolve(model)(dataset.n_features, dataset.n_classes)
    return module

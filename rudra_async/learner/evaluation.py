"""Test accuracy of trained weights: a model in memory, or the weights of a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from ..layout import Layout
from ..model_state import StateLayout
from . import data as datasets
from . import models
from .binding import FlatParameters


def evaluate(module: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``module`` on ``x``, ``y`` (:func:`evaluate_batches`
    of one batch; the module's train mode is kept)."""
    was_training = module.training
    result = evaluate_batches(module, [(torch.from_numpy(x), torch.from_numpy(y))])
    module.train(was_training)
    return result


def evaluate_checkpoint(
    paths: Sequence[str], model: str = "mlp", dataset: str = "digits", data: str | None = None
) -> dict[str, Any]:
    """Test accuracy and loss of the model in a checkpoint (or in one checkpoint per shard
    of a sharded group, in any order, all of one clock: files of different clocks, from a
    crash between periodic checkpoints or from another run, would join into a model nobody
    trained): its trained weights and (format 2) its frozen parameters and buffers, loaded
    by name into ``model`` (a built-in name, built for ``dataset``, or ``module:function``
    returning an ``nn.Module``), evaluated on ``dataset``'s test split or on the batches
    ``data`` (``module:function``, as a learner's ``--data``) gives."""
    from .. import checkpoint
    from .parts import call_user, load_user_object, user_module

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
    if data is None:
        test = datasets.load(dataset)
        module = build_model(model, test, seed=0)
        batches: Any = [(torch.from_numpy(test.x_test), torch.from_numpy(test.y_test))]
    else:
        module = user_module(model)
        batches = call_user(load_user_object(data, "--data"), data, "data function")
    first = states[0]
    weights = np.concatenate([st.weights for st in states])
    try:
        load_whole(module, first.layout, weights, first.model_state, first.model_state_values)
    except ConfigError as exc:
        raise ConfigError(f"the checkpoint's tensors are not those of model {model!r}: {exc}") from None
    accuracy, loss = evaluate_batches(module, batches)
    return {
        "checkpoints": list(paths),
        "clocks": [st.clock for st in states],
        "clock": first.clock,
        "samples": first.samples,
        "model": model,
        "dataset": data or dataset,
        "test_accuracy": accuracy,
        "test_error": 1.0 - accuracy,
        "test_loss": loss,
    }


@torch.no_grad()
def evaluate_batches(module: nn.Module, batches: Any) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``module`` (in eval mode) over ``(input, target)`` batches."""
    module.eval()
    device = next(module.parameters()).device
    correct = total = 0
    loss = 0.0
    for x, y in batches:
        x, y = torch.as_tensor(x).to(device), torch.as_tensor(y).to(device)
        logits = module(x)
        loss += nn.functional.cross_entropy(logits, y, reduction="sum").item()
        correct += int((logits.argmax(1) == y).sum())
        total += len(y)
    if not total:
        raise ConfigError("the test data gave no batch")
    return correct / total, loss / total


def load_whole(
    module: nn.Module,
    layout: Layout,
    weights: np.ndarray,
    state: StateLayout | None = None,
    values: Sequence[np.ndarray] = (),
) -> None:
    """Load a run's model into ``module`` by name: the trained ``weights`` (flat, in
    ``layout`` order) and the frozen parameters and buffers (``state``, ``values``). Every
    entry of the module's ``state_dict`` must be among them, each of its shape: else a
    ConfigError naming what differs."""
    whole = {t.name: torch.tensor(weights[t.offset : t.offset + t.size].reshape(t.shape)) for t in layout.tensors}
    if state is not None:
        whole.update({t.name: torch.tensor(v) for t, v in zip(state.tensors, values)})
    own = module.state_dict()
    missing = [k for k in own if k not in whole]
    if missing:
        raise ConfigError(
            f"the model has {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}, which the run's "
            "checkpoint lacks (frozen parameters and buffers are in checkpoints of format 2)"
        )
    shapes = [k for k in own if tuple(own[k].shape) != tuple(whole[k].shape)]
    if shapes:
        k = shapes[0]
        raise ConfigError(f"{k!r} is {list(own[k].shape)} in the model, {list(whole[k].shape)} in the checkpoint")
    module.load_state_dict({k: whole[k] for k in own})


def bind(module: nn.Module) -> FlatParameters:
    """``module``'s trainable parameters bound to flat buffers, in ``named_parameters`` order
    (the order of a learner without an optimizer: the layout the server holds)."""
    return FlatParameters([(n, p) for n, p in module.named_parameters() if p.requires_grad])


def build_model(model: str, dataset: datasets.Dataset, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every learner builds identical initial weights
    module: nn.Module = models.resolve(model)(dataset.n_features, dataset.n_classes)
    return module

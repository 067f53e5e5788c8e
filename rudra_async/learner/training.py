"""The PyTorch learner: a model bound to flat buffers, running the paper's loop.

Loop: sample a mini-batch of μ → compute the mean gradient on the weights stamped j →
push it with stamp j and receive the newest weights (one round trip) → repeat.
Pulled weights are received straight into the model's parameter memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..client import SyncClient, went_back
from ..config import LearnerConfig
from ..errors import ConfigError, RemoteError, TransportError
from ..layout import Layout
from . import data as datasets
from . import models
from .tensorboard import open_log, updates_between

log = logging.getLogger(__name__)


class FlatModel:
    """Rebinds a module's parameters and their gradients to two flat float32 buffers.

    After construction ``weights`` *is* the model's parameter memory and ``grads`` is where
    backward accumulates, so moving the model to or from the wire is a single buffer.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.layout = Layout.from_shapes((n, tuple(p.shape)) for n, p in named)
        self.weights = torch.empty(self.layout.size, dtype=torch.float32)
        self.grads = torch.zeros(self.layout.size, dtype=torch.float32)
        for (_, p), t in zip(named, self.layout.tensors):
            sl = slice(t.offset, t.offset + t.size)
            self.weights[sl].copy_(p.detach().reshape(-1))
            p.data = self.weights[sl].view(t.shape)
            p.grad = self.grads[sl].view(t.shape)

    def zero_grad(self) -> None:
        self.grads.zero_()

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Leave the mean cross-entropy gradient of the mini-batch (x, y) in ``grads``; return the loss."""
        self.zero_grad()
        loss = nn.functional.cross_entropy(self.module(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return loss.item()

    def load(self, flat: np.ndarray) -> None:
        self.weights.numpy()[:] = np.reshape(flat, -1)  # one copy, converted to float32 on the way


@torch.no_grad()
def evaluate(module: nn.Module, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``module`` on ``x``, ``y``."""
    was_training = module.training
    module.eval()
    logits = module(torch.from_numpy(x))
    target = torch.from_numpy(y)
    loss = nn.functional.cross_entropy(logits, target).item()
    acc = (logits.argmax(1) == target).float().mean().item()
    module.train(was_training)
    return acc, loss


def evaluate_checkpoint(paths: Sequence[str], model: str = "mlp", dataset: str = "digits") -> dict[str, Any]:
    """Test accuracy and loss of the weights in a checkpoint (or in one checkpoint per shard
    of a sharded group, in any order), loaded into ``model``."""
    from .. import checkpoint

    states = sorted((checkpoint.load(p) for p in paths), key=lambda st: st.shard.index)
    shards = [str(st.shard) for st in states]
    count = states[0].shard.count
    if [st.shard.to_wire() for st in states] != [[i, count] for i in range(count)]:
        raise ConfigError(f"need one checkpoint for every shard of {count}, got shards {', '.join(shards)}")
    if any(st.layout != states[0].layout for st in states):
        raise ConfigError("the shards' checkpoints belong to different models")
    data = datasets.load(dataset)
    module = build_model(model, data, seed=0)
    flat = FlatModel(module)
    layout = states[0].layout
    if flat.layout.to_wire() != layout.to_wire():
        raise ConfigError(
            f"the checkpoint's parameters ({len(layout.tensors)} tensors, {layout.size} values) "
            f"are not those of model {model!r} on {dataset!r} ({flat.layout.size} values)"
        )
    flat.load(np.concatenate([st.weights for st in states]))
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


def build_model(model: str, dataset: datasets.Dataset, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # every learner builds identical initial weights
    module: nn.Module = models.resolve(model)(dataset.n_features, dataset.n_classes)
    return module


def run_learner(cfg: LearnerConfig) -> dict[str, Any]:
    """Train against the server at ``cfg.connect``; returns a summary of this learner's run."""
    opts = cfg.options
    torch.set_num_threads(opts.threads)
    data = datasets.load(opts.dataset)
    model = build_model(opts.model, data, opts.seed)
    flat = FlatModel(model)
    x_train, y_train = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    rng = np.random.default_rng([opts.seed, cfg.index])
    batches = datasets.minibatches(len(y_train), opts.batch_size, rng)
    started = tick = time.monotonic()
    steps, loss_value, reconnects = 0, float("nan"), 0
    tensorboard = open_log(opts.tensorboard, cfg.name or f"learner-{cfg.index}")
    with SyncClient(cfg.connect, flat.layout, flat.weights.numpy(), name=cfg.name, timeout=cfg.timeout) as client:
        client.set_weights_buffer(flat.weights.numpy())
        w = client.pull()
        while not w.stop and (opts.steps is None or steps < opts.steps):
            idx = torch.from_numpy(next(batches))
            loss_value = flat.gradient(x_train[idx], y_train[idx])
            stamp = w.timestamp
            try:
                w = client.push_pull(flat.grads.numpy(), w.timestamp, steps, len(idx), loss_value)
            except RemoteError as exc:
                if exc.code == "stopped":
                    break
                raise
            except TransportError as exc:
                if not opts.reconnect:
                    raise
                log.warning("lost the server (%s); reconnecting for up to %g s", exc, opts.reconnect)
                last = w.timestamp
                w = client.reconnect(opts.reconnect)  # this gradient is lost with the connection
                reconnects += 1
                if went_back(w.timestamp, last):
                    log.warning(
                        "the server's clock went back from %s to %s: it restarted without its checkpoint",
                        last,
                        w.timestamp,
                    )
                continue
            steps += 1
            tick, step_s = time.monotonic(), time.monotonic() - tick
            staleness = updates_between(stamp, w.timestamp)
            tensorboard.record(steps, loss=loss_value, staleness=staleness, samples_per_s=len(idx) / step_s)
        learner_id = client.learner_id
    tensorboard.close()
    accuracy, _ = evaluate(model, data.x_test, data.y_test)
    return {
        "learner_id": learner_id,
        "steps": steps,
        "reconnects": reconnects,
        "last_loss": loss_value,
        "test_accuracy": accuracy,
        "wall_s": time.monotonic() - started,
    }

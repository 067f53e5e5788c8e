"""Configuration objects. The CLI maps flags and RUDRA_ASYNC_* variables onto these."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .checkpoint import shard_path
from .errors import ConfigError
from .layout import Shard
from .wire import DEFAULT_MAX_BODY

DEFAULT_LISTEN = "tcp://127.0.0.1:7000"

#: built-in protocol -> (its option, the config field holding it)
PROTOCOL_OPTIONS = {"softsync": ("n", "n"), "bounded": ("s", "staleness_bound"), "backup": ("b", "backup")}


@dataclass
class ServerConfig:
    """What a :class:`~rudra_async.server.ParameterServer` needs.

    Optimizer: ``lr`` (α0), ``momentum``, ``weight_decay``, ``nesterov``. Protocol:
    ``protocol`` with ``n`` (softsync), ``staleness_bound`` (bounded), ``backup``
    (backup), or ``protocol_options`` for a plugin. LR: ``lr_policy`` and the schedule
    fields. ``max_updates`` ends the run: once the clock reaches it, replies carry
    ``stop`` and further gradients are refused with ``stopped``. Checkpoints: written to
    ``checkpoint`` every ``checkpoint_every`` updates and when the server closes; ``resume``
    names a checkpoint to start from (weights, momentum, clock, samples). ``shard``: which
    part of the model this server holds in a sharded group (see :class:`~rudra_async.layout.Shard`).
    """

    listen: list[str] = field(default_factory=lambda: [DEFAULT_LISTEN])
    protocol: str = "async"
    n: int | None = None
    staleness_bound: int | None = None
    backup: int | None = None
    protocol_options: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.03
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    lr_policy: str = "constant"
    mean_staleness_window: int = 0
    lr_policy_options: dict[str, Any] = field(default_factory=dict)
    lr_decay_at: tuple[float, ...] = ()
    lr_decay: float = 0.1
    lr_decay_unit: str = "updates"
    warmup: int = 0
    lr_scale_ref_batch: int | None = None
    samples_per_epoch: int | None = None
    max_updates: int | None = None
    max_frame: int = DEFAULT_MAX_BODY
    kernel: str = "auto"
    device: str = "auto"
    checkpoint: str | None = None
    checkpoint_every: int | None = None
    resume: str | None = None
    shard: Shard = field(default_factory=Shard)

    def validate(self) -> "ServerConfig":
        if not self.listen:
            raise ConfigError("the server needs at least one address to listen on")
        if not self.lr > 0:
            raise ConfigError(f"learning rate must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ConfigError(f"weight decay must be >= 0, got {self.weight_decay}")
        if self.nesterov and not self.momentum:
            raise ConfigError("nesterov needs momentum > 0")
        if self.max_updates is not None and self.max_updates < 1:
            raise ConfigError(f"max updates must be >= 1, got {self.max_updates}")
        if self.max_frame < 1024:
            raise ConfigError(f"max frame must be at least 1024 bytes, got {self.max_frame}")
        if self.checkpoint_every is not None and (self.checkpoint_every < 1 or not self.checkpoint):
            raise ConfigError(f"--checkpoint-every needs --checkpoint and a value >= 1, got {self.checkpoint_every}")
        if self.samples_per_epoch is not None and self.samples_per_epoch < 1:
            raise ConfigError(f"samples per epoch must be >= 1, got {self.samples_per_epoch}")
        if self.lr_decay_unit == "epochs" and self.lr_decay_at and not self.samples_per_epoch:
            raise ConfigError("epoch-based LR decay needs --samples-per-epoch")
        for proto, (_, attr) in PROTOCOL_OPTIONS.items():
            if getattr(self, attr) is not None and self.protocol != proto:
                flag = "--" + attr.replace("_", "-")
                raise ConfigError(f"{flag} applies only to --protocol {proto}, not {self.protocol}")
        for attr, low in (("n", 1), ("staleness_bound", 0), ("backup", 0)):
            value = getattr(self, attr)
            if value is not None and value < low:
                raise ConfigError(f"--{attr.replace('_', '-')} must be >= {low}, got {value}")
        return self

    def for_shard(self, shard: Shard, listen: str) -> "ServerConfig":
        """This configuration for one server of a shard group, listening at ``listen``; a
        ``{shard}`` in the checkpoint path becomes its index (:func:`~rudra_async.checkpoint.shard_path`)."""
        return replace(self, listen=[listen], shard=shard, checkpoint=shard_path(self.checkpoint, shard))

    def check_shards(self, count: int) -> None:
        """Settings a group of ``count`` shard servers cannot share (before any is started)."""
        shard_path(self.checkpoint, Shard(0, count))

    def protocol_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for the chosen protocol."""
        kwargs = dict(self.protocol_options)
        if self.protocol in PROTOCOL_OPTIONS:
            key, attr = PROTOCOL_OPTIONS[self.protocol]
            if getattr(self, attr) is not None:
                kwargs[key] = getattr(self, attr)
        return kwargs

    def lr_policy_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for the chosen LR policy."""
        kwargs = dict(self.lr_policy_options)
        if self.lr_policy == "mean-staleness" and self.mean_staleness_window:
            kwargs["window"] = self.mean_staleness_window
        return kwargs

    def check_learners(self, learners: int) -> None:
        """Combinations that depend on λ (known to ``train``, not to a bare server)."""
        if self.n is not None and self.n > learners:
            raise ConfigError(f"softsync needs n <= λ; got n = {self.n} with {learners} learners")
        if self.backup is not None and self.backup >= learners:
            raise ConfigError(f"backup needs b < λ; got b = {self.backup} with {learners} learners")

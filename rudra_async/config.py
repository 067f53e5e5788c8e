"""Configuration objects. The CLI maps flags and RUDRA_ASYNC_* variables onto these."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .wire import DEFAULT_MAX_BODY

DEFAULT_LISTEN = "tcp://127.0.0.1:7000"


@dataclass
class ServerConfig:
    """What a :class:`~rudra_async.server.ParameterServer` needs.

    ``lr``, ``momentum``, ``weight_decay`` and ``nesterov`` configure the server-side SGD.
    ``max_updates`` ends the run: once the clock reaches it, replies carry ``stop`` and
    further gradients are refused with ``stopped``.
    """

    listen: list[str] = field(default_factory=lambda: [DEFAULT_LISTEN])
    protocol: str = "async"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    max_updates: int | None = None
    max_frame: int = DEFAULT_MAX_BODY

    def validate(self) -> "ServerConfig":
        if not self.listen:
            raise ConfigError("the server needs at least one address to listen on")
        if self.protocol != "async":
            raise ConfigError(f"unknown protocol {self.protocol!r}; known: async")
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
        return self

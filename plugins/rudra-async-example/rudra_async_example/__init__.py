"""An example rudra-async plugin: copy this distribution to write your own.

- ``fixed-batch``: a protocol that updates every ``c`` gradients from any learners, whatever
  λ is (``--protocol fixed-batch --protocol-option c=3``).
- ``exp-staleness``: an LR policy α(σ) = α0 · γ^σ (``--lr-policy exp-staleness
  --lr-option gamma=0.7``).
- ``unix://``: a transport over Unix sockets (:mod:`rudra_async_example.unix`).

All are found through the entry points declared in this distribution's pyproject.toml.
"""

from __future__ import annotations

from typing import Any

from rudra_async.errors import ConfigError
from rudra_async.lr import LRPolicy
from rudra_async.sync import Softsync


class FixedBatch(Softsync):
    name = "fixed-batch"

    def __init__(self, c: int = 2, **kwargs: Any) -> None:
        super().__init__(n=1, **kwargs)
        if not isinstance(c, int) or c < 1:
            raise ConfigError(f"fixed-batch needs an integer c >= 1, got {c!r}")
        self.fixed_c = c

    @property
    def c(self) -> int:
        return self.fixed_c

    def describe(self) -> dict[str, Any]:
        return {"protocol": self.name, "c": self.fixed_c}


class ExpStaleness(LRPolicy):
    name = "exp-staleness"

    def __init__(self, gamma: float = 0.5) -> None:
        if not 0 < gamma <= 1:
            raise ConfigError(f"exp-staleness needs 0 < gamma <= 1, got {gamma}")
        self.gamma = gamma

    def factor(self, sigma: int) -> float:
        return self.gamma**sigma

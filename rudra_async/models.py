"""Model factories by name; ``module:function`` names any other factory.

A factory takes ``(n_features, n_classes)`` and returns a ``torch.nn.Module``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from .errors import ConfigError


def mlp(n_features: int, n_classes: int, hidden: int = 128) -> Any:
    """A one-hidden-layer perceptron: the default for digits."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


def softmax_regression(n_features: int, n_classes: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(n_features, n_classes))


MODELS: dict[str, Callable[..., Any]] = {"mlp": mlp, "linear": softmax_regression}


def resolve(name: str) -> Callable[..., Any]:
    """A factory by built-in name or ``module:function``."""
    if name in MODELS:
        return MODELS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load model factory {name!r}: {exc}") from None
    raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}, or module:function")

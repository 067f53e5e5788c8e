"""Model factories by name; ``module:function`` names any other factory.

A factory takes ``(n_features, n_classes)`` and returns a ``torch.nn.Module``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError


def mlp(n_features: int, n_classes: int, hidden: int = 128) -> Any:
    """A one-hidden-layer perceptron: the default for digits."""
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(n_features, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


def softmax_regression(n_features: int, n_classes: int) -> Any:
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(n_features, n_classes))


def cifar10_full(n_features: int, n_classes: int) -> Any:
    """Caffe's "cifar10_full" as the Rudra study used it (about 90k parameters):
    conv 5×5×32 (pad 2) → maxpool 3/2 → ReLU → LRN(3); conv 5×5×32 → ReLU → avgpool 3/2 →
    LRN(3); conv 5×5×64 → ReLU → avgpool 3/2; fc 1024 → classes. Expects 3×32×32 input."""
    from torch import nn

    if n_features != 3 * 32 * 32:
        raise ConfigError(f"cifar10_full expects 3x32x32 images, the data set has {n_features} features")
    return nn.Sequential(
        nn.Conv2d(3, 32, 5, padding=2),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.ReLU(),
        nn.LocalResponseNorm(3),
        nn.Conv2d(32, 32, 5, padding=2),
        nn.ReLU(),
        nn.AvgPool2d(3, 2, ceil_mode=True),
        nn.LocalResponseNorm(3),
        nn.Conv2d(32, 64, 5, padding=2),
        nn.ReLU(),
        nn.AvgPool2d(3, 2, ceil_mode=True),
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, n_classes),
    )


#: image shapes (channels, height, width) of the built-in data sets, by their number of features
IMAGE_SHAPES = {64: (1, 8, 8), 784: (1, 28, 28), 3072: (3, 32, 32)}


def bn_cnn(n_features: int, n_classes: int) -> Any:
    """A small CNN with BatchNorm for the built-in image data sets (digits, mnist5k,
    cifar10): two conv 3×3 → BatchNorm → ReLU → maxpool 2 blocks (16, 32 channels), then a
    linear classifier."""
    from torch import nn

    if n_features not in IMAGE_SHAPES:
        raise ConfigError(f"bn_cnn expects digits, mnist5k or cifar10 images, the data set has {n_features} features")
    channels, height, width = IMAGE_SHAPES[n_features]
    return nn.Sequential(
        nn.Unflatten(1, (channels, height, width)) if channels == 1 and height == 8 else nn.Identity(),
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), n_classes),
    )


MODELS: dict[str, Callable[..., Any]] = {
    "mlp": mlp,
    "linear": softmax_regression,
    "cifar10_full": cifar10_full,
    "bn_cnn": bn_cnn,
}


def resolve(name: str) -> Callable[..., Any]:
    """A factory by built-in name or ``module:function``."""
    if name in MODELS:
        return MODELS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory: Callable[..., Any] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"cannot load model factory {name!r}: {exc}") from None
        return factory
    raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}, or module:function")

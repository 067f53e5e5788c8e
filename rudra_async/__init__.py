"""rudra-async: an asyncio parameter server for distributed deep-learning training.

The public surface is listed in ``docs/api.md``: this package's names below, and the
modules ``wire``, ``errors``, ``layout``, ``sync``, ``lr``, ``transports``, ``kernels``,
``client``, ``config``, ``checkpoint``, ``testing``, ``monitor`` and ``torch`` (the PyTorch
API). Everything else is internal.
Importing ``rudra_async`` loads only the error classes; the rest loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CheckpointError,
    ConfigError,
    ConnectError,
    ConnectionClosed,
    LearnerError,
    PeerGone,
    RemoteError,
    RequestError,
    RudraError,
    RunStopped,
    TransportError,
    UpdateFailed,
    WireError,
)

__version__ = "0.1.0"

__all__ = [  # noqa: RUF022 (grouped: the entry points, then the errors)
    "__version__",
    "ServerConfig",
    "ParameterServer",
    "Client",
    "SyncClient",
    "train",
    # errors
    "RudraError",
    "ConfigError",
    "WireError",
    "RequestError",
    "TransportError",
    "ConnectError",
    "ConnectionClosed",
    "PeerGone",
    "RemoteError",
    "CheckpointError",
    "LearnerError",
    "UpdateFailed",
    "RunStopped",
]

#: lazily imported names -> the module that defines them, and the name there
_LAZY = {
    "ServerConfig": (".config", "ServerConfig"),
    "ParameterServer": (".server", "ParameterServer"),
    "Client": (".client", "Client"),
    "SyncClient": (".client", "SyncClient"),
    "train": (".runs.train", "run_train"),
}


def __getattr__(name: str) -> Any:  # lazy, so `import rudra_async` stays light
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module, __name__), attr)
    raise AttributeError(f"module 'rudra_async' has no attribute {name!r}")

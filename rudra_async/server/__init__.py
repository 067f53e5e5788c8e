"""The parameter server: an asyncio shell (listeners, sessions, waiting, checkpoints) over
an I/O-free core (:mod:`rudra_async.server.core`). ``ParameterServer`` loads on first use,
so that importing the core loads no event loop, socket or TLS."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .parameter_server import ParameterServer

__all__ = ["ParameterServer"]


def __getattr__(name: str) -> Any:
    if name == "ParameterServer":
        return importlib.import_module(".parameter_server", __name__).ParameterServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

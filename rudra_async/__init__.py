"""rudra-async: an asyncio parameter server for distributed deep-learning training."""

from __future__ import annotations

__version__ = "0.1.0"

from .config import ServerConfig  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    ConfigError,
    ConnectError,
    ConnectionClosed,
    PeerGone,
    RemoteError,
    RequestError,
    RudraError,
    TransportError,
    WireError,
)

__all__ = [
    "__version__",
    "ServerConfig",
    "ParameterServer",
    "Client",
    "SyncClient",
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
]


def __getattr__(name: str):  # lazy, so `import rudra_async` stays light
    if name == "ParameterServer":
        from .server import ParameterServer

        return ParameterServer
    if name in ("Client", "SyncClient"):
        from . import client

        return getattr(client, name)
    raise AttributeError(name)

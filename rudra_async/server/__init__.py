"""The parameter server: an asyncio shell (listeners, sessions, waiting, checkpoints) over
an I/O-free core."""

from .parameter_server import ParameterServer

__all__ = ["ParameterServer"]

"""The one exception hierarchy of rudra-async.

Every error that crosses a module boundary is a :class:`RudraError`. Errors that travel
over the wire carry a stable string ``code`` (see ``docs/wire.md``); the same code names
the error on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "BadMagic",
    "BadVersion",
    "CheckpointError",
    "ConfigError",
    "ConnectError",
    "ConnectionClosed",
    "FrameTooLarge",
    "LearnerError",
    "MalformedFrame",
    "PeerGone",
    "RemoteError",
    "RequestError",
    "RudraError",
    "RunStopped",
    "ServerBusy",
    "TransportError",
    "TryLater",
    "Unreachable",
    "UpdateFailed",
    "WireError",
]


#: characters of peer input an error message quotes (it goes into a log line and an ERROR reply)
QUOTED_MAX = 80


def quoted(value: Any) -> str:
    """``repr(value)``, cut to :data:`QUOTED_MAX` characters: how an error message quotes
    what a peer sent (which may be megabytes)."""
    shown = repr(value)
    return shown if len(shown) <= QUOTED_MAX else shown[: QUOTED_MAX - 3] + "..."


class RudraError(Exception):
    """Base of every error raised by rudra-async."""

    code = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(RudraError):
    """A configuration value or combination is invalid (raised before any I/O)."""

    code = "config"


class WireError(RudraError):
    """A frame violates the wire format. ``fatal`` means the byte stream lost sync.
    ``finished``: frames a :class:`~rudra_async.wire.FrameReader` completed from the same
    bytes before the error (deliver them first)."""

    code = "malformed"
    fatal = True
    finished: Sequence[Any] = ()

    def take_finished(self) -> Sequence[Any]:
        """:attr:`finished`, handed over once (the error, which may be kept, holds no frames after)."""
        finished, self.finished = self.finished, ()
        return finished


class BadMagic(WireError):
    code = "bad_magic"


class BadVersion(WireError):
    code = "bad_version"


class FrameTooLarge(WireError):
    """``msg_type``: the refused frame's type, when its header could be read."""

    code = "frame_too_large"

    def __init__(self, message: str, *, code: str | None = None, msg_type: int | None = None) -> None:
        super().__init__(message, code=code)
        self.msg_type = msg_type


class MalformedFrame(WireError):
    code = "malformed"


class RequestError(RudraError):
    """A well-formed request the server refuses; the connection stays usable."""

    code = "bad_request"


class TransportError(RudraError):
    """Moving bytes failed."""

    code = "transport"


class ConnectionClosed(TransportError):
    """This side closed the connection (or the listener) and then used it."""

    code = "closed"


class PeerGone(TransportError):
    """The peer went away or the connection broke (including mid-frame)."""

    code = "peer_gone"


class ConnectError(TransportError):
    """Connecting or binding failed at once (refused, unknown host, port in use)."""

    code = "connect"


class TryLater(ConnectError):
    """The server could not take this connection now, and may later: a learner with
    ``--reconnect`` (``reconnect=``, ``SyncClient(wait=)``) tries again."""

    code = "try_later"


class Unreachable(TryLater):
    """Nothing answered at the address (connection refused, no such name, no answer within
    the timeout): the server may not be up yet."""

    code = "unreachable"


class ServerBusy(TryLater):
    """The server refused the connection for want of room (``--max-connections``, or it
    closed the oldest of too many connections that had not said hello): its ERROR's code
    (``too_many_connections``, ``evicted``) is :attr:`reason`."""

    code = "server_busy"

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class CheckpointError(RudraError):
    """A checkpoint cannot be written, or a file is not a complete, intact checkpoint."""

    code = "bad_checkpoint"


class UpdateFailed(RudraError):
    """Computing an update of the weights raised (a kernel's error, memory exhausted): the
    weights are undefined from then on, so the server stops and writes no checkpoint of them."""

    code = "update_failed"


class RunStopped(RudraError):
    """A local run (``rudra-async train``) was stopped by a signal (SIGINT, SIGTERM), in
    order: its learners stopped, its final checkpoint written. ``results``: what the run had
    reached (the dict ``--results`` writes, with ``"stopped_by"`` the signal's name), or None
    if it had no model yet."""

    code = "run_stopped"

    def __init__(self, message: str, results: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.results = results


class LearnerError(RudraError):
    """A learner cannot go on with what it was given: a model, data or loss function that
    does not fit (a parameter without a gradient, a loss that is not a scalar, ...)."""

    code = "learner"


class RemoteError(RudraError):
    """The server answered a request with an error message; ``code`` is its stable code."""

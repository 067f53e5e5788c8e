"""The transport contract: move whole frames between two endpoints.

A transport module provides ``connect(url, limits, timeout)`` returning a
:class:`Connection` and ``listen(url, on_connection, limits)`` returning a
:class:`Listener`. Everything above this layer speaks frames, never bytes.
"""
from __future__ import annotations

import abc
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from ..wire import Allocator, Frame


class Connection(abc.ABC):
    """One bidirectional, ordered stream of frames.

    - ``send`` returns once the frame has been handed to the operating system, so the
      caller may reuse (or let others modify) the arrays it passed afterwards.
    - ``recv`` returns frames in the order they were sent. It raises
      :class:`~rudra_async.errors.PeerGone` when the peer closed or the link broke
      (including in the middle of a frame), :class:`~rudra_async.errors.ConnectionClosed`
      after a local ``close``, and a fatal :class:`~rudra_async.errors.WireError` when the
      incoming byte stream is not valid framing (the connection is then unusable).
    - ``close`` is idempotent and never raises.
    - Reading pauses when unconsumed frames pile up (back-pressure on the sender).
    """

    peer: str = "?"
    allocator: Allocator | None = None

    @abc.abstractmethod
    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        ...

    @abc.abstractmethod
    async def recv(self) -> Frame:
        ...

    @abc.abstractmethod
    def close(self) -> None:
        ...

    @property
    @abc.abstractmethod
    def is_closed(self) -> bool:
        ...

    @abc.abstractmethod
    async def wait_lost(self) -> None:
        """Return once the connection is closed (locally) or lost (peer gone), without reading.

        Lets a server notice a learner's death while it waits on something else.
        """


class Listener(abc.ABC):
    """Accepts connections and hands each to the ``on_connection`` coroutine given to ``listen``."""

    #: the URL peers can connect to (with the real port when 0 was asked for)
    address: str

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting, close every accepted connection, wait for their handlers. Idempotent."""


OnConnection = Callable[[Connection], Awaitable[None]]

"""What every connection keeps, without I/O: the frames received and not yet taken, how the
connection ended, and the bytes counted.

Both the asyncio :class:`~.base.Connection` and the blocking
:class:`~.blocking.BlockingConnection` keep a :class:`ConnectionCore` and differ only in how
they wait (an event, a blocking read); the rules are here once:

- frames are taken in the order they arrived; a fatal framing error is queued after the
  frames that came before it, nothing is queued after it, and taking it raises it — on
  every later call too (the connection is unusable from there on), until the peer is
  known to be gone: the error is then raised once more and its ``PeerGone`` after it;
- after a local close nothing is taken (``ConnectionClosed``) and the queued frames are
  released; once the peer is gone, the frames already queued are still taken, then its
  ``PeerGone`` is raised;
- the inbox is *full* at a number of frames or of body bytes (one frame always fits).
"""

from __future__ import annotations

import collections
import copy
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import ConnectionClosed, PeerGone, RudraError, WireError
from ..wire import Frame, FrameReader

E = TypeVar("E", bound=RudraError)


class ConnectionCore:
    """The inbox and the end of one connection, and its byte counts (see the module docstring)."""

    def __init__(self, inbox_frames: int = 8, inbox_bytes: int = sys.maxsize) -> None:
        #: the inbox is full at this many unconsumed frames ...
        self.inbox_frames = inbox_frames
        #: ... or this many bytes of unconsumed bodies, whichever comes first
        self.inbox_bytes = inbox_bytes
        self.inbox: collections.deque[Frame | WireError] = collections.deque()
        self.inbox_nbytes = 0
        self.closed = False
        #: why the peer is gone (None: not known to be)
        self.lost: PeerGone | None = None
        #: the fatal framing error queued, after which nothing more is
        self.fatal: WireError | None = None
        #: bytes received and sent: the frames as they travel (header, metadata, body)
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def ended(self) -> bool:
        """Closed here, or the peer known to be gone."""
        return self.closed or self.lost is not None

    @property
    def accepting(self) -> bool:
        """Whether a frame arriving now is queued: not after a close or a fatal error."""
        return not self.closed and self.fatal is None

    @property
    def taking(self) -> bool:
        """False once the connection takes no more frames (closed, lost, or a fatal error)."""
        return not self.ended and self.fatal is None

    @property
    def full(self) -> bool:
        """True while the transport must not take more frames."""
        n = len(self.inbox)
        return n >= self.inbox_frames or (n > 0 and self.inbox_nbytes >= self.inbox_bytes)

    def queue(self, item: Frame | WireError) -> bool:
        """Queue a received frame, or a fatal framing error; False (a frame released) where
        nothing is :attr:`accepting`."""
        if not self.accepting:
            if isinstance(item, Frame):
                item.release()
            return False
        if isinstance(item, WireError):
            self.fatal = item
        else:
            self.inbox_nbytes += item.body.nbytes
        self.inbox.append(item)
        return True

    def next(self) -> Frame | None:
        """The next frame, or None while none is queued and more may come. Raises
        ConnectionClosed after a close, the fatal error once it is next (see the module
        docstring), and the peer's PeerGone once nothing before it is left."""
        if self.closed:
            raise ConnectionClosed("connection closed locally")
        if self.inbox:
            item = self.inbox[0]
            if isinstance(item, WireError):
                if self.lost is not None:  # raised this once more, then the PeerGone
                    self.inbox.popleft()
                raise fresh(item)  # else it stays: the connection is unusable from here on
            self.inbox.popleft()
            self.inbox_nbytes -= item.body.nbytes
            return item
        if self.lost is not None:
            raise fresh(self.lost)
        return None

    def read(self, reader: FrameReader, nbytes: int) -> list[Frame | WireError]:
        """Count ``nbytes`` written into ``reader.get_buffer()`` and return what they
        complete: frames, then the fatal error they raised, if any."""
        self.bytes_in += nbytes
        return collect(lambda: reader.advance(nbytes))

    def sending(self, parts: Sequence[bytes | memoryview]) -> None:
        """Count an encoded frame's buffers as sent."""
        self.bytes_out += sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)

    def check_open(self) -> None:
        """Raise ConnectionClosed after a local close, or the PeerGone that ended the connection."""
        if self.closed:
            raise ConnectionClosed("connection closed locally")
        if self.lost is not None:
            raise fresh(self.lost)

    def lose(self, reason: PeerGone) -> None:
        """The peer is gone (the first reason stays)."""
        if self.lost is None:
            self.lost = reason

    def close(self) -> bool:
        """Close: release every queued frame. True the first time, False after."""
        if self.closed:
            return False
        self.closed = True
        while self.inbox:
            item = self.inbox.popleft()
            if isinstance(item, Frame):
                item.release()
        self.inbox_nbytes = 0
        return True


def fresh(exc: E) -> E:
    """A copy of a stored exception to raise: raising the stored one would hang the
    traceback (and every frame and buffer it holds) on the connection, a reference cycle
    that only the cycle collector would break."""
    copied = copy.copy(exc)
    copied.__traceback__ = None
    return copied


def collect(produce: Callable[[], list[Frame]]) -> list[Frame | WireError]:
    """The frames ``produce()`` returns, or those it finished and then the fatal error it raised."""
    try:
        return list(produce())
    except WireError as exc:
        return [*exc.take_finished(), exc]

"""The blocking side of the shm transport (a learner without an event loop): the same bytes
as :class:`~.connection.ShmConnection` over a blocking Unix socket."""

from __future__ import annotations

import collections
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import (
    FrameTooLarge,
    WireError,
    quoted,
)
from ...wire import Frame, Limits, MsgType
from ..blocking import BlockingConnection
from . import segments
from .segments import (
    _PROGRESS,
    _REF,
    PROGRESS_POLL_S,
    RECHECK_S,
    RELEASE,
    _Attached,
    _lent,
    _not_hung_up,
    _notice_fields,
    _Outgoing,
    _Segment,
    _shared_body,
    _word_at,
    peer_uid,
    release_notice,
    resolve_reference,
)


class BlockingShmConnection(BlockingConnection):
    """The blocking form of :class:`ShmConnection`, for a learner without an event loop: the
    same bytes over a blocking Unix socket, large bodies through the same shared-memory
    segments. RELEASE notices are read (and acted on) as they arrive between replies."""

    def __init__(self, sock: socket.socket, limits: Limits, peer: str) -> None:
        super().__init__(sock, limits, peer)
        self._out = _Outgoing()
        self._in: dict[str, _Attached] = {}
        self._held: collections.deque[Frame] = collections.deque()  # read while waiting for a RELEASE
        self._peer_uid = peer_uid(sock)  # the server's user: the owner of the segments it refers to
        self._write_ahead = False  # the server's WELCOME said it reads progress words of pushes

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self.core.check_open()
        if msg_type == MsgType.HELLO and segments.ORDERED_STORES:  # weights may come while they are computed
            meta = {**(meta or {}), _PROGRESS: True}
        shared = _shared_body(arrays, self.limits)
        if shared is None:
            await super().send(msg_type, meta, arrays)
            return
        body, specs = shared
        ahead = msg_type == MsgType.PUSH and self._write_ahead and body >= segments.WRITE_AHEAD_MIN
        at = _word_at(body)  # the progress word of a body written after its reference
        seg = await self._segment(at + 8 if ahead else body)
        ticket = seg.lend()
        word = seg.word(at) if ahead else None
        if word is None:
            seg.write(arrays)
        else:
            word[0] = 0
            meta = {**(meta or {}), _PROGRESS: at}
        try:
            await super().send(msg_type, {**(meta or {}), _REF: [seg.shm.name, body, specs, 0, ticket]})
        except FrameTooLarge:  # the metadata: nothing went out, the segment stays free
            seg.busy = False
            raise
        if word is not None:  # the server checks each piece as the word says it is written
            try:
                seg.write(arrays, word)
            except BaseException:
                word[0] = -1
                raise

    async def _segment(self, nbytes: int) -> _Segment:
        """A free segment of at least ``nbytes``; while every one is still being read, take
        frames (kept for :meth:`recv`) until one comes back."""
        seg = self._out.reserve(nbytes)
        if seg is None:
            with self._out.waiting():
                while (seg := self._out.reserve(nbytes)) is None:
                    if self._readable(RECHECK_S) and (frame := await self._one()) is not None:
                        self._held.append(frame)
        return seg

    async def recv(self) -> Frame:
        return self._held.popleft() if self._held else await self._next()

    async def _next(self) -> Frame:
        """The next frame but RELEASE notices (handled here), its body resolved in place."""
        while (frame := await self._one()) is None:
            pass
        return frame

    async def _one(self) -> Frame | None:
        """The next frame, its body resolved in place; None for a RELEASE notice (handled here)."""
        frame = await super().recv()
        if frame.msg_type == RELEASE:
            fields = _notice_fields(frame.meta)
            if fields is not None:
                self._out.released(fields[0], fields[2])
            return None
        if frame.msg_type == MsgType.WELCOME and frame.meta.get(_PROGRESS) is True:
            self._write_ahead = segments.ORDERED_STORES
        if _REF not in frame.meta:
            return frame
        resolved = resolve_reference(frame, self.limits, lambda header: None, self._in, self._release, self._peer_uid)
        if isinstance(resolved, WireError):
            self._gone(f"the server sent a frame beyond the limits: {resolved}")
            raise resolved
        if _PROGRESS in resolved.meta and resolved.error is None:
            return self._follow(resolved, frame.meta[_REF][0], resolved.meta[_PROGRESS])
        if resolved.error is None and _lent(frame.meta[_REF]):
            resolved.lent = self._still_open
        return resolved

    def _still_open(self) -> bool:
        """Whether the server still lends what it sent by reference (see ``Frame.lent``)."""
        return not self.is_closed and _not_hung_up(self._sock)

    def _follow(self, frame: Frame, name: str, at: Any) -> Frame:
        """A body the server still computes, copied out of segment ``name`` (into the
        allocator's buffer, or a new one) as the int64 progress word at byte ``at`` says its
        bytes are final; the reference is released once all are. -1 in the word, or the
        server gone meanwhile, raises PeerGone."""
        shm, n = self._in[name], frame.body.nbytes
        word = shm.word(at, 0, shm.size)
        if word is None:
            frame.release()
            raise self._gone(f"the server sent a bad progress word position {quoted(at)}")
        target = self.allocator(frame.msg_type, frame.meta, n) if self.allocator is not None else None
        out = np.empty(n, np.uint8).data if target is None else target.cast("B")
        done, gone = 0, False
        try:
            while done < n:
                final = min(int(word[0]), n)
                if final < 0 or (gone and final == done):  # the word is read once more after a hang-up
                    failed = "the server's computation of these weights failed"
                    raise self._gone(failed if final < 0 else "the server went away while sending weights")
                if final > done:
                    out[done:final] = frame.body[done:final]
                    done = final
                else:
                    gone = self._hung_up(PROGRESS_POLL_S)
            if not self._still_open():  # the lease may have ended during the copy (Frame.lent)
                raise self._gone("the server went away while its weights were being copied")
        finally:
            del word
            frame.release()
        return Frame(frame.msg_type, frame.meta, out, frame.specs)

    def _hung_up(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if the socket closes; True if it has (bytes that arrive
        meanwhile stay for the next read)."""
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLRDHUP)
        if not poller.poll(seconds * 1000):
            return False
        try:
            if self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                return True
        except BlockingIOError:
            return False
        except OSError:
            return True
        time.sleep(seconds)  # a frame waits to be read (later): the socket says no more now
        return False

    def _readable(self, seconds: float) -> bool:
        """True if a frame is ready or bytes arrive within ``seconds``."""
        if self.core.inbox:
            return True
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(seconds * 1000))

    def _release(self, name: str, offset: int, ticket: int | None) -> None:
        notice = release_notice(self._in, name, offset, ticket)
        if notice is not None and not self.is_closed:
            try:
                self._sock.sendall(b"".join(notice))
            except OSError:
                pass  # the connection is gone: nobody waits for the segment any more

    def close(self) -> None:
        if not self.core.closed:
            while self._held:
                self._held.popleft().release()
        super().close()
        self._out.destroy()
        for shm in self._in.values():
            shm.close()
        self._in.clear()

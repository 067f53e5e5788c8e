"""The asyncio side of the shm transport: a stream connection over a Unix socket whose
large bodies travel by reference to shared memory (:mod:`.segments`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...errors import (
    FrameTooLarge,
    MalformedFrame,
    PeerGone,
    WireError,
    quoted,
)
from ...wire import Frame, Limits, MsgType
from .. import offload
from ..offload import Gate
from ..stream import OnMade, StreamConnection
from . import segments
from .segments import (
    _PROGRESS,
    _REF,
    CONTROL,
    INLINE,
    RECHECK_S,
    RELEASE,
    _Attached,
    _lent,
    _not_hung_up,
    _notice_fields,
    _Outgoing,
    _Segment,
    _shared_body,
    exported,
    peer_uid,
    release_notice,
    resolve_reference,
)


class ShmConnection(StreamConnection):
    """A stream connection over a Unix socket whose large bodies travel in shared memory:
    a body reference is resolved as it arrives, and RELEASE notices never reach the inbox."""

    def __init__(self, limits: Limits, *, peer: str, on_made: OnMade | None = None) -> None:
        super().__init__(limits, peer=peer, on_made=on_made)
        self._out = _Outgoing()
        self._in: dict[str, _Attached] = {}
        self._freed = asyncio.Event()
        self._lent: dict[tuple[str, int], asyncio.Future[None]] = {}  # exported bodies out
        self._follows_progress = False  # the HELLO the WELCOME answers said it follows progress words
        self._welcomed = False
        self._peer_uid = -1  # the peer's user, the owner of the segments it refers to (once connected)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._peer_uid = peer_uid(transport.get_extra_info("socket"))
        super().connection_made(transport)

    # -- receiving -------------------------------------------------------------------------
    def _deliver(self, item: Frame | WireError) -> None:
        if isinstance(item, Frame):
            if item.msg_type == RELEASE:
                self._released(item)
                return
            if item.msg_type == MsgType.HELLO and not self._welcomed:  # the last HELLO before the WELCOME
                self._follows_progress = item.meta.get(_PROGRESS) is True
            if _REF in item.meta:
                super()._deliver(self._resolve(item))
                return
        super()._deliver(item)

    def _released(self, frame: Frame) -> None:
        """A RELEASE notice: the segment, or the exported memory, it names is free again.
        A notice with fields of the wrong type is ignored (it frees nothing)."""
        fields = _notice_fields(frame.meta)
        if fields is None:
            return
        name, offset, ticket = fields
        if self._out.released(name, ticket):
            self._freed.set()
        waiter = self._lent.pop((name, offset), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resolve(self, frame: Frame) -> Frame | WireError:
        resolved = resolve_reference(frame, self.limits, self._admit, self._in, self._release, self._peer_uid)
        if isinstance(resolved, Frame) and resolved.error is None:
            if _PROGRESS in resolved.meta and frame.msg_type != MsgType.HELLO:  # in a HELLO: the flag
                return self._being_written(resolved, frame.meta[_REF])
            self.bytes_in += resolved.body.nbytes  # the body came through shared memory
            if _lent(frame.meta[_REF]):
                resolved.lent = self._still_open
        return resolved

    def _still_open(self) -> bool:
        transport = self._transport
        return not self.is_closed and transport is not None and _not_hung_up(transport.get_extra_info("socket"))

    def _reads_progress(self) -> bool:
        """Whether this end reads the progress words of pushes written after their reference
        (said in the WELCOME to a peer whose HELLO said it follows progress words)."""
        return segments.ORDERED_STORES and self._follows_progress

    def _being_written(self, frame: Frame, ref: list[Any]) -> Frame | WireError:
        """A PUSH whose sender writes its body after sending the reference: the frame, whose
        ``written`` reads the body's progress word (in the sender's segment, after the body);
        a fatal error where this end did not allow it or the word is misplaced."""
        at, nbytes = frame.meta.pop(_PROGRESS), frame.body.nbytes
        start = ref[3] if len(ref) > 3 else 0
        shm = self._in[ref[0]]
        word = shm.word(at, start + nbytes, shm.size - CONTROL)
        if not (frame.msg_type == MsgType.PUSH and self._reads_progress()):
            error = 'a body written after its reference ("~progress") in a frame other than a PUSH, or unannounced'
        elif word is None:
            error = f"bad progress word position {quoted(at)} for a body at [{start}, {start + nbytes})"
        else:
            frame.written = functools.partial(self._written, word, nbytes)
            self.bytes_in += nbytes
            return frame
        frame.release()
        return MalformedFrame(error)

    def _written(self, word: np.ndarray, nbytes: int) -> int:
        """How many of a pushed body's ``nbytes`` its progress ``word`` says are written."""
        if self.is_closed:
            raise PeerGone("the learner went away while writing its gradient")
        final = int(word[0])
        if final < 0:
            raise PeerGone("the learner could not write its gradient")
        return min(final, nbytes)

    def _release(self, name: str, offset: int, ticket: int | None) -> None:
        notice = release_notice(self._in, name, offset, ticket)
        if notice is not None and not self.is_closed and self._transport is not None:
            self._write_soon(notice)

    # -- sending ---------------------------------------------------------------------------
    async def _segment_for(self, arrays: Sequence[np.ndarray], nbytes: int) -> tuple[_Segment, int]:
        taken = self._out.take(arrays, nbytes)
        if taken is not None:
            return taken
        with self._out.waiting():
            while (taken := self._out.take(arrays, nbytes)) is None:
                self._freed.clear()
                try:  # set by a RELEASE notice or when the connection ends; else look again
                    await asyncio.wait_for(self._freed.wait(), RECHECK_S)
                except asyncio.TimeoutError:
                    pass
                self._check_open()
        return taken

    def _end(self) -> None:
        """Closed or lost: no RELEASE will come, so wake every sender waiting for a segment
        (those waiting for lent memory wake once the socket is closed: :meth:`connection_lost`)."""
        super()._end()
        self._freed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        """The socket is closed, so the peer sees it hung up before anything lent to it can
        change (see ``Frame.lent``): the memory is ours again."""
        super().connection_lost(exc)
        for waiter in self._lent.values():
            if not waiter.done():
                waiter.set_result(None)
        self._lent.clear()

    def sends_computing(self, body_bytes: int) -> bool:
        """For a peer that follows progress words (its HELLO said so) and a body that goes by
        reference, on a machine with ordered stores: the reference goes out at once and the
        peer copies each byte once the body's progress word says it is final. Otherwise
        never: the stream way would move every byte through the socket."""
        return segments.ORDERED_STORES and self._follows_progress and body_bytes > INLINE and not self.is_closed

    async def send_computing(
        self, msg_type: int, meta: dict[str, Any] | None, arrays: Sequence[np.ndarray], gate: Gate
    ) -> None:
        """Send exported memory by reference while it is computed: its progress word is set to
        what is final now, before the reference goes out, then follows ``gate`` (from a
        thread) until all of it is, or says -1 if the computation fails. A body that is not
        one whole exported allocation waits until it is final and goes the usual way."""
        self._check_open()
        shared = _shared_body(arrays, self.limits)
        where = exported.locate_body(arrays) if shared else None
        found = exported.progress_word(where, shared[0]) if shared and where else None
        if shared is None or where is None or found is None:
            await asyncio.to_thread(offload.wait_final, gate, sum(a.nbytes for a in arrays))
            await self.send(msg_type, meta, arrays)
            return
        body, specs = shared
        try:
            found.follow(
                gate,
                body,
                self._thread_stop,
                functools.partial(asyncio.get_running_loop().call_soon_threadsafe, self.close),
            )
        except Exception:  # the computation failed already: this frame can never be completed
            self.close()
            raise
        await self._send_exported(msg_type, {**(meta or {}), _PROGRESS: found.at}, where, body, specs)

    def nowait_room(self, body_bytes: int) -> bool:
        """Only a body that goes inline is sent without waiting (a shared one waits for a segment)."""
        return body_bytes <= INLINE and super().nowait_room(body_bytes)

    async def send(self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()) -> None:
        self._check_open()
        if msg_type == MsgType.WELCOME:
            self._welcomed = True
            if self._reads_progress():  # pushes may come before they are written
                meta = {**(meta or {}), _PROGRESS: True}
        shared = _shared_body(arrays, self.limits)
        if shared is None:
            await super().send(msg_type, meta, arrays)
            return
        body, specs = shared
        where = exported.locate_body(arrays)
        if where is not None:
            await self._send_exported(msg_type, meta, where, body, specs)
            return
        seg, ticket = await self._segment_for(arrays, body)
        try:
            await super().send(msg_type, {**(meta or {}), _REF: [seg.shm.name, body, specs, 0, ticket]})
        except FrameTooLarge:  # the metadata: nothing went out, the segment stays free
            seg.busy = False
            raise
        self.bytes_out += body  # the body goes through shared memory

    async def _send_exported(
        self, msg_type: int, meta: dict[str, Any] | None, where: tuple[str, int], body: int, specs: list[Any]
    ) -> None:
        """Send exported memory at ``where`` (segment name, offset) by reference, without a
        copy; return once the peer released it (a RELEASE notice) or the connection ended."""
        name, offset = where
        waiter = self._lent[where] = asyncio.get_running_loop().create_future()
        try:
            await super().send(msg_type, {**(meta or {}), _REF: [name, body, specs, offset]})
        except FrameTooLarge:  # the metadata: nothing went out, nothing is lent
            self._lent.pop(where, None)
            raise
        self.bytes_out += body  # the body goes through shared memory
        try:
            await waiter
        except asyncio.CancelledError:
            # The caller's lease on the memory ends as this returns, while the peer may still
            # copy it: it must see the socket hung up first (Frame.lent), so shut it down now.
            self._lent.pop(where, None)
            self._shut_down_socket()
            self.close()
            raise
        self._check_open()

    def _close_link(self) -> None:
        super()._close_link()
        self._out.destroy()
        for shm in self._in.values():
            shm.close()
        self._in.clear()

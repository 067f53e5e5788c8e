"""The shared memory of the shm transport: segments and their control blocks, progress
words, the peer segments a connection has mapped, body references, and the process-wide
exported memory (the server's weights). No sockets here: :mod:`.connection` and
:mod:`.blocking` move the references. The format is described in the package docstring."""

from __future__ import annotations

import _posixshmem
import atexit
import contextlib
import functools
import mmap
import os
import platform
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from ...errors import (
    ConnectionClosed,
    FrameTooLarge,
    MalformedFrame,
    WireError,
    quoted,
)
from ...wire import Frame, Header, Limits, encode_frame, is_int, parse_segments, spec_of
from .. import offload
from ..base import SharedMemory
from ..offload import Gate

INLINE = 16 * 1024  # bodies up to this size go through the socket
MAX_SEGMENTS = 4  # bodies one side may have outstanding before send waits
MAX_ATTACHED = 4 * MAX_SEGMENTS  # peer segments kept mapped; the oldest mapping goes beyond
RELEASE = 250  # internal message type: "I am done with your segment"
#: bytes at the end of a segment: [released ticket, sender waits] as int64, 8-byte aligned
CONTROL = 16
RECHECK_S = 0.002  # a sender waiting for a segment looks at the tickets again this often
PROGRESS_POLL_S = 0.001  # a learner copying a body being computed looks at its progress this often
_REF = "~shm"  # metadata key of a body reference
#: metadata key of a reference to a body still being computed (the position of its progress
#: word); in a HELLO, the learner's "I follow progress words"
_PROGRESS = "~progress"
#: whether this machine shows another process one thread's stores in the order they were
#: made (x86's total store order): a body's bytes before the progress word that covers them.
#: Only then is a body sent while it is computed; elsewhere replies wait for the update.
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
#: a blocking learner sends the reference of a PUSH at least this large before writing its
#: body, to a server whose WELCOME says it reads progress words (the server then checks each
#: piece as it is written)
WRITE_AHEAD_MIN = 16 << 20
#: bytes a body written after its reference is written in, its progress word stored after each
WRITE_PIECE = 8 << 20
#: orders a piece's bytes before the progress word that covers them: a locked instruction
#: (taking a lock) also drains the write-combining buffers of a memcpy's non-temporal
#: stores, which x86's store order does not cover
_FENCE = threading.Lock()


def _word_at(nbytes: int) -> int:
    """Where an int64 word after ``nbytes`` at a segment's start goes (a body's progress
    word, a segment's control block): the first 8-byte boundary after them."""
    return -(-nbytes // 8) * 8


class _Exported(SharedMemory):
    """Process-wide shared memory that connections can send by reference, without a copy.

    The server allocates its published weight buffers here when it listens on shm, so a
    pull moves only a reference and the learner makes the one copy into its model.
    """

    def __init__(self) -> None:
        self.segments: dict[str, _Segment] = {}

    def allocate(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of exported memory, followed in its segment by the int64 progress word
        of a body sent while it is computed (:meth:`progress_word`)."""
        at = _word_at(max(nbytes, 1))
        seg = _Segment(at + 8)
        seg.progress = _ProgressWord(seg, at)
        self.segments[seg.shm.name] = seg
        view: np.ndarray = seg.array[:nbytes]
        return view

    def progress_word(self, where: tuple[str, int], nbytes: int) -> _ProgressWord | None:
        """The progress word of the allocation that is exactly the ``nbytes`` at ``where``
        (segment name, offset: :meth:`locate`'s); None for any other body."""
        seg, offset = self.segments.get(where[0]), where[1]
        if seg is None or seg.progress is None or offset or _word_at(nbytes) != seg.progress.at:
            return None
        return seg.progress

    def locate_body(self, arrays: Sequence[np.ndarray]) -> tuple[str, int] | None:
        """:meth:`locate` of a body that is one contiguous array; None for any other body."""
        return self.locate(arrays[0]) if len(arrays) == 1 and arrays[0].flags.c_contiguous else None

    def locate(self, array: np.ndarray) -> tuple[str, int] | None:
        """(segment name, byte offset) if ``array`` lies inside an exported segment."""
        start = array.__array_interface__["data"][0]
        for name, seg in self.segments.items():
            base = seg.array.__array_interface__["data"][0]
            if base <= start and start + array.nbytes <= base + seg.size:
                return name, start - base
        return None

    def free(self, array: np.ndarray) -> None:
        where = self.locate(array)
        if where is not None:
            self.segments.pop(where[0]).destroy()  # unlinks; live views keep their mapping

    def free_all(self) -> None:
        for seg in self.segments.values():
            seg.destroy()
        self.segments.clear()


exported = _Exported()
atexit.register(exported.free_all)


class _Segment:
    """``size`` bytes of shared memory this process owns, followed by its control block."""

    def __init__(self, size: int) -> None:
        # The tracker process that unlinks this process's segments if it is killed must know
        # the segment before it exists: started lazily by the registration, a kill during its
        # start-up (tens of ms) would leave the new segment in /dev/shm for good, and so would
        # a kill between the segment's creation and its registration (SharedMemory registers
        # last). Registering twice is harmless (the tracker keeps a set); a name registered but
        # never created costs the tracker one failed unlink at exit.
        resource_tracker.ensure_running()
        name = f"rudra-{os.getpid()}-{secrets.token_hex(8)}"
        resource_tracker.register("/" + name, "shared_memory")
        at = _word_at(size)
        try:
            self.shm = shared_memory.SharedMemory(name, create=True, size=at + CONTROL)
        except BaseException:
            with contextlib.suppress(OSError):  # SharedMemory may have unlinked it already
                _posixshmem.shm_unlink("/" + name)
            # ...and unregistered it: register again so that this unregister always has a name
            resource_tracker.register("/" + name, "shared_memory")
            resource_tracker.unregister("/" + name, "shared_memory")
            raise
        self.size = size
        self.progress: _ProgressWord | None = None  # an exported allocation's
        self.busy = False
        self.ticket = 0  # of the last body sent in this segment
        self.array = np.ndarray((size,), np.uint8, buffer=self.shm.buf)
        self.control = np.ndarray((2,), np.int64, buffer=self.shm.buf, offset=at)

    @property
    def free(self) -> bool:
        """Not busy: never sent, or its last body was released (by ticket or by notice)."""
        if self.busy and self.ticket and int(self.control[0]) == self.ticket:
            self.busy = False
        return not self.busy

    def lend(self) -> int:
        """Mark busy for one more body and return that body's ticket."""
        self.busy = True
        self.ticket += 1
        return self.ticket

    def word(self, at: int) -> np.ndarray:
        """A view of the int64 word at byte ``at`` (8-byte aligned, within the segment)."""
        view: np.ndarray = np.ndarray((1,), np.int64, buffer=self.shm.buf, offset=at)
        return view

    def write(self, arrays: Sequence[np.ndarray], word: np.ndarray | None = None) -> None:
        """Copy ``arrays`` one after another from the segment's start. With ``word`` (the
        body's progress word), in pieces of :data:`WRITE_PIECE` bytes, storing after each
        how many bytes are final, fenced so that a reader on another CPU sees them first."""
        offset = 0
        for a in arrays:
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            if word is None:
                self.array[offset : offset + flat.nbytes] = flat
            else:
                for lo in range(0, flat.nbytes, WRITE_PIECE):
                    hi = min(lo + WRITE_PIECE, flat.nbytes)
                    self.array[offset + lo : offset + hi] = flat[lo:hi]
                    with _FENCE:
                        pass
                    word[0] = offset + hi
            offset += flat.nbytes

    def destroy(self) -> None:
        if self.progress is not None:
            self.progress.close()
        del self.array, self.control  # view the segment's buffer: must go before close
        try:
            self.shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


class _ProgressWord:
    """The int64 at byte ``at`` of an exported segment: how many bytes of the update being
    computed into the allocation before it are final, for learners copying it meanwhile.
    Threads following that update (:meth:`follow`) keep it up to date; only those following
    the latest update write, so a thread of an earlier one that wakes late cannot."""

    def __init__(self, seg: _Segment, at: int) -> None:
        self.at = at
        self._word: np.ndarray | None = seg.word(at)
        self._lock = threading.Lock()
        self._gate: Gate | None = None  # the update followed (kept: its identity stays unique)

    def follow(self, gate: Gate, nbytes: int, stop: threading.Event, failed: Callable[[], Any]) -> None:
        """Store what ``gate`` says is final now (before the reference goes out), then follow
        it from a thread until all ``nbytes`` are, ``stop`` is set or a later update is
        followed; if the computation fails, store -1 and call ``failed()``."""
        with self._lock:
            if self._word is None:
                raise ConnectionClosed("the weights were freed")
            self._word[0], self._gate = gate.wait(0, 0), gate
        threading.Thread(target=self._follow, args=(gate, nbytes, stop, failed), daemon=True).start()

    def _follow(self, gate: Gate, nbytes: int, stop: threading.Event, failed: Callable[[], Any]) -> None:
        final = 0
        try:
            while final < nbytes and not stop.is_set():
                final = gate.wait(final + 1, offload.STOP_CHECK_S)
                if not self._store(gate, final):
                    return
        except Exception:  # the update failed: no more bytes will be final
            self._store(gate, -1)
            with contextlib.suppress(RuntimeError):  # the loop is closed: so is the connection
                failed()

    def _store(self, gate: Gate, value: int) -> bool:
        with self._lock:
            if self._gate is not gate or self._word is None:
                return False
            self._word[0] = max(value, int(self._word[0])) if value >= 0 else value
            return True

    def close(self) -> None:
        """Let go of the word (a view of the segment, which can close only once no view is left)."""
        with self._lock:
            self._word = self._gate = None


class _Attached:
    """The peer's segment, mapped by name. Unlike ``SharedMemory(name=...)`` on Python < 3.13
    this does not register with the resource tracker: cleaning up is the owner's job."""

    def __init__(self, name: str, owner: int) -> None:
        """Map segment ``name``, which user ``owner`` (the peer's) must own: a peer may not
        make this process read, or write a ticket into, another user's segment that this
        process could open."""
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            stat = os.fstat(fd)
            if stat.st_uid != owner:
                raise MalformedFrame(
                    f"segment {quoted(name)} is not the peer's (owned by uid {stat.st_uid}, not {owner})"
                )
            self.size = stat.st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self._control: np.ndarray | None = None
        self._closed = False
        self._lock = threading.Lock()  # tickets are stored from the update thread too (consume)

    def word(self, at: Any, lo: int, hi: int) -> np.ndarray | None:
        """A view of the int64 progress word at byte ``at``, if ``at`` is an int, 8-byte
        aligned, and the word lies within ``[lo, hi)``; None for any other position."""
        if not (is_int(at) and at % 8 == 0 and lo <= at <= hi - 8):
            return None
        return np.frombuffer(self.buf, np.int64, 1, at)

    @property
    def room(self) -> int:
        """Bytes of the segment a body may occupy: all but its control block, if it has one
        (a size that is a multiple of 8 and at least :data:`CONTROL`)."""
        has_control = self.size >= CONTROL and self.size % 8 == 0
        return self.size - CONTROL if has_control else self.size

    def mark_released(self, ticket: int) -> bool:
        """Store ``ticket`` as released in the owner's control block (from any thread: the
        update thread stores it as soon as a gradient is read, the frame's release again);
        True if the owner waits for a segment (or the block is gone), so a RELEASE notice
        must follow."""
        with self._lock:
            if self._control is None:
                if self._closed or self.room == self.size:
                    return True
                self._control = np.frombuffer(self.buf, np.int64, 2, self.size - CONTROL)
            control = self._control
            control[0] = max(ticket, int(control[0]))  # never back to an earlier body's ticket
            return bool(control[1])

    def close(self) -> None:
        with self._lock:
            self._closed, self._control = True, None  # a view of the mapping: must go before it closes
        self.buf.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a frame still holds a view; the mapping goes when it does


def resolve_reference(
    frame: Frame,
    limits: Limits,
    admit: Callable[[Header], None],
    attached: dict[str, _Attached],
    release: Callable[[str, int, int | None], None],
    owner: int,
) -> Frame | WireError:
    """A frame carrying a body reference, with its body in place in the sender's segment
    (mapped once into ``attached``; ``release(name, offset, ticket)`` is called when the
    frame is released, ``ticket`` None for a reference without one); a frame carrying a
    non-fatal error for a bad reference; FrameTooLarge (fatal) beyond the limits or what
    ``admit`` allows. A reference is ``[name, nbytes, specs]``, optionally followed by the
    offset in the segment (default 0) and the body's ticket; its segment must belong to user
    ``owner`` (the peer's, :func:`peer_uid`)."""
    ref = frame.meta[_REF]
    meta = {k: v for k, v in frame.meta.items() if k != _REF}
    name: Any = None  # the fields a refused reference is released by, if they are well formed
    offset: Any = None
    ticket: Any = None
    try:
        name, nbytes, specs, *rest = ref
        offset = rest[0] if rest else 0
        ticket = rest[1] if len(rest) > 1 else None
        if is_int(nbytes) and nbytes > limits.max_body:
            return FrameTooLarge(f"body of {nbytes} bytes exceeds the limit of {limits.max_body}")
        if is_int(nbytes) and nbytes >= 0:
            try:  # the body's size passes the same check as a body sent inline, before any mapping
                admit(Header(frame.msg_type, 0, 0, nbytes))
            except WireError as exc:
                return exc
        if not (_names_body(name, offset, ticket) and is_int(nbytes) and nbytes > 0 and len(rest) <= 2):
            raise MalformedFrame(f"bad shared-memory reference {quoted(ref)}")
        meta["seg"] = specs
        parsed = parse_segments(meta, nbytes)
        shm = attached.get(name)
        if shm is None:
            if len(attached) >= MAX_ATTACHED:
                attached.pop(next(iter(attached))).close()
            shm = attached[name] = _Attached(name, owner)
        if shm.size < offset + nbytes:
            raise MalformedFrame(f"segment {name} is smaller than the {offset + nbytes} bytes referenced")
        if shm.room < offset + nbytes:  # the receiver writes there: never part of a body
            raise MalformedFrame(
                f"a body at [{offset}, {offset + nbytes}) overlaps the control block of segment {quoted(name)}"
            )
    except (MalformedFrame, ValueError, TypeError, OSError) as exc:
        if isinstance(exc, MalformedFrame):
            err = exc
        else:  # an OSError's text may hold the whole (peer-chosen) segment name: say it once, cut short
            why = (exc.strerror or type(exc).__name__) if isinstance(exc, OSError) else str(exc)
            err = MalformedFrame(f"bad shared-memory reference to segment {quoted(name)}: {why}")
        err.fatal = False
        # a refused body that is named well is released as usual: its sender gets the segment back
        named = _names_body(name, offset, ticket)
        give_back = functools.partial(release, name, offset, ticket) if named else None
        return Frame(frame.msg_type, meta, memoryview(b""), [], err, give_back)
    give_back = functools.partial(release, name, offset, ticket)
    consumed = functools.partial(shm.mark_released, ticket) if ticket is not None else None  # from any thread
    return Frame(frame.msg_type, meta, shm.buf[offset : offset + nbytes], parsed, None, give_back, _consumed=consumed)


def peer_uid(sock: Any) -> int:
    """The user id of the process at the other end of Unix socket ``sock`` (SO_PEERCRED)."""
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


def _lent(ref: list[Any]) -> bool:
    """Whether a (resolved) reference is to memory lent by its sender (no ticket: see Frame.lent)."""
    return len(ref) < 5 or ref[4] is None


def _not_hung_up(sock: Any) -> bool:
    """Whether the peer has not closed (or shut down sending on) socket ``sock``, whatever
    bytes are still queued to be read (POLLRDHUP)."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP)
    return not poller.poll(0)


def _names_body(name: Any, offset: Any, ticket: Any) -> bool:
    """Whether a reference's segment name, offset and ticket are well formed (a ticket must
    fit the control block's int64 word)."""
    return (
        isinstance(name, str)
        and is_int(offset)
        and offset >= 0
        and (ticket is None or (is_int(ticket) and 0 < ticket < 1 << 63))
    )


def _notice_fields(meta: dict[str, Any]) -> tuple[str, int, int | None] | None:
    """``(name, offset, ticket)`` of a received RELEASE notice (``offset`` 0 and ``ticket``
    None where absent); None for a notice whose fields are not well formed, which is then
    ignored (a notice is never answered)."""
    name: Any = meta.get("name")
    offset: Any = meta.get("offset", 0)
    ticket: Any = meta.get("ticket")
    return (name, offset, ticket) if _names_body(name, offset, ticket) else None


def release_notice(
    attached: dict[str, _Attached], name: str, offset: int, ticket: int | None
) -> list[bytes | memoryview] | None:
    """Release body ``ticket`` of the peer's segment ``name``: store the ticket in its control
    block; the RELEASE notice to send as well (an encoded frame), or None when the peer
    does not wait for it. A body without a ticket (exported memory) always needs the notice."""
    if ticket is not None:
        shm = attached.get(name)
        if shm is not None and not shm.mark_released(ticket):
            return None
    meta: dict[str, Any] = {"name": name, "offset": offset}
    if ticket is not None:
        meta["ticket"] = ticket
    return encode_frame(RELEASE, meta)


def _shared_body(arrays: Sequence[np.ndarray], limits: Limits) -> tuple[int, list[Any]] | None:
    """(size, segment list) of a body that travels in shared memory, None for one small enough
    to go inline; FrameTooLarge beyond the limits (before anything is copied or sent)."""
    body = sum(a.nbytes for a in arrays)
    if body <= INLINE:
        return None
    if body > limits.max_body:
        raise FrameTooLarge(f"body of {body} bytes exceeds the limit of {limits.max_body}")
    return body, [spec_of(a).to_wire() for a in arrays]  # validates dtypes before any copy


class _Outgoing:
    """The segments one sender writes its bodies into: reused, the smallest free one that
    fits first, a new one (replacing free ones too small) while fewer than
    :data:`MAX_SEGMENTS` are busy. A segment is busy from its send until the peer stores
    its ticket (or sends a RELEASE notice)."""

    def __init__(self) -> None:
        self.segments: dict[str, _Segment] = {}

    def take(self, arrays: Sequence[np.ndarray], nbytes: int) -> tuple[_Segment, int] | None:
        """A segment holding a copy of ``arrays`` (``nbytes`` in all), now busy, and the
        body's ticket; None while every segment allowed is busy (then, in :meth:`waiting`,
        wait for a RELEASE notice or ``RECHECK_S``, and ask again)."""
        seg = self.reserve(nbytes)
        if seg is None:
            return None
        seg.write(arrays)
        return seg, seg.lend()

    def reserve(self, nbytes: int) -> _Segment | None:
        """A free segment of at least ``nbytes`` (not yet lent); None as for :meth:`take`."""
        free = [s for s in self.segments.values() if s.free and s.size >= nbytes]
        if free:
            seg = min(free, key=lambda s: s.size)
        elif sum(not s.free for s in self.segments.values()) < MAX_SEGMENTS:
            for name in [n for n, s in self.segments.items() if s.free]:  # too small: replace
                self.segments.pop(name).destroy()
            seg = _Segment(max(_word_at(nbytes) + 8, 1 << 20))  # a later body of this size may need its word
            self.segments[seg.shm.name] = seg
        else:
            return None
        return seg

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Ask the peer for RELEASE notices for the duration of the block (the segments of a
        destroyed sender are gone: nothing is left to stop asking)."""
        self._ask(True)
        try:
            yield
        finally:
            self._ask(False)

    def _ask(self, waiting: bool) -> None:
        for seg in self.segments.values():
            seg.control[1] = int(waiting)

    def released(self, name: str, ticket: Any = None) -> bool:
        """A RELEASE notice: the peer is done with body ``ticket`` of segment ``name`` (a
        notice without a ticket: with its last one); True if it is one of these."""
        seg = self.segments.get(name)
        if seg is not None and (ticket is None or ticket == seg.ticket):
            seg.busy = False
        return seg is not None

    def destroy(self) -> None:
        for seg in self.segments.values():
            seg.destroy()
        self.segments.clear()

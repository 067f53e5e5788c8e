"""Shared-memory transport (``shm://NAME``) for learners on the server's host.

Small frames and all notifications travel over a Unix socket (abstract namespace, so no
socket file is left behind). A frame whose body is larger than ``INLINE`` bytes is written
by the sender into one of *its* shared-memory segments — allocated once and reused — and
only a reference (segment name, length, segment list) crosses the socket. The receiver
maps the segment once and reads the body in place: ``Frame.body`` is a view of shared
memory, so a gradient is never copied on the server side. A sender with ``MAX_SEGMENTS``
bodies outstanding waits (back-pressure). A segment is never written while the receiver
may read it, so no reader ever sees a half-written body; the exceptions are bodies sent
before they are final, each with a *progress word* that says how much of it is: the
server's weights while their update is computed, and a blocking learner's large pushes
while it writes them (each side does so only where the other said it reads the word).

Returning a segment costs no message: every sender segment ends in a control block of two
64-bit words, the *released ticket* and the *sender waits* flag. Each body sent in the
segment gets the next ticket (carried in its reference); the receiver that releases the
frame stores that ticket in the control block, and the sender sees the segment free the
next time it looks. Only a sender that found every segment busy sets the flag; a receiver
that sees it after storing the ticket also sends a RELEASE notice (name, offset, ticket)
over the socket, which wakes the sender. The two sides' store-then-load are not fenced, so
a waiting sender looks at the tickets again every ``RECHECK_S`` seconds as well: a missed
notice costs that long, never a hang. Memory sent by reference from :data:`exported`
(the server's published weights) has no ticket: its release is always a RELEASE notice,
since the sender holds the memory until then.

Cleanup: every segment is owned (created and unlinked) by its sender; the receiver's
attach is unregistered from its resource tracker. If the owner is killed, Python's
resource tracker process unlinks its segments; if the peer is killed, the owner unlinks
them when the connection closes. Nothing is left in /dev/shm either way.
"""

from __future__ import annotations

import _posixshmem
import asyncio
import atexit
import collections
import contextlib
import functools
import itertools
import mmap
import os
import platform
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..errors import (
    ConfigError,
    ConnectionClosed,
    FrameTooLarge,
    MalformedFrame,
    PeerGone,
    Unreachable,
    WireError,
    quoted,
)
from ..wire import DEFAULT_TIMEOUT, Frame, Header, Limits, MsgType, encode_frame, is_int, parse_segments, spec_of
from . import offload
from .base import OnAccept, OnConnection, SharedMemory, Transport
from .blocking import BlockingConnection
from .offload import Gate
from .stream import OnMade, StreamConnection, StreamListener, open_stream, start_listener

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
_counter = itertools.count()


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


def _socket_path(name: str) -> str:
    return "\0rudra-async/" + name


def _name(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "shm":
        raise ConfigError(f"not a shm:// address: {url!r}")
    name = (parts.netloc + parts.path).strip("/")
    if len(name) > 80 or any(c in name for c in "\0/"):
        raise ConfigError(f"bad shm name {name!r}: at most 80 characters, no '/'")
    return name


def _server_name(url: str) -> str:
    """The server's name in a ``shm://NAME`` URL a learner connects to."""
    name = _name(url)
    if not name:
        raise ConfigError(f"{url!r} names no server; expected shm://NAME")
    return name


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
        """Store ``ticket`` as released in the owner's control block; True if the owner
        waits for a segment (or the block is gone), so a RELEASE notice must follow."""
        if self._control is None:
            if self._closed or self.room == self.size:
                return True
            self._control = np.frombuffer(self.buf, np.int64, 2, self.size - CONTROL)
        self._control[0] = ticket
        return bool(self._control[1])

    def close(self) -> None:
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
    return Frame(frame.msg_type, meta, shm.buf[offset : offset + nbytes], parsed, None, give_back)


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
        return ORDERED_STORES and self._follows_progress

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
        return ORDERED_STORES and self._follows_progress and body_bytes > INLINE and not self.is_closed

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
        self._check_open()
        if msg_type == MsgType.HELLO and ORDERED_STORES:  # weights may come while they are computed
            meta = {**(meta or {}), _PROGRESS: True}
        shared = _shared_body(arrays, self.limits)
        if shared is None:
            await super().send(msg_type, meta, arrays)
            return
        body, specs = shared
        ahead = msg_type == MsgType.PUSH and self._write_ahead and body >= WRITE_AHEAD_MIN
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
            self._write_ahead = ORDERED_STORES
        if _REF not in frame.meta:
            return frame
        resolved = resolve_reference(frame, self.limits, lambda header: None, self._in, self._release, self._peer_uid)
        if isinstance(resolved, WireError):
            self._lost = PeerGone(f"the server sent a frame beyond the limits: {resolved}")
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
            self._lost = PeerGone(f"the server sent a bad progress word position {quoted(at)}")
            raise self._lost
        target = self.allocator(frame.msg_type, frame.meta, n) if self.allocator is not None else None
        out = np.empty(n, np.uint8).data if target is None else target.cast("B")
        done, gone = 0, False
        try:
            while done < n:
                final = min(int(word[0]), n)
                if final < 0 or (gone and final == done):  # the word is read once more after a hang-up
                    failed = "the server's computation of these weights failed"
                    self._lost = PeerGone(failed if final < 0 else "the server went away while sending weights")
                    raise self._lost
                if final > done:
                    out[done:final] = frame.body[done:final]
                    done = final
                else:
                    gone = self._hung_up(PROGRESS_POLL_S)
            if not self._still_open():  # the lease may have ended during the copy (Frame.lent)
                self._lost = PeerGone("the server went away while its weights were being copied")
                raise self._lost
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
        if self._frames:
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
        if not self._closed:
            while self._held:
                self._held.popleft().release()
        super().close()
        self._out.destroy()
        for shm in self._in.values():
            shm.close()
        self._in.clear()


class ShmTransport(Transport):
    scheme = "shm"
    same_host = True

    def shared_memory(self) -> SharedMemory:
        return exported

    def fresh_address(self, host: str = "127.0.0.1") -> str:
        return "shm://"  # listen() picks a fresh name

    def connect_blocking(
        self,
        url: str,
        *,
        limits: Limits = Limits(),
        timeout: float = DEFAULT_TIMEOUT,
        tls: ssl.SSLContext | None = None,
    ) -> BlockingShmConnection:
        """A blocking connection to ``shm://NAME`` (same host; ``tls`` is never given: shm has
        none); ConnectError at once if nobody listens there, or after ``timeout``."""
        name = _server_name(url)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(_socket_path(name))
        except OSError as exc:
            sock.close()
            raise Unreachable(f"cannot connect to {url}: {exc.strerror or exc}") from None
        sock.settimeout(None)
        return BlockingShmConnection(sock, limits, url)

    async def listen(
        self, url: str, on_connection: OnConnection, *, limits: Limits = Limits(), on_accept: OnAccept | None = None
    ) -> StreamListener:
        """Listen on ``shm://NAME`` (``shm://`` picks a fresh name). Same host only."""
        name = _name(url) or f"{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"
        loop = asyncio.get_running_loop()

        def serve(factory: Callable[[], StreamConnection]) -> Awaitable[asyncio.AbstractServer]:
            # bind the socket ourselves: libuv cannot name an abstract-namespace address
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(_socket_path(name))
            except OSError:
                sock.close()
                raise
            return loop.create_unix_server(factory, sock=sock)

        peer = f"shm://{name}#peer"
        listener = await start_listener(
            serve, url, on_connection, lambda on_made: ShmConnection(limits, peer=peer, on_made=on_made), on_accept
        )
        listener.address = f"shm://{name}"
        return listener

    async def connect(self, url: str, *, limits: Limits = Limits(), timeout: float = DEFAULT_TIMEOUT) -> ShmConnection:
        name = _server_name(url)
        loop = asyncio.get_running_loop()

        async def open_socket() -> tuple[asyncio.BaseTransport, ShmConnection]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, _socket_path(name))
            except OSError:
                sock.close()
                raise
            return await loop.create_unix_connection(lambda: ShmConnection(limits, peer=url), sock=sock)

        conn = await open_stream(open_socket(), url, timeout)
        assert isinstance(conn, ShmConnection)
        return conn


transport = ShmTransport()

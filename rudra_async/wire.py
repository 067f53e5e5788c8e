"""The wire format: pure functions and an incremental frame reader, no I/O.

A frame is a fixed 24-byte header, a msgpack map of metadata, and a body of raw array
segments laid end to end::

    magic "RDRA" | version u8 | type u8 | flags u16 | meta_len u64 | body_len u64   (little-endian)
    meta: msgpack map; key "seg" lists each segment as [dtype string, shape list]
    body: the segments' bytes, C order, no padding

Segments are sent as views of the caller's arrays (``encode_frame`` copies nothing) and
received into buffers the caller may choose (``FrameReader(allocate=...)``), so a 100 MB
gradient crosses the process boundary without an extra copy. ``docs/wire.md`` is the
normative description.
"""

from __future__ import annotations

import bisect
import enum
import gc
import itertools
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import msgpack
import numpy as np

from .bodies import BodyBudget, BodyLease, BufferPool
from .errors import BadMagic, BadVersion, FrameTooLarge, MalformedFrame, WireError, quoted
from .layout import MAX_TENSOR_DIMS

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_META",
    "DEFAULT_TIMEOUT",
    "HEADER_SIZE",
    "MAGIC",
    "NONCE_BYTES",
    "WIRE_VERSION",
    "Admit",
    "Allocator",
    "Frame",
    "FrameReader",
    "Header",
    "Limits",
    "MsgType",
    "SegmentSpec",
    "decode_meta",
    "encode_frame",
    "encode_messages",
    "parse_segments",
    "spec_of",
    "unpack_header",
]

MAGIC = b"RDRA"
WIRE_VERSION = 1
HEADER = struct.Struct("<4sBBHQQ")
HEADER_SIZE = HEADER.size  # 24

DEFAULT_MAX_META = 1 << 20  # 1 MiB of metadata is far more than any message needs
DEFAULT_MAX_BODY = 1 << 33  # 8 GiB; 64-bit lengths, so no 2 GB cliff
#: seconds, by default, to connect and to say hello (a client's connect, a server's hello timeout)
DEFAULT_TIMEOUT = 10.0
#: bytes of each nonce of the authentication handshake (HELLO's and WELCOME's ``nonce``)
NONCE_BYTES = 32
MAX_DIMS = MAX_TENSOR_DIMS  # dimensions of a segment: those of a tensor
#: segments of one frame at most: a push has at most one per tensor, and a layout at most
#: this many tensors (``schema.MAX_TENSORS``). Checking each costs a few µs of Python: this
#: bounds what a frame costs (~40 ms on the development machine), and so the stall it causes
#: every other learner
MAX_SEGMENTS = 1 << 14
_MAX_ELEMENTS_BYTES = 1 << 62  # a segment's shape, zeros counted as 1, times its item size
#: metadata of at least this many bytes is decoded with the cyclic garbage collector paused:
#: the (acyclic) lists and maps of 1 MiB of small ones would otherwise set off collections of
#: the whole heap as they are made, ~150 ms instead of ~20 (a stall for every learner)
_PAUSE_GC_META = 1 << 16

#: dtypes allowed in segments (little-endian or byte-sized numeric types).
ALLOWED_DTYPES = frozenset(["<f2", "<f4", "<f8", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "|b1"])
_DTYPES = {name: np.dtype(name) for name in ALLOWED_DTYPES}


class MsgType(enum.IntEnum):
    """Message types. Values are part of the wire format and never change."""

    HELLO = 1
    WELCOME = 2
    PUSH = 3
    PULL = 4
    WEIGHTS = 5
    ACK = 6
    ERROR = 7
    BYE = 8
    CHECKPOINT = 9  # a checkpoint file (rudra_async.checkpoint); never sent on a connection
    AUTH = 10  # learner → server: start the handshake (its nonce)
    CHALLENGE = 11  # server → learner: the server's nonce and proof
    PROOF = 12  # learner → server: the learner's proof
    AUTHENTICATED = 13  # server → learner: the proof was right
    STATE = 14  # both: the model's frozen parameters and buffers (learner: its own; server: the run's)


@dataclass(frozen=True)
class Limits:
    """Largest metadata and body a reader accepts (and a writer will send)."""

    max_meta: int = DEFAULT_MAX_META
    max_body: int = DEFAULT_MAX_BODY


class Header(NamedTuple):
    """A frame's fixed-size header (a named tuple: made twice per small request, so cheap)."""

    msg_type: int
    flags: int
    meta_len: int
    body_len: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, WIRE_VERSION, self.msg_type, self.flags, self.meta_len, self.body_len)


def is_int(value: Any) -> bool:
    """Whether a decoded metadata value is a msgpack integer (``true``/``false`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def unpack_header(data: bytes | bytearray | memoryview, limits: Limits = Limits()) -> Header:
    """Parse and validate a header. Raises a fatal :class:`WireError` on any violation."""
    if len(data) != HEADER_SIZE:
        raise MalformedFrame(f"header must be {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, msg_type, flags, meta_len, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise BadVersion(f"wire version {version} not supported (this side speaks {WIRE_VERSION})")
    if meta_len > limits.max_meta:
        raise FrameTooLarge(f"metadata of {meta_len} bytes exceeds the limit of {limits.max_meta}", msg_type=msg_type)
    if body_len > limits.max_body:
        raise FrameTooLarge(f"body of {body_len} bytes exceeds the limit of {limits.max_body}", msg_type=msg_type)
    return Header(msg_type, flags, meta_len, body_len)


class SegmentSpec(NamedTuple):
    """One segment of a body: its dtype and shape."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_wire(self) -> list[Any]:
        return [self.dtype.str, list(self.shape)]


def spec_of(array: np.ndarray) -> SegmentSpec:
    dt = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dt.str not in ALLOWED_DTYPES:
        raise MalformedFrame(f"dtype {array.dtype} cannot be sent; allowed: {sorted(ALLOWED_DTYPES)}")
    return SegmentSpec(dt, tuple(int(d) for d in array.shape))


def parse_segments(meta: dict[str, Any], body_len: int) -> list[SegmentSpec]:
    """Read and validate the ``seg`` list of a metadata map against the body length:
    :class:`MalformedFrame` for a list of more than :data:`MAX_SEGMENTS` (before any is
    read), a bad descriptor, or lengths that do not add up to ``body_len``."""
    raw = meta.get("seg", [])
    if not isinstance(raw, list):
        raise MalformedFrame("'seg' must be a list")
    if len(raw) > MAX_SEGMENTS:
        raise MalformedFrame(f"{len(raw)} segments; a frame may have at most {MAX_SEGMENTS}")
    specs: list[SegmentSpec] = []
    total = 0
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], list)):
            raise MalformedFrame(f"bad segment descriptor {quoted(item)}; expected [dtype, shape]")
        dtype_str, shape = item
        if dtype_str not in ALLOWED_DTYPES:
            raise MalformedFrame(f"segment dtype {quoted(dtype_str)} not allowed")
        if len(shape) > MAX_DIMS or not all(is_int(d) and d >= 0 for d in shape):
            raise MalformedFrame(f"bad segment shape {quoted(shape)}: at most {MAX_DIMS} integers >= 0")
        spec = SegmentSpec(_DTYPES[dtype_str], tuple(shape))
        extent = spec.dtype.itemsize
        for d in shape:
            extent *= max(d, 1)
        if extent > _MAX_ELEMENTS_BYTES:  # numpy cannot even describe an empty array of this shape
            raise MalformedFrame(f"segment shape {quoted(shape)} is too large")
        total += spec.nbytes
        if total > body_len:
            break
        specs.append(spec)
    if total != body_len:
        raise MalformedFrame(f"segments describe {total} bytes but the body has {body_len}")
    return specs


def encode_frame(
    msg_type: int,
    meta: dict[str, Any] | None = None,
    arrays: Sequence[np.ndarray] = (),
    limits: Limits = Limits(),
) -> list[bytes | memoryview]:
    """Return the frame as buffers for ``writelines``: header+meta, then one view per array.

    The arrays are not copied; the caller must not modify them until the buffers are sent.
    Non-contiguous arrays are rejected rather than silently copied.
    """
    meta = dict(meta or {})
    views: list[memoryview] = []
    if arrays:
        specs = []
        for a in arrays:
            if not a.flags.c_contiguous:
                raise MalformedFrame("arrays must be C-contiguous (use np.ascontiguousarray)")
            specs.append(spec_of(a).to_wire())
            if a.nbytes:
                views.append(a.reshape(-1).view(np.uint8).data)
        meta["seg"] = specs
    packed = msgpack.packb(meta, use_bin_type=True)
    body_len = sum(v.nbytes for v in views)
    if len(packed) > limits.max_meta:
        raise FrameTooLarge(f"metadata of {len(packed)} bytes exceeds the limit of {limits.max_meta}")
    if body_len > limits.max_body:
        raise FrameTooLarge(f"body of {body_len} bytes exceeds the limit of {limits.max_body}")
    head = Header(int(msg_type), 0, len(packed), body_len).pack() + packed
    return [head, *views]


def encode_messages(
    msg_type: int,
    meta: dict[str, Any] | None = None,
    arrays: Sequence[np.ndarray] = (),
    limits: Limits = Limits(),
) -> list[bytes | memoryview]:
    """The frame as the messages of a message-based transport: the header, the metadata,
    then one message per non-empty segment (views, as in :func:`encode_frame`).

    ``FrameReader(messages=True)`` receives them one :meth:`FrameReader.get_buffer` each.
    """
    head, *views = encode_frame(msg_type, meta, arrays, limits)
    return [head[:HEADER_SIZE], *([head[HEADER_SIZE:]] if len(head) > HEADER_SIZE else []), *views]


def decode_meta(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a metadata map. Raises a non-fatal :class:`MalformedFrame` if it is not one.
    Large metadata (:data:`_PAUSE_GC_META`) is decoded with the garbage collector paused
    (process-wide, for the decode only; msgpack makes no reference cycles)."""
    pause = len(data) >= _PAUSE_GC_META and gc.isenabled()
    if pause:
        gc.disable()
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise MalformedFrame(f"metadata is not valid msgpack: {exc}") from None
    finally:
        if pause:
            gc.enable()
    if not isinstance(meta, dict):
        raise MalformedFrame("metadata must be a msgpack map")
    return meta


@dataclass
class Frame:
    """One received frame. ``arrays`` are views over ``body``; call ``release`` when done.

    ``written``: for a body its sender is still writing (a transport may deliver such a
    frame early: shm's pushes written as they are sent), a function returning how many
    bytes of the body, from its start, are final now (raising
    :class:`~rudra_async.errors.PeerGone` once no more will be); only those may be read.
    None: the whole body is final.

    ``lent``: for a body read in place from memory its sender lends only while the
    connection is open (shm's published weights), a function returning whether it still
    is: what was read before it returns True is whole; after False it may mix two updates.
    None: the body is the receiver's own."""

    msg_type: int
    meta: dict[str, Any]
    body: memoryview
    specs: list[SegmentSpec] = field(default_factory=list)
    error: WireError | None = None  # set when the frame was read but is not valid
    _release: Callable[[], None] | None = None
    written: Callable[[], int] | None = None
    lent: Callable[[], bool] | None = None
    _set_aside: Callable[[], None] | None = None
    _consumed: Callable[[], object] | None = None

    @property
    def arrays(self) -> list[np.ndarray]:
        out, off = [], 0
        for s in self.specs:
            n = s.nbytes
            out.append(np.frombuffer(self.body[off : off + n], dtype=s.dtype).reshape(s.shape))
            off += n
        return out

    def release(self) -> None:
        """Give the body buffer back to the reader for reuse. Idempotent."""
        if self._release is not None:
            release, self._release = self._release, None
            release()

    def set_aside(self) -> None:
        """The body will be kept for a while (a protocol holds the gradient until others
        arrive): a :class:`~rudra_async.bodies.BodyBudget` no longer counts it. Idempotent;
        a no-op for a body outside any budget."""
        if self._set_aside is not None:
            self._set_aside()

    def consumed(self) -> None:
        """The body will not be read again (from any thread; the frame must still be
        released): a transport may let its sender reuse the memory at once (shm: the body's
        ticket is stored in the sender's segment, so its next push needs no second one)."""
        consumed, self._consumed = self._consumed, None
        if consumed is not None:
            consumed()

    def take(self) -> Frame:
        """Move ownership of the body to a new Frame, which the caller must release; this one's
        :meth:`release` becomes a no-op (for a consumer that keeps a frame past its handler)."""
        taken = replace(self)
        self._release = self._set_aside = self._consumed = None
        return taken


#: ``allocate(msg_type, meta, nbytes)`` may return a writable buffer of exactly ``nbytes``
#: to receive the body into (e.g. a model's parameter buffer), or None for the default pool.
Allocator = Callable[[int, dict[str, Any], int], "memoryview | None"]

#: ``admit(header)`` is called for every header that passed the :class:`Limits`, before
#: anything of its frame (metadata or body) is allocated; it may raise a :class:`WireError`
#: (e.g. :class:`FrameTooLarge`), which is then fatal for the stream.
Admit = Callable[[Header], None]


class FrameReader:
    """Incremental frame parser shaped for ``asyncio.BufferedProtocol``.

    Call :meth:`get_buffer` to learn where the next bytes go, write at most that many
    there, and report the count with :meth:`advance`, which returns the frames finished
    (possibly several). Small parts (a header, metadata, a body or its rest under
    :attr:`STAGE` bytes) are read through one staging buffer and copied out, so a small
    frame, or several, costs one read; the bulk of a large body is read straight into its
    final buffer (no copy). A fatal :class:`WireError` from ``advance`` means the stream is lost.

    With ``messages=True`` (for message-based transports, see :func:`encode_messages`)
    :meth:`get_buffer` is exactly the next message: the header, the metadata, then each
    non-empty segment of the body in turn; and bad metadata before a body is fatal, since
    the body's messages can no longer be told apart.
    """

    _SKIP_CHUNK = 1 << 16
    _META_CHUNK = 1 << 12  # metadata buffers start this small and grow as the bytes arrive
    #: bytes of the staging buffer; a part with at least this much left is read in place
    STAGE = 1 << 16

    def __init__(
        self,
        limits: Limits = Limits(),
        allocate: Allocator | None = None,
        *,
        messages: bool = False,
        admit: Admit | None = None,
        budget: BodyBudget | None = None,
    ) -> None:
        self.limits = limits
        #: where large bodies' buffers come from (None: this reader's own pool); see :attr:`waiting`
        self.budget = budget
        self.allocate = allocate
        self.admit = admit
        self.messages = messages
        self._head = bytearray(HEADER_SIZE)
        self.pool = BufferPool()
        self._stage = memoryview(bytearray(self.STAGE))
        self._staged = False  # whether the buffer get_buffer handed out last is the stage
        self._pending = bytearray()  # bytes read while waiting for a body's buffer
        self._lease: BodyLease | None = None
        self._begin_header()

    # -- state -------------------------------------------------------------------------
    def _begin_header(self) -> None:
        self._state = "header"
        self._buf: memoryview = memoryview(self._head)
        self._pos = 0
        self._header: Header | None = None
        self._meta: dict[str, Any] = {}
        self._specs: list[SegmentSpec] = []
        self._error: WireError | None = None
        self._owned: np.ndarray | None = None
        self._lease = None
        self._skip_left = 0
        self._ends: list[int] = []  # messages mode: where each non-empty segment ends in the body

    @property
    def mid_frame(self) -> bool:
        """True when some bytes of a frame have arrived but not all of it."""
        return not (self._state == "header" and self._pos == 0)

    @property
    def waiting(self) -> int:
        """The size of a body waiting for a buffer of the :attr:`budget` (0: none waits): the
        caller stops reading (bytes read meanwhile are kept) until :meth:`resume` hands it one."""
        return self._header.body_len if self._state == "waiting" and self._header is not None else 0

    def get_buffer(self) -> memoryview:
        """Where the next bytes go (never empty): the staging buffer, the rest of a large
        body in place, or in messages mode exactly the current message."""
        if self._ends:
            return self._buf[self._pos : self._ends[bisect.bisect_right(self._ends, self._pos)]]
        if self.messages or len(self._buf) - self._pos >= self.STAGE:
            self._staged = False
            return self._buf[self._pos :]
        self._staged = True
        return self._stage

    def advance(self, n: int) -> list[Frame]:
        """Report ``n`` bytes written into the last :meth:`get_buffer`; the frames they finish."""
        if not self._staged:
            return self._advance_part(n)
        self._staged = False
        return self._feed(self._stage, n)

    def resume(self, lease: BodyLease) -> list[Frame]:
        """Receive the waiting body into ``lease``'s buffer (see :attr:`waiting`); the frames
        the bytes read meanwhile finish."""
        assert self._state == "waiting" and self._header is not None, "resume() only while waiting"
        if len(lease.buffer) < self._header.body_len:
            raise ValueError("a lease smaller than the waiting body")
        self._start_body(lease)
        pending, self._pending = self._pending, bytearray()
        return self._feed(memoryview(pending), len(pending))

    def _feed(self, data: memoryview, n: int) -> list[Frame]:
        """Take the first ``n`` bytes of ``data`` part by part, as if each had been read in place."""
        frames: list[Frame] = []
        done = 0
        while done < n:
            if self._state == "waiting":  # kept until the body's buffer comes
                self._pending += data[done:n]
                break
            room = self._buf[self._pos :]
            k = min(len(room), n - done)
            room[:k] = data[done : done + k]
            done += k
            try:
                frames += self._advance_part(k)
            except WireError as exc:
                exc.finished = frames
                raise
        return frames

    def _advance_part(self, n: int) -> list[Frame]:
        self._pos += n
        frames: list[Frame] = []
        while self._pos == len(self._buf) and self._state != "waiting":
            frame = self._step()
            if frame is not None:
                frames.append(frame)
                break  # the next header starts with an empty buffer
        return frames

    def _step(self) -> Frame | None:
        if self._state == "header":
            self._header = unpack_header(self._head, self.limits)
            if self.admit is not None:
                self.admit(self._header)
            self._state, self._pos = "meta", 0
            first = self._header.meta_len if self.messages else min(self._header.meta_len, self._META_CHUNK)
            self._buf = memoryview(bytearray(first))
            return None
        if self._state == "meta":
            assert self._header is not None
            if len(self._buf) < self._header.meta_len:  # grow with what arrived: memory follows bytes sent
                grown = bytearray(min(self._header.meta_len, 4 * len(self._buf)))
                grown[: self._pos] = self._buf
                self._buf = memoryview(grown)
                return None
            try:
                self._meta = decode_meta(self._buf) if self._header.meta_len else {}
                self._specs = parse_segments(self._meta, self._header.body_len)
            except WireError as exc:
                if self.messages and self._header.body_len:
                    raise  # fatal: the body's messages cannot be matched to segments
                exc.fatal = False
                self._error = exc
            return self._begin_body()
        if self._state == "skip":
            self._skip_left -= self._pos
            if self._skip_left > 0:
                self._pos = 0
                self._buf = self._buf[: min(self._skip_left, len(self._buf))]
                return None
            return self._emit(memoryview(b""))
        return self._emit(self._buf)

    def _begin_body(self) -> Frame | None:
        assert self._header is not None
        n = self._header.body_len
        self._pos = 0
        if self._error is not None:
            self._state, self._skip_left = "skip", n
            if n == 0:
                return self._emit(memoryview(b""))
            self._buf = np.empty(min(n, self._SKIP_CHUNK), np.uint8).data
            return None
        if n == 0:
            return self._emit(memoryview(b""))
        self._state = "body"
        target = self.allocate(self._header.msg_type, self._meta, n) if self.allocate else None
        if target is None and self.budget is not None and self.budget.counts(n):
            lease = self.budget.take(n)
            if lease is None:
                self._state, self._buf = "waiting", memoryview(b"")
                return None
            self._start_body(lease)
            return None
        if target is None:
            self._owned = self.pool.take(n)
            target = self._owned.data[:n]
        elif len(target) != n:
            raise ValueError("allocator returned a buffer of the wrong size")
        self._buf = target.cast("B") if target.format != "B" else target
        if self.messages:
            self._ends = sorted(set(itertools.accumulate(s.nbytes for s in self._specs)) - {0})
        return None

    def _start_body(self, lease: BodyLease) -> None:
        """Receive the body into ``lease``'s buffer."""
        assert self._header is not None
        self._state, self._lease = "body", lease
        self._buf = lease.buffer.data[: self._header.body_len]
        if self.messages:
            self._ends = sorted(set(itertools.accumulate(s.nbytes for s in self._specs)) - {0})

    def _emit(self, body: memoryview) -> Frame:
        assert self._header is not None
        owned, lease = self._owned, self._lease
        release: Callable[[], None] | None = None
        if lease is not None:
            release = lease.give_back
        elif owned is not None:
            release = lambda: self.pool.give_back(owned)
        frame = Frame(
            self._header.msg_type,
            self._meta,
            body,
            self._specs,
            self._error,
            release,
            _set_aside=lease.set_aside if lease is not None else None,
        )
        self._begin_header()
        return frame

    def close(self) -> None:
        """Drop every buffer now (the pool's and a frame's in progress), without waiting for
        the garbage collector (the hooks, which refer back to their connection, are dropped
        too); frames already handed out stay valid. The reader takes no more bytes."""
        self.pool.clear()
        self.pool.keep = 0
        if self._lease is not None:  # a body in progress: its buffer goes back to the budget
            self._lease.give_back()
        self.allocate = self.admit = self.budget = None  # bytes read after this (a lingering close) take no lease
        self._pending = bytearray()
        self._begin_header()

"""Checkpoints: a server's weights, momentum and clock in one file, written atomically.

A checkpoint file is one frame of the wire format (``docs/wire.md``) of type CHECKPOINT
(9): the 24-byte header, a msgpack metadata map, then two float32 segments, the weights and
the momentum, of the values the file's shard holds, and (format 2) the model's frozen
parameters and buffers, one segment each. Metadata keys: ``format`` (1, or 2 with
``model_state``: the frozen parameters' and buffers' layout, as HELLO's ``state``),
``clock``, ``layout`` (the whole model's, as in HELLO), ``shard`` ([index, count]),
``samples``, ``crc32`` (of each segment's bytes), ``meta_crc32`` (of the rest of the
metadata, see :func:`_meta_crc`), ``saved_at`` (Unix time), ``state``
(what the server restores besides the arrays: the staleness histogram, the LR policy's
state) and ``info`` (free-form: the server's settings, for people reading the file).

:func:`save` writes to a temporary file in the same directory (``.NAME.PID.*.tmp``), fsyncs
it and renames it over the target, so a crash at any moment leaves either the old or the new
checkpoint, never a mix. A save holds an exclusive ``flock`` on its temporary until it is
renamed; the next save deletes those it can lock (left by a save that was killed).
:func:`load` refuses a file that is not a checkpoint, is truncated, fails its CRC, is larger
than its limits allow or holds values a server would not resume from, with a
:class:`~rudra_async.errors.CheckpointError` that says which.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import re
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import numpy as np

from .errors import CheckpointError, ConfigError, RudraError, quoted
from .groups import parse_groups
from .kernels import max_abs
from .layout import Layout, Shard
from .lr import MAX_WINDOW, check_policy_state
from .model_state import StateLayout
from .schema import is_count
from .staleness import parse_histogram
from .wire import HEADER_SIZE, Limits, MsgType, encode_frame, parse_segments, spec_of, unpack_header

__all__ = [
    "FORMAT",
    "Checkpoint",
    "load",
    "save",
    "shard_path",
]

FORMAT = 1  # a file without the model's state (format 2 has it)
FORMAT_WITH_STATE = 2
_LIMITS = Limits(max_meta=1 << 28, max_body=1 << 62)  # two copies of the model; a long LR-policy window
#: bounds on decoding the metadata, so that a small file cannot decode into a huge object graph:
#: each string, bytes, list and map, and all maps and lists together (their values in all)
_MAX_STR = 1 << 20  # a tensor name, a setting in ``info``
_MAX_MAP = 1 << 20  # entries of one map: the staleness histogram's values of σ
_MAX_VALUES = 2 * MAX_WINDOW  # values of all lists and maps: the longest mean-staleness window and as many more
_MAX_CONTAINERS = 1 << 20  # lists and maps: a layout and groups fit in a HELLO's 1 MiB (< 2^20 lists)
_TEMPORARY_TRIES = 10  # temporaries a save makes before it gives up (each deleted by a cleanup as it was made)


@dataclass
class Checkpoint:
    """The state a server resumes from. ``weights`` and ``momentum`` are flat float32: the
    values of ``shard``'s range of the whole model's ``layout``."""

    layout: Layout
    clock: int
    weights: np.ndarray
    momentum: np.ndarray
    samples: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    shard: Shard = field(default_factory=Shard)
    state: dict[str, Any] = field(default_factory=dict)
    #: the frozen parameters and buffers (their layout, and one array each in its order); None: the file has none
    model_state: StateLayout | None = None
    model_state_values: list[np.ndarray] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Values held: the shard's share of the layout."""
        lo, hi = self.shard.range(self.layout.size)
        return hi - lo


def save(path: str | os.PathLike[str], ckpt: Checkpoint, keep: int = 1) -> None:
    """Write ``ckpt`` to ``path`` atomically (blocking; servers call it from a thread).
    The arrays are written from their own memory, without copies. ``keep`` > 1 keeps the
    ``keep`` − 1 files before it too: the previous ``path`` becomes ``path.1``, that one
    ``path.2``, ... (``path`` itself is never missing meanwhile)."""
    path = os.fspath(path)
    arrays = [np.ascontiguousarray(a, np.float32).reshape(-1) for a in (ckpt.weights, ckpt.momentum)]
    if any(a.size != ckpt.size for a in arrays):
        raise CheckpointError(f"weights and momentum must have {ckpt.size} values each")
    if ckpt.model_state is not None:
        try:
            ckpt.model_state.check_arrays(ckpt.model_state.tensors, ckpt.model_state_values)
        except RudraError as exc:
            raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
        arrays += [np.require(a, requirements="C") for a in ckpt.model_state_values]  # 0-d stays 0-d
    try:
        _check_state(ckpt.state, ckpt.layout)  # never write what load would refuse
    except (ValueError, RudraError) as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: bad 'state': {exc}") from None
    meta = {
        "format": FORMAT if ckpt.model_state is None else FORMAT_WITH_STATE,
        "clock": int(ckpt.clock),
        "layout": ckpt.layout.to_wire(),
        "shard": ckpt.shard.to_wire(),
        "samples": int(ckpt.samples),
        "crc32": [zlib.crc32(_bytes(a)) for a in arrays],
        "saved_at": time.time(),
        "state": ckpt.state,
        "info": ckpt.info,
        **({"model_state": ckpt.model_state.to_wire()} if ckpt.model_state is not None else {}),
        "seg": [spec_of(a).to_wire() for a in arrays],  # as encode_frame writes it: covered by meta_crc32
    }
    try:
        meta["meta_crc32"] = _meta_crc(_decode_meta(msgpack.packb(meta, use_bin_type=True)))  # as it reads back
    except (ValueError, TypeError, OverflowError) as exc:  # metadata msgpack cannot encode
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}."
    _remove_orphans(directory, prefix)
    tmp = None
    try:
        fd, tmp = _create_temporary(directory, prefix)
        with open(fd, "wb") as f:  # closing it releases the lock: after the rename
            for buf in encode_frame(MsgType.CHECKPOINT, meta, arrays, _LIMITS):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
            with contextlib.suppress(OSError):  # mkstemp made it 0600; give it what open() would
                os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            _keep_previous(path, keep, directory, prefix)
            os.replace(tmp, path)
        _fsync_directory(directory)
    except BaseException as exc:
        if tmp is not None:  # never leave a model-sized temporary behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None
        if isinstance(exc, (ValueError, TypeError, OverflowError)):  # metadata msgpack cannot encode
            raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
        raise


def _keep_previous(path: str, keep: int, directory: str, prefix: str) -> None:
    """Before ``path`` is replaced: ``path.(k−1)`` becomes ``path.k`` for k = keep − 1 … 2,
    and ``path`` becomes ``path.1`` through a hard link (named as a save's temporary, so a
    cleanup removes it if a crash leaves it), so that ``path`` is never missing."""
    if keep < 2 or not os.path.exists(path):
        return
    for k in range(keep - 1, 1, -1):
        if os.path.exists(f"{path}.{k - 1}"):
            os.replace(f"{path}.{k - 1}", f"{path}.{k}")
    fd, link = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
    os.close(fd)
    os.unlink(link)
    os.link(path, link)
    os.replace(link, f"{path}.1")


def _meta_crc(meta: dict[str, Any]) -> int:
    """The CRC-32 of a metadata map as read from a file, without ``meta_crc32``, msgpack-encoded
    (``use_bin_type``, keys in order: packing a decoded map again gives the same bytes)."""
    return zlib.crc32(msgpack.packb({k: v for k, v in meta.items() if k != "meta_crc32"}, use_bin_type=True))


def _create_temporary(directory: str, prefix: str) -> tuple[int, str]:
    """A new temporary file for a save (``prefix`` + pid + ``.`` + mkstemp's 8 characters +
    ``.tmp``), open, and locked with an exclusive ``flock`` that the save holds until it has
    renamed it: what tells :func:`_remove_orphans` it is not a leftover. A cleanup may lock
    and delete it between its creation and the lock; then another is made. (Where the file
    system has no ``flock``, it is not locked, and no cleanup can lock it either.)"""
    for _ in range(_TEMPORARY_TRIES):
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a cleanup that holds it (and has deleted it)
            if os.fstat(fd).st_nlink:
                return fd, tmp
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
    raise OSError(errno.EAGAIN, "its temporary files were deleted as they were made")


def _remove_orphans(directory: str, prefix: str) -> None:
    """Delete the temporaries of saves of this checkpoint that were killed mid-save (each is
    model-sized): files named exactly as :func:`_create_temporary` names them (so another
    checkpoint's, ``NAME.1000``'s say, never match) that no save holds locked. Those a save
    is writing, and anything else, stay."""
    orphan = re.compile(re.escape(prefix) + r"[0-9]{1,7}\.[a-z0-9_]{8}\.tmp")
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if orphan.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    _remove_unlocked(entry.path)


def _remove_unlocked(path: str) -> None:
    """Delete ``path`` if no one holds a ``flock`` on it, holding one meanwhile (so a save that
    has just made it and waits for its lock finds it deleted); raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a save holds it
        if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
            os.unlink(path)
    finally:
        os.close(fd)


def load(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify a checkpoint written by :func:`save`."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return _read(f, path)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from None


def _read(f: BinaryIO, path: str) -> Checkpoint:
    size = os.fstat(f.fileno()).st_size
    try:
        header = unpack_header(f.read(HEADER_SIZE), _LIMITS)
    except RudraError as exc:
        raise CheckpointError(f"{path} is not a rudra-async checkpoint ({exc})") from None
    if header.msg_type != MsgType.CHECKPOINT:
        raise CheckpointError(f"{path} is a rudra-async frame of type {header.msg_type}, not a checkpoint")
    expected = HEADER_SIZE + header.meta_len + header.body_len
    if size != expected:
        raise CheckpointError(f"{path} is truncated or padded: {size} bytes, the header says {expected}")
    try:
        meta = _decode_meta(f.read(header.meta_len))
    except ValueError as exc:
        raise CheckpointError(f"{path} has bad metadata: {exc}") from None
    try:
        specs = parse_segments(meta, header.body_len)
        layout = Layout.from_wire(meta.get("layout"))
        shard = Shard.from_wire(meta.get("shard"))
        lo, hi = shard.range(layout.size)
    except RudraError as exc:
        raise CheckpointError(f"{path} has bad metadata: {exc}") from None
    if meta.get("format") not in (FORMAT, FORMAT_WITH_STATE):
        raise CheckpointError(
            f"{path} has checkpoint format {meta.get('format')!r}; this version reads {FORMAT} and {FORMAT_WITH_STATE}"
        )
    if "meta_crc32" in meta and meta["meta_crc32"] != _meta_crc(meta):  # absent in files of earlier versions
        raise CheckpointError(f"{path} is corrupt: its metadata fails its CRC-32 check")
    model_state = None
    if meta["format"] == FORMAT_WITH_STATE:
        try:
            model_state = StateLayout.from_wire(meta.get("model_state"))
        except RudraError as exc:
            raise CheckpointError(f"{path} has a bad 'model_state': {exc}") from None
    extra = [(t.dtype, t.shape) for t in model_state.tensors] if model_state is not None else []
    if [(s.dtype.str, s.shape) for s in specs] != [("<f4", (hi - lo,))] * 2 + extra:
        raise CheckpointError(
            f"{path} must hold two float32 segments of {hi - lo} values"
            + (" and one for each tensor of its 'model_state'" if extra else "")
        )
    crcs = _list(meta, "crc32", len(specs), path)
    clock, samples = _int(meta, "clock", path), _int(meta, "samples", path)
    state = meta.get("state", {})
    try:
        _check_state(state, layout)
    except (ValueError, RudraError) as exc:
        raise CheckpointError(f"{path} has a bad 'state': {exc}") from None
    try:
        arrays = [np.empty(s.shape, s.dtype) for s in specs]
    except MemoryError:  # numpy's _ArrayMemoryError too
        raise CheckpointError(
            f"{path} holds {header.body_len} bytes of arrays: not enough memory to read them"
        ) from None
    for a, crc in zip(arrays, crcs):
        _read_exactly(f, _bytes(a))
        if zlib.crc32(_bytes(a)) != crc:
            raise CheckpointError(f"{path} is corrupt: a segment fails its CRC-32 check")
    if not all(math.isfinite(max_abs(a)) for a in arrays[:2]):
        raise CheckpointError(f"{path} holds weights or momentum that are not finite")
    info = _map(meta, "info")
    saved_at = meta.get("saved_at", 0.0)
    saved_at = float(saved_at) if isinstance(saved_at, (int, float)) and not isinstance(saved_at, bool) else 0.0
    return Checkpoint(
        layout, clock, arrays[0], arrays[1], samples, info, saved_at, shard, state, model_state, arrays[2:]
    )


def _decode_meta(data: bytes | memoryview) -> dict[str, Any]:
    """Decode a metadata map within the bounds above (``_MAX_*``): what it may cost is bounded
    whatever the file's length. Raises ValueError (with msgpack's reason) if it is not one."""
    budget = _Budget()
    try:
        meta = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            object_hook=budget,
            list_hook=budget,
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_STR,
            max_array_len=_MAX_VALUES,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types; MemoryError too
        raise ValueError(f"not valid msgpack within a checkpoint's limits ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict):
        raise ValueError("not a msgpack map")
    return meta


class _Budget:
    """msgpack's hook for each list and map decoded: counts them and their values, and stops
    the decoding past ``_MAX_CONTAINERS`` or ``_MAX_VALUES``."""

    def __init__(self) -> None:
        self.containers = self.values = 0

    def __call__(self, obj: Any) -> Any:
        self.containers += 1
        self.values += len(obj)
        if self.containers > _MAX_CONTAINERS or self.values > _MAX_VALUES:
            raise ValueError(f"more than {_MAX_CONTAINERS} lists and maps or {_MAX_VALUES} values in them")
        return obj


def _check_state(state: Any, layout: Layout) -> None:
    """Check ``state`` as a server restores it, so that a restore cannot fail half-way: a map
    whose ``staleness`` is a valid histogram, whose ``lr_policy`` is a map (a valid
    mean-staleness state if it has that policy's keys), whose ``groups``, if present,
    cover ``layout``, and whose ``rates``, if present, are one base rate per group. Raises
    ValueError or RequestError naming what is wrong."""
    if not isinstance(state, dict):
        raise ValueError(f"must be a map, got {type(state).__name__}")
    parse_histogram(state.get("staleness", {}))
    check_policy_state(state.get("lr_policy", {}))
    groups = parse_groups(state["groups"], layout) if "groups" in state else (None,)
    rates = state.get("rates", [1.0] * len(groups))
    ok = isinstance(rates, list) and len(rates) == len(groups)
    if not ok or not all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0 for r in rates
    ):
        raise ValueError(f"'rates' must list {len(groups)} finite numbers > 0 (one per group), got {quoted(rates)}")


def _map(meta: dict[str, Any], key: str) -> dict[str, Any]:
    value = meta.get(key)
    return value if isinstance(value, dict) else {}


def _int(meta: dict[str, Any], key: str, path: str) -> int:
    value = meta.get(key)
    if not is_count(value):
        raise CheckpointError(
            f"{path} has bad metadata: {key!r} must be an integer in [0, 2^63-1], got {quoted(value)}"
        )
    return value


def _list(meta: dict[str, Any], key: str, n: int, path: str) -> list[int]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != n or not all(isinstance(v, int) for v in value):
        raise CheckpointError(f"{path} has bad metadata: {key!r} must be a list of {n} integers, got {quoted(value)}")
    return value


def _bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as bytes (of any dtype and shape, 0-d and empty ones too)."""
    return array.reshape(-1).view(np.uint8).data


def _read_exactly(f: BinaryIO, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])  # type: ignore[attr-defined]
        if not n:
            raise CheckpointError("checkpoint ended early")
        done += n


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once at import: os.umask cannot be read without setting it


def _fsync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def shard_path(path: str | None, shard: Shard, *, required: bool = True) -> str | None:
    """The checkpoint path of one shard of a group: ``{shard}`` in ``path`` becomes its index
    (with ``required``, a group of several shards must have it, or they would all write one
    file; a server started alone with ``--shard`` may be given its own path instead)."""
    if not path:
        return None
    if required and shard.count > 1 and "{shard}" not in path:
        raise ConfigError("with several shard servers, put {shard} in --checkpoint (each shard writes its own file)")
    return path.replace("{shard}", str(shard.index))

"""Checkpoints: a server's weights, momentum and clock in one file, written atomically.

A checkpoint file is one frame of the wire format (``docs/wire.md``) of type CHECKPOINT
(9): the 24-byte header, a msgpack metadata map, then two float32 segments, the weights and
the momentum, of the values the file's shard holds. Metadata keys: ``format`` (1),
``clock``, ``layout`` (the whole model's, as in HELLO), ``shard`` ([index, count]),
``samples``, ``crc32`` (of each segment's bytes), ``meta_crc32`` (of the rest of the
metadata, see :func:`_meta_crc`), ``saved_at`` (Unix time), ``state``
(what the server restores besides the arrays: the staleness histogram, the LR policy's
state) and ``info`` (free-form: the server's settings, for people reading the file).

:func:`save` writes to a temporary file in the same directory (``.NAME.PID.*.tmp``), fsyncs
it and renames it over the target, so a crash at any moment leaves either the old or the new
checkpoint, never a mix; the next save deletes the temporaries of processes that are gone. :func:`load` refuses a file that is not a checkpoint, is truncated or fails its CRC,
with a :class:`~rudra_async.errors.CheckpointError` that says which.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgpack
import numpy as np

from .errors import CheckpointError, ConfigError, RudraError
from .layout import Layout, Shard
from .wire import HEADER_SIZE, Limits, MsgType, decode_meta, encode_frame, parse_segments, spec_of, unpack_header

__all__ = [
    "FORMAT",
    "Checkpoint",
    "load",
    "save",
    "shard_path",
]

FORMAT = 1
_LIMITS = Limits(max_meta=1 << 28, max_body=1 << 62)  # two copies of the model; a long LR-policy window


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

    @property
    def size(self) -> int:
        """Values held: the shard's share of the layout."""
        lo, hi = self.shard.range(self.layout.size)
        return hi - lo


def save(path: str | os.PathLike[str], ckpt: Checkpoint) -> None:
    """Write ``ckpt`` to ``path`` atomically (blocking; servers call it from a thread).
    The arrays are written from their own memory, without copies."""
    path = os.fspath(path)
    arrays = [np.ascontiguousarray(a, np.float32).reshape(-1) for a in (ckpt.weights, ckpt.momentum)]
    if any(a.size != ckpt.size for a in arrays):
        raise CheckpointError(f"weights and momentum must have {ckpt.size} values each")
    meta = {
        "format": FORMAT,
        "clock": int(ckpt.clock),
        "layout": ckpt.layout.to_wire(),
        "shard": ckpt.shard.to_wire(),
        "samples": int(ckpt.samples),
        "crc32": [zlib.crc32(a.data) for a in arrays],
        "saved_at": time.time(),
        "state": ckpt.state,
        "info": ckpt.info,
        "seg": [spec_of(a).to_wire() for a in arrays],  # as encode_frame writes it: covered by meta_crc32
    }
    try:
        meta["meta_crc32"] = _meta_crc(decode_meta(msgpack.packb(meta, use_bin_type=True)))  # as it reads back
    except (ValueError, TypeError, OverflowError) as exc:  # metadata msgpack cannot encode
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from None
    directory = os.path.dirname(os.path.abspath(path))
    prefix = f".{os.path.basename(path)}."
    _remove_orphans(directory, prefix)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f"{prefix}{os.getpid()}.", suffix=".tmp")
        with open(fd, "wb") as f:
            for buf in encode_frame(MsgType.CHECKPOINT, meta, arrays, _LIMITS):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(OSError):  # mkstemp made it 0600; give it what open() would
            os.chmod(tmp, 0o666 & ~_UMASK)
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


def _meta_crc(meta: dict[str, Any]) -> int:
    """The CRC-32 of a metadata map as read from a file, without ``meta_crc32``, msgpack-encoded
    (``use_bin_type``, keys in order: packing a decoded map again gives the same bytes)."""
    return zlib.crc32(msgpack.packb({k: v for k, v in meta.items() if k != "meta_crc32"}, use_bin_type=True))


def _remove_orphans(directory: str, prefix: str) -> None:
    """Delete the temporaries of saves of this checkpoint whose process is gone (killed
    mid-save: each is model-sized): exactly ``prefix`` + pid + ``.`` + mkstemp's 8 characters
    + ``.tmp``, so another checkpoint's (``NAME.1000``'s, say) never matches. Those of a
    living process, and anything else, stay."""
    orphan = re.compile(re.escape(prefix) + r"([0-9]{1,7})\.[a-z0-9_]{8}\.tmp")
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            match = orphan.fullmatch(entry.name)
            if match and not _alive(int(match[1])):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # another user's process; a pid beyond the platform's
        return True
    return True


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
        meta = decode_meta(f.read(header.meta_len))
        specs = parse_segments(meta, header.body_len)
        layout = Layout.from_wire(meta.get("layout"))
        shard = Shard.from_wire(meta.get("shard"))
        lo, hi = shard.range(layout.size)
    except RudraError as exc:
        raise CheckpointError(f"{path} has bad metadata: {exc}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {meta.get('format')!r}; this version reads {FORMAT}")
    if "meta_crc32" in meta and meta["meta_crc32"] != _meta_crc(meta):  # absent in files of earlier versions
        raise CheckpointError(f"{path} is corrupt: its metadata fails its CRC-32 check")
    if [(s.dtype.str, s.shape) for s in specs] != [("<f4", (hi - lo,))] * 2:
        raise CheckpointError(f"{path} must hold two float32 segments of {hi - lo} values")
    arrays = [np.empty(hi - lo, np.float32) for _ in specs]
    for a, crc in zip(arrays, _list(meta, "crc32", 2)):
        _read_exactly(f, a.data.cast("B"))
        if zlib.crc32(a.data) != crc:
            raise CheckpointError(f"{path} is corrupt: a segment fails its CRC-32 check")
    clock, samples = _int(meta, "clock"), _int(meta, "samples")
    info, state = (_map(meta, k) for k in ("info", "state"))
    saved_at = meta.get("saved_at", 0.0)
    saved_at = float(saved_at) if isinstance(saved_at, (int, float)) and not isinstance(saved_at, bool) else 0.0
    return Checkpoint(layout, clock, arrays[0], arrays[1], samples, info, saved_at, shard, state)


def _map(meta: dict[str, Any], key: str) -> dict[str, Any]:
    value = meta.get(key)
    return value if isinstance(value, dict) else {}


def _int(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"checkpoint metadata {key!r} must be an integer >= 0, got {value!r}")
    return value


def _list(meta: dict[str, Any], key: str, n: int) -> list[int]:
    value = meta.get(key)
    if not isinstance(value, list) or len(value) != n or not all(isinstance(v, int) for v in value):
        raise CheckpointError(f"checkpoint metadata {key!r} must be a list of {n} integers, got {value!r}")
    return value


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

"""The metadata schema of every request: one table of fields per message type.

Each field has a declared type, presence (required, or optional with a default) and range;
:func:`check` reads a request's metadata against its table before anything uses it and
answers a violation with :class:`~rudra_async.errors.RequestError` ``bad_request`` naming
the field. Fields that are not declared are ignored (a newer client may send more). The
field tables of ``docs/wire.md`` are generated from here (:func:`markdown_table`;
``python -m rudra_async.schema`` prints them) and a test holds the two equal.

Only the shape of a value is checked here; rules that need the server's state (a
timestamp ahead of the clock, a layout that differs from the model's) stay with the server
and keep their own codes.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, TypeGuard

import msgpack

from .errors import RequestError, quoted
from .wire import MAX_DIMS, MAX_SEGMENTS, NONCE_BYTES, MsgType, is_int

__all__ = ["FIELDS", "Field", "check", "markdown_table"]

INT64_MAX = 2**63 - 1


def is_count(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is a msgpack integer in [0, 2^63 − 1] (a count, a clock)."""
    return is_int(value) and 0 <= value <= INT64_MAX


def all_counts(values: list[Any]) -> bool:
    """Whether every one of ``values`` :func:`is_count`; a long list of plain ints (a
    mean-staleness window of millions, checked at every checkpoint) by its types in one pass
    and its range by its min and max, ~7x faster than value by value."""
    if values and set(map(type, values)) == {int}:
        return bool(min(values) >= 0 and max(values) <= INT64_MAX)
    return all(is_count(v) for v in values)


MAX_NAME = 256  # characters of a learner's name
MAX_SAMPLES = 2**32  # examples behind one gradient
MAX_INDEX = 2**32  # a learner index
MAX_TENSORS = MAX_SEGMENTS  # tensors in a layout: a push may send one segment per tensor
#: bytes of a request's ``seq`` at most, msgpack-encoded as its reply echoes it (a float
#: there is a float 64): every reply then fits the metadata limit
MAX_SEQ_BYTES = 1 << 16


@dataclass(frozen=True)
class Field:
    """One metadata field. ``kind``: ``int``, ``bool``, ``str``, ``number`` (int or float),
    ``bytes``, ``layout``, ``shard`` or ``any``; ``low``/``high`` bound an ``int`` (or a
    ``number``), and a ``str``'s or ``bytes``' length with ``size``."""

    name: str
    kind: str
    meaning: str
    required: bool = False
    default: Any = None
    low: int | None = None
    high: int | None = None
    size: tuple[int, int] | None = None  # (min, max) length of a str or bytes; encoded bytes of an any
    choices: tuple[str, ...] | None = None  # the values a ``str`` may take

    def describe_type(self) -> str:
        kind = {
            "layout": "list of `[str, list of int]`",
            "shard": "`[int, int]`",
            "groups": "list of `[int, float, float]`",
            "state": "list of `[str, str, list of int, str]`",
            "rates": "list of float or int",
            "number": "float or int",
        }.get(self.kind, self.kind)
        if self.choices is not None:
            kind += ": " + " or ".join(f'`"{c}"`' for c in self.choices)
        if self.kind in ("int", "number") and (self.low is not None or self.high is not None):
            kind += " in " + _range(self.low, self.high)
        if self.size is not None:
            lo, hi = self.size
            if self.kind == "any":
                kind += f", at most {hi:,} bytes encoded"
            else:
                kind += f", {lo} bytes" if lo == hi else f", at most {hi} characters"
        return kind

    def describe_presence(self) -> str:
        return "required" if self.required else "optional"

    def describe_default(self) -> str:
        if self.required:
            return "—"
        if self.default is None:
            return "absent"
        return f"`{_literal(self.default)}`"


def _range(low: int | None, high: int | None) -> str:
    def bound(v: int | None, inf: str) -> str:
        if v is None:
            return inf
        if v == INT64_MAX:
            return "2^63−1"
        if v >= 1 << 20 and (v & (v - 1)) == 0:
            return f"2^{v.bit_length() - 1}"
        return str(v)

    return f"[{bound(low, '−∞')}, {bound(high, '∞')}]"


def _literal(value: Any) -> str:
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


SEQ = Field("seq", "any", "echoed unchanged in the reply (see [Sequence numbers](#frame))", size=(0, MAX_SEQ_BYTES))

#: the fields of every request a server reads, by message type, in checking order
FIELDS: dict[MsgType, tuple[Field, ...]] = {
    MsgType.AUTH: (
        Field("nonce", "bytes", "the learner's fresh random nonce N_c", required=True, size=(NONCE_BYTES, NONCE_BYTES)),
        SEQ,
    ),
    MsgType.PROOF: (
        Field(
            "proof",
            "bytes",
            "HMAC-SHA256(K, `rudra-async v1 client` ‖ N_c ‖ N_s)",
            required=True,
            size=(NONCE_BYTES, NONCE_BYTES),
        ),
        SEQ,
    ),
    MsgType.HELLO: (
        Field("name", "str", "the learner's name, for logs and statistics", default="", size=(0, MAX_NAME)),
        Field(
            "layout",
            "layout",
            f"the whole model's tensors, in order: `[name, shape]` each; non-empty, at most {MAX_TENSORS:,} tensors "
            f"of at most {MAX_DIMS} dimensions each",
            required=True,
        ),
        Field(
            "shard",
            "shard",
            "`[index, count]` with 0 ≤ index < count: the shard this learner addresses",
            default=[0, 1],
        ),
        Field(
            "groups",
            "groups",
            "parameter groups, as `torch.optim` has them: `[tensors, lr, weight_decay]` for runs of consecutive "
            "tensors in layout order, covering every tensor (`bad_groups` otherwise). The first HELLO (the one "
            "that brings the initial weights) sets them; a later HELLO that carries groups must carry the same "
            "(`groups_mismatch`), one without takes the server's. See [protocols.md](protocols.md#parameter-groups).",
        ),
        Field(
            "reader",
            "bool",
            "a client that only reads the weights (evaluation, monitoring): it never takes part in a round, holds "
            "no learner index, and its pushes are refused (`read_only`)",
            default=False,
        ),
        Field(
            "index",
            "int",
            "the learner index this learner asks for (its part of the data: see [below](#hello-1-learner--server)); "
            "absent: the lowest free one",
            low=0,
            high=MAX_INDEX,
        ),
        Field(
            "state",
            "state",
            "the model's state besides its trained parameters: its frozen parameters and buffers (BatchNorm's "
            'running statistics, ...), `[name, dtype, shape, kind]` each with `kind` `"frozen"` or `"buffer"`, '
            f"at most {MAX_TENSORS:,}; see [STATE](#state-14)",
        ),
        SEQ,
    ),
    MsgType.PUSH: (
        Field(
            "learner_id",
            "int",
            "if present, must be the `learner_id` of this connection's WELCOME (`bad_request` otherwise)",
            low=0,
            high=INT64_MAX,
        ),
        Field(
            "timestamp",
            "int",
            "the clock of the weights the gradient was computed on (the `timestamp` of the WEIGHTS it used): "
            "the stamp j of [protocols.md](protocols.md#symbols); 0 ≤ `timestamp` ≤ the clock when the push "
            "arrives (`bad_timestamp` otherwise)",
            required=True,
        ),
        Field(
            "step",
            "int",
            "the learner's own step counter; informative, the server does not read it",
            default=0,
        ),
        Field(
            "samples",
            "int",
            "the number of examples the gradient was computed over (S_l); see [below](#push-3-learner--server)",
            default=0,
            low=0,
            high=MAX_SAMPLES,
        ),
        Field(
            "loss",
            "number",
            'the mini-batch\'s training loss, for `stats()["loss_curve"]`; a NaN or infinity is not recorded',
        ),
        Field("pull", "bool", "answer with WEIGHTS instead of ACK", default=False),
        Field(
            "lr",
            "rates",
            "one base rate per parameter group (each finite and > 0): from the update that applies this gradient "
            "on, the groups' α0_G (a learning-rate scheduler's changes; see "
            "[protocols.md](protocols.md#parameter-groups))",
        ),
        SEQ,
    ),
    MsgType.PULL: (
        Field(
            "newer_than",
            "int",
            "answer once the clock is greater than this (−1: at once)",
            default=-1,
            low=-1,
            high=INT64_MAX,
        ),
        SEQ,
    ),
    MsgType.STATE: (
        Field(
            "tensors",
            "str",
            "which of this learner's state tensors the segments carry, in the `state` order of its HELLO: all, or "
            "only the buffers",
            default="buffers",
            choices=("all", "buffers"),
        ),
        Field("reply", "bool", "answer with the run's state tensors (all of them)", default=False),
        SEQ,
    ),
    MsgType.BYE: (
        Field("reason", "str", "why the learner leaves (informative)", default="", size=(0, MAX_NAME)),
        SEQ,
    ),
}


def _bad(field: Field, value: Any) -> RequestError:
    return RequestError(
        f"field {field.name!r} must be {field.describe_type()}, got {quoted(value)}", code="bad_request"
    )


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` msgpack-encoded as a reply encodes it (a float as a float 64)."""
    if value is None or isinstance(value, (bool, int, float)):
        return 9  # at most
    return len(msgpack.packb(value, use_bin_type=True))


def seq_fits(meta: dict[str, Any]) -> bool:
    """Whether a request's ``seq`` (if any) may be echoed: at most :data:`MAX_SEQ_BYTES` encoded."""
    return "seq" not in meta or encoded_size(meta["seq"]) <= MAX_SEQ_BYTES


def check_seq(meta: dict[str, Any]) -> None:
    """``bad_request`` naming ``seq`` unless :func:`seq_fits` (for any request, before anything
    else of it is read: its reply could not carry the ``seq``)."""
    if not seq_fits(meta):
        raise _bad(SEQ, meta["seq"])


def _check_value(field: Field, value: Any) -> Any:
    kind = field.kind
    if kind == "any":
        if field.size is not None and encoded_size(value) > field.size[1]:
            raise _bad(field, value)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise _bad(field, value)
        return value
    if kind in ("int", "number"):
        ok = is_int(value) or (kind == "number" and isinstance(value, float))
        if not ok:
            raise _bad(field, value)
        if (field.low is not None and value < field.low) or (field.high is not None and value > field.high):
            raise _bad(field, value)
        return value
    if kind in ("str", "bytes"):
        if not isinstance(value, str if kind == "str" else bytes):
            raise _bad(field, value)
        if field.size is not None and not field.size[0] <= len(value) <= field.size[1]:
            raise _bad(field, value)
        if field.choices is not None and value not in field.choices:
            raise _bad(field, value)
        return value
    if kind == "state":  # the entries' content is the server's to check (model_state.StateLayout)
        if not isinstance(value, list) or len(value) > MAX_TENSORS or not all(isinstance(v, list) for v in value):
            raise _bad(field, value)
        return value
    if kind == "rates":
        ok = isinstance(value, list) and 0 < len(value) <= MAX_TENSORS
        if not ok or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
            raise _bad(field, value)
        if not all(math.isfinite(x) and x > 0 for x in value):
            raise _bad(field, value)
        return value
    if kind == "layout":
        if not isinstance(value, list) or len(value) > MAX_TENSORS:
            raise _bad(field, value)
        for item in value:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                raise _bad(field, item)
            if not (isinstance(item[1], list) and all(is_int(d) for d in item[1])):
                raise _bad(field, item)
        return value
    if kind == "groups":
        if not (isinstance(value, list) and value):
            raise _bad(field, value)
        for item in value:
            if not (isinstance(item, list) and len(item) == 3 and is_int(item[0])):
                raise _bad(field, item)
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item[1:]):
                raise _bad(field, item)
        return value
    if kind == "shard":
        if not (isinstance(value, list) and len(value) == 2 and all(is_int(v) for v in value)):
            raise _bad(field, value)
        if not 0 <= value[0] < value[1]:
            raise _bad(field, value)
        return value
    raise AssertionError(f"unknown field kind {kind!r}")


def check(msg_type: MsgType, meta: dict[str, Any]) -> dict[str, Any]:
    """The declared fields of a ``msg_type`` request, checked, with defaults filled in for
    absent optional ones (absent fields without a default stay absent); ``bad_request``
    naming the first field that violates its declaration."""
    out: dict[str, Any] = {}
    for field in FIELDS.get(msg_type, ()):
        if field.name not in meta:
            if field.required:
                raise RequestError(f"field {field.name!r} is required", code="bad_request")
            if field.default is not None:
                out[field.name] = field.default
            continue
        out[field.name] = _check_value(field, meta[field.name])
    return out


def markdown_table(msg_type: MsgType) -> str:
    """The field table of ``docs/wire.md`` for ``msg_type``."""
    rows = ["| field | type | presence | default | meaning |", "|-------|------|----------|---------|---------|"]
    for f in FIELDS[msg_type]:
        rows.append(
            f"| `{f.name}` | {f.describe_type()} | {f.describe_presence()} | {f.describe_default()} | {f.meaning} |"
        )
    return "\n".join(rows)


def main() -> None:
    for msg_type in FIELDS:
        sys.stdout.write(f"### {msg_type.name} ({int(msg_type)})\n\n{markdown_table(msg_type)}\n\n")


if __name__ == "__main__":
    main()

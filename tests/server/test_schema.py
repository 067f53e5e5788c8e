"""The request schema: docs/wire.md's field tables are the code's, and every violation of a
declared type or range is answered ``bad_request`` naming the field (table-driven, against
a real server)."""

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import initial_weights, read_frame, run_server, small_layout

from rudra_async import schema, security
from rudra_async.wire import MsgType, encode_frame

LAYOUT = small_layout()
SECRET = "4f9c2b7e1a8d3c6f0e5b9a2d7c4f1e8b"
DOC = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text()

#: wrong values for each kind of field (type violations), and range violations per field
WRONG_TYPE = {
    "int": ["7", 1.5, True, None, [1]],
    "bool": [1, "yes", None],
    "str": [7, b"raw", ["a"]],
    "number": ["x", True, [1.0]],
    "bytes": ["a" * 32, 7],
    "layout": ["x", [["w"]], [[1, [2]]], [["w", ["a"]]], [["w", 3]]],
    "shard": ["0/1", [1], [2, 2], [0, 1.0], [-1, 1]],
    "groups": ["x", [], [[1, 0.1]], [[1.5, 0.1, 0.0]], [[1, "fast", 0.0]], [[1, 0.1, True]]],
    "state": ["x", ["w"], [1, 2]],
    "rates": ["x", [], [0.1, "fast"], [0.0], [-0.1], [float("inf")], [True]],
    "any": [],
}


def out_of_range(field):
    if field.kind in ("int", "number"):
        return [
            v
            for v in (None if field.low is None else field.low - 1, None if field.high is None else field.high + 1)
            if v is not None
        ]
    if field.kind in ("str", "bytes") and field.size is not None:
        lo, hi = field.size
        long = ("x" if field.kind == "str" else b"x") * (hi + 1)
        return [long] + ([b"x" * (lo - 1)] if field.kind == "bytes" and lo else [])
    if field.choices is not None:
        return ["none of " + "/".join(field.choices)]
    return []


def valid_meta(msg_type):
    return {
        MsgType.AUTH: {"nonce": bytes(32)},
        MsgType.PROOF: {"proof": bytes(32)},
        MsgType.HELLO: {"layout": LAYOUT.to_wire(), "name": "t"},
        MsgType.PUSH: {"timestamp": 0},
        MsgType.PULL: {},
        MsgType.STATE: {},
        MsgType.BYE: {},
    }[msg_type]


CASES = [
    (mt, f.name, value)
    for mt, fields in schema.FIELDS.items()
    for f in fields
    for value in WRONG_TYPE[f.kind] + out_of_range(f)
] + [(mt, f.name, "<missing>") for mt, fields in schema.FIELDS.items() for f in fields if f.required]


def test_the_documented_field_tables_are_the_schema():
    for msg_type in schema.FIELDS:
        assert schema.markdown_table(msg_type) in DOC, f"docs/wire.md's table for {msg_type.name} is not the schema's"


def test_the_schema_fills_defaults_and_keeps_what_is_given():
    assert schema.check(MsgType.PULL, {}) == {"newer_than": -1}
    assert schema.check(MsgType.PUSH, {"timestamp": 3, "pull": True, "x": 1}) == {
        "timestamp": 3,
        "step": 0,
        "samples": 0,
        "pull": True,
    }


def wire(msg_type, meta, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta, arrays))


@pytest.mark.parametrize("msg_type, name, value", CASES, ids=[f"{m.name}-{n}-{v!r}"[:60] for m, n, v in CASES])
async def test_every_field_violation_is_bad_request_naming_the_field(msg_type, name, value):
    handshake = msg_type in (MsgType.AUTH, MsgType.PROOF)
    meta = dict(valid_meta(msg_type))
    if value == "<missing>":
        meta.pop(name, None)
    else:
        meta[name] = value
    meta["seq"] = 5
    async with run_server(kernel="numpy", secret=SECRET if handshake else None) as server:
        host, port = server.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        if msg_type == MsgType.PROOF:
            writer.write(wire(MsgType.AUTH, {"nonce": security.new_nonce()}))
            assert (await read_frame(reader)).msg_type == MsgType.CHALLENGE
        if msg_type in (MsgType.PUSH, MsgType.PULL, MsgType.STATE):
            writer.write(wire(MsgType.HELLO, valid_meta(MsgType.HELLO), [initial_weights(LAYOUT)]))
            assert (await read_frame(reader)).msg_type == MsgType.WELCOME
        arrays = {MsgType.PUSH: [np.zeros(LAYOUT.size, np.float32)], MsgType.HELLO: [initial_weights(LAYOUT)]}
        writer.write(wire(msg_type, meta, arrays.get(msg_type, [])))
        reply = await read_frame(reader)
        assert reply.msg_type == MsgType.ERROR, reply.meta
        assert reply.meta["code"] == "bad_request", reply.meta
        assert repr(name) in reply.meta["message"], reply.meta
        assert reply.meta["fatal"] is handshake and reply.meta["seq"] == 5
        assert server.core.store is None or server.clock == 0  # refused before any state change
        assert not any(info.connected for info in server.core.learners.values()) or msg_type != MsgType.HELLO
        writer.close()


def test_every_refusal_code_is_documented_and_counted_from_zero_in_the_metrics():
    """The codes of wire.md's error table (but shutting_down, no refusal) and the closes
    without an ERROR that observability.md lists are the ones the metrics show from zero."""
    from rudra_async.server.core import REFUSAL_CODES

    table = DOC[DOC.index("| code | fatal |") :]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M)) - {"shutting_down"}
    observability = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    row = next(line for line in observability.splitlines() if line.startswith("| `rudra_rejected_total{code}`"))
    closes = {"auth_abandoned", "too_many_connections", "evicted", "handshake_timeout", "idle_timeout"}
    closes |= {"reply_not_read", "push_not_written"}
    assert all(f"`{code}`" in row for code in closes)
    assert set(REFUSAL_CODES) == documented | closes and len(REFUSAL_CODES) == len(set(REFUSAL_CODES))

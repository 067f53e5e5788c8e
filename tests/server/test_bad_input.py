"""Hostile and mistaken input: never takes the server down, never changes the weights.

A well-behaved learner keeps pushing zero gradients (which leave the weights as they are)
through the whole barrage; at the end the weights must equal the initial ones bit for bit.
"""

import asyncio
import logging
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest
from helpers import initial_weights, read_frame, run_server, small_layout

from rudra_async.client import Client
from rudra_async.wire import HEADER, MAGIC, MsgType, encode_frame

LAYOUT = small_layout()


def frame(msg_type, meta=None, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta, arrays))


def raw_header(magic=MAGIC, version=1, mtype=int(MsgType.PUSH), meta_len=0, body_len=0):
    return HEADER.pack(magic, version, mtype, 0, meta_len, body_len)


_LONG_SEG = msgpack.packb({"timestamp": 0, "seg": [["<f4", "y" * 100_000]]})
LONG_DESCRIPTOR = raw_header(meta_len=len(_LONG_SEG)) + _LONG_SEG  # quoted in the reply, cut short
LONG_NAME_HELLO = frame(MsgType.HELLO, {"layout": LAYOUT.to_wire(), "name": ["n" * 100_000]})
_HUGE_META = msgpack.packb({"timestamp": 0, "seg": [["<f4", [10**6]]]})
HUGE_PUSH_HEADER = raw_header(meta_len=len(_HUGE_META), body_len=4 * 10**6) + _HUGE_META  # body never sent
HELLO = frame(MsgType.HELLO, {"layout": LAYOUT.to_wire(), "name": "raw"})
GOOD_GRAD = np.zeros(LAYOUT.size, np.float32)


def push(arrays, **meta):
    return frame(MsgType.PUSH, {"timestamp": 0, **meta}, arrays)


# (name, bytes sent after connecting, expected code, fatal, say hello first)
CASES = [
    ("garbage", os.urandom(64).replace(b"R", b"r"), "bad_magic", True, False),
    ("wrong-magic", raw_header(magic=b"HTTP"), "bad_magic", True, False),
    ("wrong-version", raw_header(version=2), "bad_version", True, False),
    ("oversize-length", raw_header(body_len=2**62), "frame_too_large", True, False),
    ("larger-than-model", HUGE_PUSH_HEADER, "frame_too_large", True, True),
    ("unknown-type", frame(99, {"x": 1}, [np.ones(3, np.float32)]), "unknown_type", False, False),
    ("bad-metadata", raw_header(meta_len=3) + b"\xc1\xc1\xc1", "malformed", False, False),
    ("push-before-hello", push([GOOD_GRAD]), "not_registered", False, False),
    ("wrong-shape", push([np.zeros(LAYOUT.size + 1, np.float32)]), "bad_shape", False, True),
    ("segments-short", push([GOOD_GRAD[:4], GOOD_GRAD[5:]]), "bad_shape", False, True),
    ("segment-2d", push([GOOD_GRAD[:4].reshape(2, 2), GOOD_GRAD[4:]]), "bad_shape", False, True),
    ("segments-mixed", push([GOOD_GRAD[:4], GOOD_GRAD[4:].astype(np.float16)]), "bad_dtype", False, True),
    ("wrong-dtype", push([np.zeros(LAYOUT.size, np.float64)]), "bad_dtype", False, True),
    ("nan-gradient", push([np.full(LAYOUT.size, np.nan, np.float32)]), "bad_gradient", False, True),
    ("future-timestamp", push([GOOD_GRAD], timestamp=10**9), "bad_timestamp", False, True),
    ("timestamp-not-int", push([GOOD_GRAD], timestamp="0"), "bad_request", False, True),
    ("bad-layout", frame(MsgType.HELLO, {"layout": [["w", [-1]]]}), "bad_layout", False, False),
    ("long-descriptor", LONG_DESCRIPTOR, "malformed", False, True),
    ("long-name", LONG_NAME_HELLO, "bad_request", False, False),
]


async def steady_learner(url, stop: asyncio.Event) -> int:
    client = await Client.connect(url, LAYOUT, name="steady")
    w = await client.pull()
    pushes = 0
    while not stop.is_set() or pushes < 20:
        w = await client.push_pull(GOOD_GRAD, w.timestamp)
        pushes += 1
        await asyncio.sleep(0.001)
    await client.close()
    return pushes


async def expect_closed(reader: asyncio.StreamReader) -> None:
    assert await asyncio.wait_for(reader.read(), 5) == b""


async def test_bad_input_gets_a_coded_error_and_changes_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="rudra_async.server")
    w0 = initial_weights(LAYOUT)
    async with run_server(momentum=0.0) as ps:
        url = ps.addresses[0]
        owner = await Client.connect(url, LAYOUT, w0, name="owner")
        stop = asyncio.Event()
        steady = asyncio.create_task(steady_learner(url, stop))
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        for name, payload, code, fatal, hello_first in CASES:
            reader, writer = await asyncio.open_connection(host, int(port))
            if hello_first:
                writer.write(HELLO)
                assert (await read_frame(reader)).msg_type == MsgType.WELCOME
            writer.write(payload)
            reply = await read_frame(reader)
            assert reply.msg_type == MsgType.ERROR, name
            assert reply.meta["code"] == code, name
            assert reply.meta["fatal"] is fatal, name
            assert 0 < len(reply.meta["message"]) <= 1000, name  # docs/wire.md, whatever the request quotes
            if fatal:
                await expect_closed(reader)
            else:  # the connection is still usable: a request after the bad one is served
                writer.write(frame(MsgType.PULL, {"seq": 7}) if hello_first else HELLO)
                ok = await read_frame(reader)
                assert ok.msg_type in (MsgType.WEIGHTS, MsgType.WELCOME), name
            writer.close()
            assert f"[{code}]" in caplog.text, name
        stop.set()
        assert await asyncio.wait_for(steady, 10) >= 20  # the well-behaved learner went on all along
        assert ps.clock >= 20
        np.testing.assert_array_equal(ps.core.store.weights, w0)
        assert sum(ps.core.rejected.values()) == len(CASES)
        await owner.close()


@pytest.mark.parametrize("cut", ["in-header", "in-metadata", "in-body"])
async def test_truncated_frame_is_dropped_without_effect(cut, caplog):
    w0 = initial_weights(LAYOUT)
    async with run_server(momentum=0.0) as ps:
        url = ps.addresses[0]
        owner = await Client.connect(url, LAYOUT, w0)
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(HELLO)
        await read_frame(reader)
        data = push([np.ones(LAYOUT.size, np.float32)])
        stop_at = {"in-header": 10, "in-metadata": HEADER.size + 3, "in-body": len(data) - 5}[cut]
        writer.write(data[:stop_at])
        await writer.drain()
        writer.close()
        await asyncio.sleep(0.2)
        # the server is fine, the weights are not touched, and a learner is served
        w = await owner.pull()
        np.testing.assert_array_equal(w.array, w0)
        assert ps.clock == 0
        await owner.push(np.zeros(LAYOUT.size, np.float32), 0)
        assert ps.clock == 1
        await owner.close()


def test_documented_pull_example_is_what_the_encoder_writes():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "wire.md").read_text()
    block = doc.split("## Example: a PULL")[1].split("```")[1]
    assert bytes.fromhex(block) == frame(MsgType.PULL, {"newer_than": -1})

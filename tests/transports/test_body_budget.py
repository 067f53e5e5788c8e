"""A TCP connection receiving through a server's budget of large bodies (rudra_async.bodies):
a wait that lasts too long takes one more buffer and leaves no waiter behind; a connection
that closes, even while lingering after an error, gives every buffer back."""

import asyncio
import logging

import numpy as np

from rudra_async import transports
from rudra_async.bodies import BodyBudget
from rudra_async.transports import stream
from rudra_async.wire import Limits, MsgType, encode_frame

MIB = 1 << 20


def large_frame(mib: int = 4) -> bytes:
    return b"".join(bytes(p) for p in encode_frame(5, {}, [np.ones(mib * MIB // 4, np.float32)], Limits()))


async def serve(budget: BodyBudget):
    """A listener whose connections receive through ``budget``; (listener, port, accepted, frames)."""
    accepted, frames = [], []

    def on_accept(conn):
        conn.bodies = budget
        accepted.append(conn)

    async def on_connection(conn):
        while True:
            frames.append(await conn.recv())

    listener = await transports.listen("tcp://127.0.0.1:0", on_connection, limits=Limits(), on_accept=on_accept)
    return listener, listener.sockets[0].getsockname()[1], accepted, frames


async def test_a_wait_that_lasts_too_long_takes_one_more_buffer_and_leaves_no_waiter(monkeypatch, caplog):
    monkeypatch.setattr(stream, "BODY_WAIT_S", 0.2)
    budget = BodyBudget(limit=1)
    held = budget.take(4 * MIB)  # whatever else holds the only buffer
    listener, port, _, frames = await serve(budget)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        with caplog.at_level(logging.WARNING, "rudra_async.transports.stream"):
            writer.write(large_frame())
            await writer.drain()
            for _ in range(100):
                if frames:
                    break
                await asyncio.sleep(0.02)
        assert len(frames) == 1 and frames[0].arrays[0].sum() == MIB  # whole, after the forced buffer
        assert "no gradient buffer came free" in caplog.text
        assert budget.waiting == 0 and budget.in_use == 2
        frames[0].release()
        held.give_back()
        assert budget.in_use == 0 and budget.waiting == 0  # nobody was still served a buffer
    finally:
        writer.close()
        await listener.close()


async def test_a_connection_closed_while_lingering_mid_body_gives_its_buffer_back(monkeypatch):
    monkeypatch.setattr(stream, "LINGER_S", 0.3)
    budget = BodyBudget(limit=2)
    listener, port, accepted, _ = await serve(budget)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(50):
            if accepted:
                break
            await asyncio.sleep(0.02)
        accepted[0].hang_up(MsgType.ERROR, {"code": "evicted", "message": "go away", "fatal": True})
        data = large_frame()
        writer.write(data[: len(data) // 2])  # half a large body while the server lingers
        await writer.drain()
        await asyncio.sleep(0.6)  # the linger ends with the body still in progress
        assert budget.in_use == 0 and budget.waiting == 0
    finally:
        writer.close()
        await listener.close()

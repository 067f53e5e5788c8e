"""A small push+pull answered from the transport's callback (``SessionShell.express``): the same
replies, accounting and order as the queued path, declined whenever it cannot answer at once."""

import asyncio
import time

import numpy as np
import pytest
from helpers import initial_weights, read_frame, run_server, small_layout

from rudra_async import RemoteError, RudraError
from rudra_async.client import Client
from rudra_async.layout import Shard
from rudra_async.server import session as session_module
from rudra_async.server.shell import SessionShell
from rudra_async.sync import Softsync
from rudra_async.wire import FrameReader, MsgType, encode_frame


@pytest.fixture
def answered(monkeypatch):
    """Counts the frames ``SessionShell.express`` answered (True) and declined (False)."""
    counts = {True: 0, False: 0}
    express = SessionShell.express

    def counting(self, frame):
        took = express(self, frame)
        counts[took] += 1
        return took

    monkeypatch.setattr(SessionShell, "express", counting)
    return counts


async def trajectory(url_scheme: str, steps: int, **server) -> list[np.ndarray]:
    """The weights after each of ``steps`` push+pulls of seeded gradients, one learner."""
    layout = small_layout()
    rng = np.random.default_rng(7)
    async with run_server(listen=[f"{url_scheme}://127.0.0.1:0" if url_scheme == "tcp" else "shm://"], **server) as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        w = await client.pull()
        seen = []
        for step in range(steps):
            g = rng.standard_normal(layout.size).astype(np.float32)
            w = await client.push_pull(g, w.timestamp, step, samples=4)
            assert w.timestamp == step + 1
            seen.append(w.array.copy())
        stats = ps.stats()
        assert stats["updates"] == steps and stats["samples"] == 4 * steps
        assert stats["learners"]["0"]["gradients"] == steps and stats["rejected"] == {}
        await client.close()
    return seen


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
async def test_async_push_pull_is_answered_at_once_and_equals_the_queued_path(scheme, answered):
    rates = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
    at_once = await trajectory(scheme, 12, protocol="async", **rates)
    assert answered[True] == 12
    answered[True] = 0
    queued = await trajectory(scheme, 12, protocol="softsync", protocol_options={"n": 1}, **rates)  # same rule, λ=1
    assert answered[True] == 0  # softsync may hold gradients: never answered at once
    for a, b in zip(at_once, queued):
        np.testing.assert_array_equal(a, b)


async def test_a_refused_push_is_refused_once_the_usual_way(answered):
    layout = small_layout()
    async with run_server() as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        w = await client.pull()
        g = np.ones(layout.size, np.float32)
        with pytest.raises(RemoteError) as err:
            await client.push_pull(g, w.timestamp + 5)
        assert err.value.code == "bad_timestamp"
        assert answered == {True: 0, False: 2}  # the pull, then the refused push
        w = await client.push_pull(g, w.timestamp)
        assert w.timestamp == 1 and answered[True] == 1
        stats = ps.stats()
        assert stats["rejected"] == {"bad_timestamp": 1} and stats["updates"] == 1
        await client.close()


async def test_a_model_above_the_limit_goes_the_queued_way(answered, monkeypatch):
    monkeypatch.setattr(session_module, "EXPRESS_MAX_VALUES", small_layout().size - 1)
    layout = small_layout()
    async with run_server() as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        w = await client.pull()
        w = await client.push_pull(np.ones(layout.size, np.float32), w.timestamp)
        assert w.timestamp == 1 and answered == {True: 0, False: 2}  # the pull and the push
        await client.close()


async def test_pipelined_requests_are_answered_in_order(answered):
    """Three requests in one write: the first is answered at once, the pull behind it is
    queued, and the push after that waits its turn (the inbox is not empty, or the
    session is busy with the pull): the replies come in the order of the requests."""
    layout = small_layout()
    w0 = initial_weights(layout)
    g = np.full(layout.size, 0.5, np.float32)
    async with run_server(lr=0.1, momentum=0.0, max_updates=2) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            hello = {"name": "raw", "layout": layout.to_wire(), "shard": Shard().to_wire(), "seq": 0}
            writer.writelines(encode_frame(MsgType.HELLO, hello, [w0]))
            assert (await read_frame(reader)).msg_type == MsgType.WELCOME
            requests = [
                (MsgType.PUSH, {"timestamp": 0, "samples": 1, "pull": True, "seq": 1}, [g]),
                (MsgType.PULL, {"newer_than": -1, "seq": 2}, []),
                (MsgType.PUSH, {"timestamp": 1, "samples": 1, "pull": True, "seq": 3}, [g]),
            ]
            writer.writelines([part for request in requests for part in encode_frame(*request)])
            replies = await read_frames(reader, len(requests))
            assert [(r.msg_type, r.meta["seq"], r.meta["timestamp"]) for r in replies] == [
                (MsgType.WEIGHTS, 1, 1),
                (MsgType.WEIGHTS, 2, 1),
                (MsgType.WEIGHTS, 3, 2),
            ]
            assert [r.meta["stop"] for r in replies] == [False, False, True]
            np.testing.assert_array_equal(replies[0].arrays[0], replies[1].arrays[0])
            np.testing.assert_allclose(replies[2].arrays[0], w0 - 2 * 0.1 * 0.5, rtol=1e-6)  # two updates of lr · g
            assert answered[True] >= 1  # 2 if the third push arrived after the pull was answered
        finally:
            writer.close()
            await writer.wait_closed()


async def read_frames(reader: asyncio.StreamReader, count: int) -> list:
    """``count`` frames from a raw stream that may bring several in one read."""
    fr, frames = FrameReader(), []
    while len(frames) < count:
        buf = fr.get_buffer()
        data = await asyncio.wait_for(reader.read(len(buf)), 5)
        assert data, "the server closed the connection"
        buf[: len(data)] = data
        frames += fr.advance(len(data))
    return frames


async def test_an_update_off_the_loop_goes_the_queued_way(answered, monkeypatch):
    from rudra_async.server import store as store_module

    monkeypatch.setattr(store_module, "BACKGROUND_MIN_VALUES", 1)  # every model updated on the update thread
    layout = small_layout()
    async with run_server() as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        w = await client.pull()
        w = await client.push_pull(np.ones(layout.size, np.float32), w.timestamp)
        assert w.timestamp == 1 and answered[True] == 0
        await client.close()


class HoldsAGradient(Softsync):
    """A protocol that wrongly inherits answers_at_once although it may hold gradients."""

    name = "holds"
    answers_at_once = True

    def __init__(self, now=time.monotonic) -> None:
        super().__init__(2, now)

    @property
    def c(self) -> int:
        return 2  # two gradients per update: the first push is held


async def test_a_protocol_that_breaks_answers_at_once_closes_the_connection_loudly(answered, caplog):
    layout = small_layout()
    async with run_server(protocol="test_express:HoldsAGradient") as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        w = await client.pull()
        with pytest.raises(RudraError):
            await client.push_pull(np.ones(layout.size, np.float32), w.timestamp)
        assert "declares answers_at_once but held a gradient" in caplog.text
        await client.close()

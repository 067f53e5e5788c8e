"""The server over real loopback TCP: registration, async SGD, staleness, stop, leases."""

import asyncio

import numpy as np
import pytest
from helpers import LOOPBACK, initial_weights, run_server, small_layout

from rudra_async import RemoteError
from rudra_async.client import Client
from rudra_async.config import ServerConfig
from rudra_async.kernels import SGD
from rudra_async.layout import Layout
from rudra_async.server import ParameterServer
from rudra_async.server.store import WeightStore


@pytest.mark.torch
async def test_async_with_one_learner_equals_torch_sgd():
    import torch

    layout = small_layout()
    w0 = initial_weights(layout)
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    rng = np.random.default_rng(3)
    async with run_server(lr=0.1, momentum=0.9, weight_decay=0.01) as ps:
        client = await Client.connect(ps.addresses[0], layout, w0)
        w = await client.pull()
        np.testing.assert_array_equal(w.array, w0)
        for step in range(25):
            g = rng.standard_normal(layout.size).astype(np.float32)
            w = await client.push_pull(g, w.timestamp, step)
            p.grad = torch.from_numpy(g)
            opt.step()
            assert w.timestamp == step + 1
            np.testing.assert_allclose(w.array, p.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert ps.stats()["staleness_histogram"] == {"0": 25}
        await client.close()


async def test_staleness_is_clock_minus_stamp():
    layout = small_layout()
    async with run_server() as ps:
        a = await Client.connect(ps.addresses[0], layout, initial_weights(layout), name="a")
        b = await Client.connect(ps.addresses[0], layout, name="b")
        assert (a.learner_id, b.learner_id) == (0, 1)
        g = np.zeros(layout.size, np.float32)
        stale = await a.pull()
        for _ in range(3):
            ack = await b.push(g, (await b.pull()).timestamp)
            assert ack.staleness == 0
        ack = await a.push(g, stale.timestamp)
        assert ack.staleness == 3 and ack.timestamp == 4
        stats = ps.stats()
        assert stats["staleness_histogram"] == {"0": 3, "3": 1}
        assert stats["staleness_max"] == 3 and stats["staleness_mean"] == pytest.approx(0.75)
        assert {k: (v["name"], v["gradients"], v["dropped"]) for k, v in stats["learners"].items()} == {
            "0": ("a", 1, 0),
            "1": ("b", 3, 0),
        }
        for c in (a, b):
            await c.close()


async def test_pull_newer_than_waits_for_an_update():
    layout = small_layout()
    async with run_server() as ps:
        a = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        b = await Client.connect(ps.addresses[0], layout)
        waiting = asyncio.create_task(b.pull(newer_than=0))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        await a.push(np.ones(layout.size, np.float32), 0)
        w = await asyncio.wait_for(waiting, 5)
        assert w.timestamp == 1
        for c in (a, b):
            await c.close()


async def test_max_updates_stops_the_run():
    layout = small_layout()
    async with run_server(max_updates=2) as ps:
        c = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        g = np.ones(layout.size, np.float32)
        assert not (await c.push_pull(g, 0)).stop
        assert (await c.push_pull(g, 1)).stop
        with pytest.raises(RemoteError) as info:
            await c.push(g, 2)
        assert info.value.code == "stopped" and ps.clock == 2
        await c.close()


async def test_registration_errors():
    layout = small_layout()
    async with run_server() as ps:
        with pytest.raises(RemoteError) as info:
            await Client.connect(ps.addresses[0], layout)  # no weights anywhere yet
        assert info.value.code == "no_weights"
        c = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        other = Layout.from_shapes([("w", (5,))])
        with pytest.raises(RemoteError) as info:
            await Client.connect(ps.addresses[0], other, np.zeros(5, np.float32))
        assert info.value.code == "layout_mismatch"
        await c.close()


async def test_embedding_with_initial_weights_and_stats():
    init = {"w": np.ones((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    cfg = ServerConfig(listen=[LOOPBACK], lr=0.5, momentum=0.0)
    async with ParameterServer(cfg, initial=init) as ps:
        serving = asyncio.create_task(ps.serve())
        layout = Layout.from_shapes([("w", (2, 2)), ("b", (3,))])
        c = await Client.connect(ps.addresses[0], layout)  # no weights needed: the app gave them
        await c.push(np.ones(7, np.float32), 0)
        got = ps.weights()
        np.testing.assert_allclose(got["w"], 0.5 * np.ones((2, 2)))
        np.testing.assert_allclose(got["b"], -0.5 * np.ones(3))
        await c.close()
        await ps.close()
        await asyncio.wait_for(serving, 5)


def test_leased_weights_never_change_under_a_reader():
    layout = Layout.from_shapes([("w", (1000,))])
    store = WeightStore(layout, np.zeros(1000, np.float32))
    g = np.ones(1000, np.float32)
    with store.lease() as (clock, held):
        snapshot = held.copy()
        store.apply([g], [1.0], SGD(0.1, 0.0, 0.0))
        store.apply([g], [1.0], SGD(0.1, 0.0, 0.0))
        assert clock == 0 and store.clock == 2
        np.testing.assert_array_equal(held, snapshot)  # the reader's version is intact
        np.testing.assert_allclose(store.weights, -0.2)
    current = store.weights
    store.apply([g], [1.0], SGD(0.1, 0.0, 0.0))  # no lease: in place, the old buffer is recycled
    assert np.shares_memory(current, store.weights)


async def test_close_is_idempotent_and_frees_the_port():
    async with run_server() as ps:
        url = ps.addresses[0]
    await ps.close()
    cfg = ServerConfig(listen=[url])
    async with ParameterServer(cfg) as again:  # same port, bound again at once
        assert again.addresses == [url]


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
async def test_float16_gradients_on_the_wire(kernel):
    layout = small_layout()
    w0 = initial_weights(layout)
    g = np.random.default_rng(2).standard_normal(layout.size).astype(np.float16)
    async with run_server(lr=0.5, momentum=0.0, kernel=kernel) as ps:
        assert ps.stats()["kernel"] == kernel
        c = await Client.connect(ps.addresses[0], layout, w0)
        ack = await c.push(g, 0)
        assert ack.status == "applied"
        np.testing.assert_allclose(ps.core.store.weights, w0 - 0.5 * g.astype(np.float32), rtol=1e-6)
        await c.close()


async def test_one_injected_time_source_drives_every_deadline_and_the_learner_times():
    """``ParameterServer(now=...)`` is the one clock of sessions, the watchdog and the core:
    ten fake minutes close a silent connection (handshake_timeout) and an idle learner
    (idle_timeout) within a real second, and the learner's last-seen age is fake time."""
    fake = [1000.0]
    layout = small_layout()
    cfg = ServerConfig(listen=[LOOPBACK], kernel="numpy", handshake_timeout=300, idle_timeout=300)
    async with ParameterServer(cfg, now=lambda: fake[0]) as ps:
        task = asyncio.create_task(ps.serve())
        try:
            client = await Client.connect(ps.addresses[0], layout, initial_weights(layout), timeout=5)
            host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            await asyncio.sleep(1.2)  # watchdog ticks go by: nothing is due in fake time
            assert ps.stats()["rejected"] == {} and not reader.at_eof()
            fake[0] += 600
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the watchdog, not by real time
            learner = ps.stats()["learners"]["0"]
            assert learner["last_seen_s"] == 600.0
            rejected = ps.stats()["rejected"]
            assert rejected.get("handshake_timeout") == 1 and rejected.get("idle_timeout") == 1
            writer.close()
            await client.close()
        finally:
            await ps.close()
            await task

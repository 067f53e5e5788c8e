"""Learners the protocols wait for, through a real server on loopback: a staleness bound
holds for a learner whose weights took a while to reach it, and a bare PULL parked waiting
for newer weights does not keep a round member from eviction."""

import asyncio

import numpy as np
from helpers import initial_weights, run_server, small_layout

from rudra_async.client import Client
from rudra_async.server import shell
from rudra_async.server.session import Send
from rudra_async.wire import MsgType


async def test_a_gradient_computed_on_weights_that_were_on_their_way_keeps_the_bound(monkeypatch):
    """bounded, s = 1: learner A's weights are leased for its reply but take a while to reach
    it (a slow link, a large model); it counts as computing on them once they are sent, so
    meanwhile learner B moves the clock on twice. A's gradient then arrives staler than the
    bound (σ = 2): it is dropped, not applied, and no gradient is applied with σ > s."""
    layout, w0 = small_layout(), initial_weights(small_layout())
    g = np.full(layout.size, 0.01, np.float32)
    async with run_server(protocol="bounded", staleness_bound=1, kernel="numpy", momentum=0.0) as ps:
        a = await Client.connect(ps.addresses[0], layout, w0, name="a")
        b = await Client.connect(ps.addresses[0], layout, w0, name="b")
        w_b = await b.pull()
        on_the_way, perform = asyncio.Event(), shell.SessionShell.perform

        async def slow_reply(self, action):
            learner = self.session.learner
            weights = isinstance(action, Send) and action.msg_type == MsgType.WEIGHTS
            if weights and learner is not None and learner.name == "a":
                on_the_way.set()
                await asyncio.sleep(0.3)  # a slow link: the weights reach A later
            return await perform(self, action)

        monkeypatch.setattr(shell.SessionShell, "perform", slow_reply)
        pulling = asyncio.ensure_future(a.pull())
        await on_the_way.wait()
        for stamp in (w_b.timestamp, 1):
            assert (await b.push(g, stamp)).status == "applied"
        w_a = await pulling
        assert w_a.timestamp == 0 and ps.clock == 2
        assert (await a.push(g, w_a.timestamp)).status == "dropped"
        assert ps.clock == 2 and ps.stats()["staleness_max"] <= 1
        await a.close()
        await b.close()


async def test_a_parked_pull_does_not_keep_a_round_member_from_eviction():
    """hardsync with --learner-timeout: X got its weights, then, instead of pushing, waits in a
    PULL for weights newer than any the round could make without it. That wait does not count
    as a request in progress: X is evicted, A's round completes without it."""
    layout, w0 = small_layout(), initial_weights(small_layout())
    g = np.full(layout.size, 0.01, np.float32)
    async with run_server(protocol="hardsync", learner_timeout=0.3, kernel="numpy", momentum=0.0) as ps:
        a = await Client.connect(ps.addresses[0], layout, w0, name="a")
        x = await Client.connect(ps.addresses[0], layout, w0, name="x")
        w_a, _ = await a.pull(), await x.pull()
        parked = asyncio.ensure_future(x.pull(newer_than=2**62))
        ack = await asyncio.wait_for(a.push(g, w_a.timestamp), 10)
        assert ack.status in ("applied", "pending")
        w_next = await asyncio.wait_for(a.pull(newer_than=w_a.timestamp), 10)
        assert w_next.timestamp == 1 and ps.stats()["evictions"] == 1
        parked.cancel()
        await a.close()

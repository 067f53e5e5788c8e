"""Learners the protocols wait for, through a real server on loopback: a learner counts as
computing on its weights from the moment they are leased for its reply (not once sent), and
a bare PULL parked waiting for newer weights does not keep a round member from eviction."""

import asyncio

import numpy as np
from helpers import initial_weights, run_server, small_layout

from rudra_async.client import Client
from rudra_async.server import session
from rudra_async.wire import MsgType


async def test_a_staleness_bound_counts_a_learner_whose_weights_are_still_on_their_way(monkeypatch):
    """bounded, s = 1: learner A's weights are leased for its reply but not yet sent (a slow
    link, a large model). Meanwhile learner B may push once more, not twice: its second push
    would take A past the bound, so it is held until A's gradient comes (σ = 1 then)."""
    layout, w0 = small_layout(), initial_weights(small_layout())
    g = np.full(layout.size, 0.01, np.float32)
    async with run_server(protocol="bounded", staleness_bound=1, kernel="numpy", momentum=0.0) as ps:
        a = await Client.connect(ps.addresses[0], layout, w0, name="a")
        b = await Client.connect(ps.addresses[0], layout, w0, name="b")
        w_b = await b.pull()
        on_the_way, reply = asyncio.Event(), session.Session._reply

        async def slow_reply(self, msg_type, meta, request, arrays=(), gate=None):
            if msg_type == MsgType.WEIGHTS and self.learner is not None and self.learner.name == "a":
                on_the_way.set()
                await asyncio.sleep(0.5)  # a slow link: the weights reach A later
            return await reply(self, msg_type, meta, request, arrays, gate)

        monkeypatch.setattr(session.Session, "_reply", slow_reply)
        pulling = asyncio.ensure_future(a.pull())
        await on_the_way.wait()
        assert (await b.push(g, w_b.timestamp)).status == "applied" and ps.clock == 1
        second = asyncio.ensure_future(b.push(g, 1))
        await asyncio.sleep(0.2)
        assert not second.done() and ps.clock == 1, "B's second push took A past the bound"
        w_a = await pulling
        assert w_a.timestamp == 0
        ack = await a.push(g, w_a.timestamp)
        assert ack.status == "applied" and ack.staleness == 1
        assert (await second).status == "applied" and ps.stats()["staleness_max"] <= 1
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

"""No deadlock: learner processes killed mid-run, learners joining mid-run."""

import asyncio
import signal

import numpy as np
import pytest
from helpers import CLI_ARGS, run_server, subprocess_env

from rudra_async.client import Client
from rudra_async.layout import Layout

PROTOCOLS = [
    ("async", {}),
    ("softsync", {"n": 2}),
    ("hardsync", {}),
    ("bounded", {"staleness_bound": 2}),
    ("backup", {"backup": 1}),
]


async def start_learner(url, index):
    """A learner process that runs until the server says stop."""
    return await asyncio.create_subprocess_exec(
        *CLI_ARGS,
        "learner",
        "--connect",
        url,
        "--index",
        str(index),
        "--batch-size",
        "8",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=subprocess_env(),
    )


@pytest.mark.parametrize("protocol, options", PROTOCOLS, ids=[p for p, _ in PROTOCOLS])
async def test_sigkill_of_a_learner_mid_run_lets_the_others_finish(protocol, options):
    async with run_server(protocol=protocol, **options) as ps:
        url = ps.addresses[0]
        procs = [await start_learner(url, i) for i in range(3)]
        try:

            async def until(cond, timeout=60):
                deadline = asyncio.get_running_loop().time() + timeout
                while not cond():
                    state = {k: v for k, v in vars(ps.core.protocol).items() if k != "now"}
                    assert asyncio.get_running_loop().time() < deadline, f"timed out at clock {ps.clock}: {state}"
                    await asyncio.sleep(0.01)

            await until(lambda: sum(info.connected for info in ps.core.learners.values()) == 3 and ps.clock >= 20)
            victim = procs[0]
            victim.send_signal(signal.SIGKILL)
            at_kill = ps.clock
            ps.stop_at(at_kill + 100)  # the run ends 100 updates after the crash
            await asyncio.wait_for(victim.wait(), 10)
            results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs[1:])), 120)
            for p, (_, err) in zip(procs[1:], results):
                assert p.returncode == 0, err.decode()[-2000:]
            assert ps.clock == at_kill + 100  # the run went on without the dead learner
            assert sum(not info.connected for info in ps.core.learners.values()) == 3  # all gone, the dead one noticed
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()


async def test_hardsync_newcomer_never_waits_and_counts_from_the_next_round():
    """A learner that joins during a round gets the current weights at once (it never waits:
    see sync.Hardsync); the gradient it computes on them is dropped, as the round was not
    waiting for it; it takes part from the next round on, which waits for all three."""
    layout = Layout.from_shapes([("w", (4,))])
    g = np.ones(4, np.float32)
    async with run_server(protocol="hardsync", lr=0.1, momentum=0.0) as ps:
        url = ps.addresses[0]
        a = await Client.connect(url, layout, np.zeros(4, np.float32))
        b = await Client.connect(url, layout)
        wa, wb = await a.pull(), await b.pull()
        a_waiting = asyncio.create_task(a.push_pull(g, wa.timestamp))  # round 0: a pushed, b not yet
        await asyncio.sleep(0.05)
        c = await Client.connect(url, layout)
        wc = await asyncio.wait_for(c.pull(), 5)
        assert wc.timestamp == 0 and not a_waiting.done()  # the newcomer computes at once
        assert (await c.push(g, wc.timestamp)).status == "dropped"  # not part of round 0
        wb = await b.push_pull(g, wb.timestamp)
        wa, wc = await a_waiting, await c.pull(newer_than=0)
        assert wa.timestamp == wb.timestamp == wc.timestamp == 1  # round 0 did not wait for c
        # round 1 needs all three
        t_a = asyncio.create_task(a.push_pull(g, 1))
        t_b = asyncio.create_task(b.push_pull(g, 1))
        await asyncio.sleep(0.1)
        assert ps.clock == 1 and not t_a.done()
        await c.push_pull(g, 1)
        assert (await t_a).timestamp == (await t_b).timestamp == 2
        assert ps.stats()["learners"][str(c.learner_id)]["gradients"] == 1
        for x in (a, b, c):
            await x.close()


async def test_gradients_held_when_the_run_stops_are_not_applied():
    """bounded(s=0) holds a push until every learner has pushed; if the run stops meanwhile
    and the other learner leaves, the held gradient is answered `dropped`, not applied."""
    layout = Layout.from_shapes([("w", (4,))])
    g = np.ones(4, np.float32)
    async with run_server(protocol="bounded", staleness_bound=0, lr=0.1, momentum=0.0) as ps:
        a = await Client.connect(ps.addresses[0], layout, np.zeros(4, np.float32))
        b = await Client.connect(ps.addresses[0], layout)
        wa, wb = await a.pull(), await b.pull()
        await asyncio.gather(a.push(g, wa.timestamp), b.push(g, wb.timestamp))  # one round: clock 1
        wa, wb = await a.pull(), await b.pull()
        held = asyncio.create_task(a.push(g, wa.timestamp))
        await asyncio.sleep(0.1)
        assert not held.done() and ps.clock == 1  # held: b still computes on clock 1
        ps.stop_at(1)
        weights = ps.weights()["w"]
        await b.close()  # b leaves: the protocol releases a's gradient
        ack = await asyncio.wait_for(held, 5)
        assert (ack.status, ack.stop, ps.clock) == ("dropped", True, 1)
        np.testing.assert_array_equal(ps.weights()["w"], weights)
        assert ps.stats()["rejected"] == {"stopped": 1}
        await a.close()

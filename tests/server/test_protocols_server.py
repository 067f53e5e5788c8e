"""Protocols through the real server over loopback TCP: exactness against torch, staleness."""

import asyncio

import numpy as np
import pytest
import torch
from helpers import run_server
from torch import nn

from rudra_async.client import Client
from rudra_async.learner.binding import FlatParameters
from rudra_async.learner.evaluation import bind

LAM, MU, STEPS = 4, 8, 20


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def data(seed=1, n=LAM * MU * STEPS):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def grad_on(model: nn.Module, flat: FlatParameters, x, y) -> np.ndarray:
    flat.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return np.concatenate(flat.gradients())


class TorchLearner:
    """A learner in this process: its own model copy, bound to flat buffers."""

    def __init__(self, client: Client, model: nn.Module, flat: FlatParameters):
        self.client, self.model, self.flat = client, model, flat

    @classmethod
    async def connect(cls, url, seed=0):
        model = make_model(seed)
        flat = bind(model)
        client = await Client.connect(url, flat.layout, flat.host_weights)
        return cls(client, model, flat)

    async def step(self, w, x, y):
        self.flat.host_weights[:] = w.array
        return await self.client.push_pull(grad_on(self.model, self.flat, x, y), w.timestamp, samples=len(y))


@pytest.mark.parametrize("protocol", ["hardsync", "softsync"])  # softsync with n = 1 is hardsync without a barrier
async def test_synchronous_update_equals_torch_sgd_on_the_concatenated_batch(protocol, update_thread):
    x, y = data()
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_flat = bind(ref)
    options = {"n": 1} if protocol == "softsync" else {}
    async with run_server(protocol=protocol, lr=0.1, momentum=0.9, weight_decay=0.01, **options) as ps:
        learners = [await TorchLearner.connect(ps.addresses[0]) for _ in range(LAM)]
        ws = [await learner.client.pull() for learner in learners]
        for step in range(STEPS):
            lo = step * LAM * MU
            shards = [(x[lo + k * MU : lo + (k + 1) * MU], y[lo + k * MU : lo + (k + 1) * MU]) for k in range(LAM)]
            if protocol == "hardsync":
                ws = await asyncio.gather(*(learner.step(w, *s) for learner, w, s in zip(learners, ws, shards)))
            else:  # no barrier: push in turn on the same weights, then everyone pulls the update
                for learner, w, s in zip(learners, ws, shards):
                    await learner.step(w, *s)
                ws = [await learner.client.pull() for learner in learners]
            opt.zero_grad(set_to_none=False)
            ref_flat.zero_grad()
            nn.functional.cross_entropy(ref(x[lo : lo + LAM * MU]), y[lo : lo + LAM * MU]).backward()
            opt.step()
            assert all(w.timestamp == step + 1 for w in ws)
            for w in ws:
                np.testing.assert_allclose(w.array, ref_flat.host_weights, rtol=1e-5, atol=1e-6)
        assert ps.stats()["staleness_max"] == 0
        assert update_thread.used() == update_thread.expected
        for learner in learners:
            await learner.client.close()


async def test_async_with_one_learner_equals_torch_sgd_on_mu(update_thread):
    x, y = data()
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)
    ref_flat = bind(ref)
    async with run_server(protocol="async", lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True) as ps:
        learner = await TorchLearner.connect(ps.addresses[0])
        w = await learner.client.pull()
        for step in range(STEPS):
            xb, yb = x[step * MU : (step + 1) * MU], y[step * MU : (step + 1) * MU]
            w = await learner.step(w, xb, yb)
            ref_flat.zero_grad()
            nn.functional.cross_entropy(ref(xb), yb).backward()
            opt.step()
            np.testing.assert_allclose(w.array, ref_flat.host_weights, rtol=1e-5, atol=1e-6)
        assert update_thread.used() == update_thread.expected
        await learner.client.close()


async def test_softsync_update_with_given_stamps_is_the_hand_computed_one():
    """2-softsync over λ = 4 (c = 2) with α0/σ: θ ← θ − (1/c) Σ α0/σ_l g_l."""
    size, alpha = 5, 0.2
    theta = np.arange(size, dtype=np.float32)
    async with run_server(protocol="softsync", n=2, lr=alpha, momentum=0.0, lr_policy="staleness") as ps:
        from rudra_async.layout import Layout

        layout = Layout.from_shapes([("t", (size,))])
        cs = [await Client.connect(ps.addresses[0], layout, theta) for _ in range(4)]
        rng = np.random.default_rng(0)
        g = [rng.standard_normal(size).astype(np.float32) for _ in range(6)]
        # clock 0 → 1 → 2 with gradients stamped 0
        assert (await cs[0].push(g[0], 0)).status == "pending"
        assert (await cs[1].push(g[1], 0)).status == "applied"
        await cs[2].push(g[2], 0)
        await cs[3].push(g[3], 0)  # clock 1 → 2: σ = 1 for both
        theta1 = theta - (alpha / 2) * (g[0] + g[1])
        theta2 = theta1 - (alpha / 2) * (g[2] / 1 + g[3] / 1)
        # now stamps 0 and 2 at clock 2: σ = 2 and σ = 0
        await cs[0].push(g[4], 0)
        ack = await cs[1].push(g[5], 2)
        assert ack.status == "applied" and ack.timestamp == 3
        theta3 = theta2 - (alpha / 2) * (g[4] / 2 + g[5] / 1)
        np.testing.assert_allclose(ps.core.store.weights, theta3, rtol=1e-6)
        assert ps.stats()["staleness_histogram"] == {"0": 3, "1": 2, "2": 1}
        for c in cs:
            await c.close()


async def equally_fast_learners(url, layout, lam, rounds, compute_s=0.004):
    """λ learners with the same compute time, pushing zero gradients."""
    grad = np.zeros(layout.size, np.float32)

    async def one(i):
        c = await Client.connect(url, layout)
        w = await c.pull()
        for _ in range(rounds):
            await asyncio.sleep(compute_s)
            w = await c.push_pull(grad, w.timestamp)
        await c.close()

    await asyncio.gather(*(one(i) for i in range(lam)))


@pytest.mark.parametrize("n", [1, 4, 8])
async def test_softsync_staleness_concentrates_around_n(n):
    from rudra_async.layout import Layout

    lam = 8
    layout = Layout.from_shapes([("w", (64,))])
    async with run_server(protocol="softsync", n=n, lr=0.01, momentum=0.0) as ps:
        seed = await Client.connect(ps.addresses[0], layout, np.zeros(64, np.float32))
        await seed.close()
        await equally_fast_learners(ps.addresses[0], layout, lam, rounds=60)
        hist = ps.core.staleness
        print(f"n={n}: mean σ {hist.mean:.2f}, max {hist.max}, σ ≤ 2n for {hist.fraction_at_most(2 * n):.3f}")
        assert 0.5 * n <= hist.mean <= 1.5 * n
        assert hist.fraction_at_most(2 * n) >= 0.95


@pytest.mark.parametrize(
    "protocol, options, bound",
    [("hardsync", {}, 0), ("bounded", {"staleness_bound": 2}, 2), ("backup", {"backup": 1}, 0)],
)
async def test_protocol_staleness_bounds_with_uneven_learners(protocol, options, bound):
    from rudra_async.layout import Layout

    layout = Layout.from_shapes([("w", (16,))])
    async with run_server(protocol=protocol, lr=0.01, momentum=0.0, **options) as ps:
        seed = await Client.connect(ps.addresses[0], layout, np.zeros(16, np.float32))
        await seed.close()
        grad = np.zeros(16, np.float32)

        async def one(delay):
            c = await Client.connect(ps.addresses[0], layout)
            w = await c.pull()
            for _ in range(25):
                await asyncio.sleep(delay)
                w = await c.push_pull(grad, w.timestamp)
            await c.close()

        await asyncio.gather(*(one(d) for d in (0.001, 0.002, 0.004, 0.012)))
        stats = ps.stats()
        assert stats["staleness_max"] <= bound
        assert stats["updates"] > 10
        if protocol == "backup":
            assert stats["dropped"] > 0  # the slow learner's late gradients, counted
            assert sum(v["dropped"] for v in stats["learners"].values()) == stats["dropped"]

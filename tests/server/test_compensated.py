"""The default LR policy, ``compensated`` (docs/protocols.md): its rule, and a server's
weights under it predicted bit for bit from the documented steps; the start-up warnings
(rudra_async.advice)."""

import math
from collections import deque

import numpy as np
import pytest
from helpers import run_server

from rudra_async import advice
from rudra_async.client import Client
from rudra_async.config import ServerConfig
from rudra_async.layout import Layout
from rudra_async.lr import Compensated


def test_without_staleness_it_is_constant_and_with_it_momentum_and_warm_up_follow_the_mean():
    policy = Compensated()
    policy.observe(0)
    assert policy.momentum(0.9) == 0.9 and policy.rate_factor(0) == 1.0 and policy.factor(0) == 1.0
    policy.observe(2)  # ⟨σ⟩ = 1
    assert policy.momentum(0.9) == pytest.approx(0.8) and policy.rate_factor(9) == pytest.approx(10 / 64)
    assert policy.rate_factor(63) == 1.0 and policy.factor(2) == 1.0
    for _ in range(200):
        policy.observe(20)  # the window is the last 128 values: ⟨σ⟩ = 20
    assert policy.momentum(0.9) == 0.0 and policy.rate_factor(0) == pytest.approx(1 / (64 * 20))
    resumed = Compensated()
    resumed.load_state(policy.state())
    assert resumed.momentum(0.95) == policy.momentum(0.95) == pytest.approx(0.0)


def reference_weights(w0, pushes, lr, beta, decay):
    """docs/protocols.md's steps with --lr-policy compensated, c = 1: yields θ after each push."""
    w, v = w0.copy(), np.zeros_like(w0)
    window: deque[int] = deque(maxlen=Compensated.WINDOW)
    for clock, (stamp, grad) in enumerate(pushes):
        window.append(clock - stamp)
        mean = sum(window) / len(window)
        beta_t = beta if mean == 0 else max(0.0, 1.0 - (1.0 - beta) * (mean + 1.0))
        warm = 1.0 if mean == 0 else min(1.0, (clock + 1) / (Compensated.WARMUP * mean))
        eta = lr * warm
        g = grad * np.float32(1.0)
        d = g + w * np.float32(decay) if decay else g
        if beta_t > 0:
            v = v * np.float32(beta_t) + d
            step = v
        else:
            step = d
        w = w + step * np.float32(-eta)
        yield w


async def test_a_servers_weights_under_compensated_are_predicted_bit_for_bit():
    layout = Layout.from_shapes([("w", (40,))])
    rng = np.random.default_rng(4)
    w0 = rng.standard_normal(layout.size).astype(np.float32)
    lags = [0, 1, 1, 3, 0, 2, 7, 1, 0, 5] * 6  # σ of each push, as stale pushes of one learner make them
    grads = [rng.standard_normal(layout.size).astype(np.float32) for _ in lags]
    async with run_server(kernel="numpy", protocol="async", lr=0.05, momentum=0.9, weight_decay=0.01) as ps:
        assert ps.config.lr_policy == "compensated"  # the default
        client = await Client.connect(ps.addresses[0], layout, w0)
        served = []
        for clock, (lag, g) in enumerate(zip(lags, grads)):
            w = await client.push_pull(g, max(0, clock - lag))
            served.append(w.array.copy())
        await client.close()
    pushes = [(max(0, clock - lag), g) for clock, (lag, g) in enumerate(zip(lags, grads))]
    for k, (got, expected) in enumerate(zip(served, reference_weights(w0, pushes, 0.05, 0.9, 0.01))):
        assert np.array_equal(got, expected), f"update {k}"
    assert not math.isclose(float(np.abs(served[-1] - w0).max()), 0.0)


@pytest.mark.parametrize(
    "settings, learners, overlap, warned",
    [
        ({"lr_policy": "constant"}, None, False, True),  # a bare server: with 2 learners
        ({"lr_policy": "constant", "momentum": 0.0}, 4, False, False),
        ({"lr_policy": "constant", "protocol": "hardsync"}, 8, False, False),
        ({"lr_policy": "constant", "protocol": "hardsync"}, 8, True, False),
        ({"lr_policy": "constant", "protocol": "softsync", "n": 1}, 8, False, False),  # c = λ: σ ≈ 0
        ({"lr_policy": "constant", "protocol": "softsync", "n": 2}, 8, False, True),
        ({"lr_policy": "staleness"}, 2, False, True),  # α0/σ is α0 at σ = 1
        ({"lr_policy": "staleness"}, 4, False, False),
        ({"lr_policy": "staleness"}, 1, True, True),  # one learner overlapping: σ ≈ 1
        ({"lr_policy": "staleness-plus-one"}, 4, True, False),
        ({}, 4, True, False),  # the default, compensated
        ({"lr_policy": "constant", "protocol": "bounded", "staleness_bound": 0}, 4, False, False),
    ],
)
def test_the_warning_rule(settings, learners, overlap, warned):
    assert bool(advice.risks(ServerConfig(**settings), learners, overlap)) is warned


def test_expected_staleness():
    assert advice.expected_staleness("async", 4) == 3
    assert advice.expected_staleness("async", 4, overlap=True) == 7
    assert advice.expected_staleness("softsync", 16, n=8) == 7
    assert advice.expected_staleness("bounded", 8, staleness_bound=2) == 2
    assert advice.expected_staleness("hardsync", 8, overlap=True) == 0
    assert advice.expected_staleness("mine", 8) is None

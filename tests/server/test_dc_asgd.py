"""Delay compensation (``--dc-lambda``, DC-ASGD; docs/protocols.md#delay-compensation-dc-lambda):
a server's weights predicted bit for bit from the documented arithmetic through the wire, the
documented worked example replayed, gradients beyond the kept history, and the memory bound."""

import re
from pathlib import Path

import numpy as np
import pytest
from helpers import run_server

from rudra_async.client import Client
from rudra_async.config import ServerConfig
from rudra_async.errors import ConfigError
from rudra_async.layout import Layout

PROTOCOLS_MD = Path(__file__).resolve().parents[2] / "docs" / "protocols.md"


def reference_weights(w0, pushes, lr, beta, decay, lam, history):
    """docs/protocols.md's steps, c = 1, --lr-policy constant, with delay compensation:
    yields (θ after each push, whether the push was compensated)."""
    w, v = w0.copy(), np.zeros_like(w0)
    versions = {0: w0.copy()}
    for clock, (stamp, grad) in enumerate(pushes):
        sigma = clock - stamp
        g = grad.astype(np.float32)
        compensated = 0 < sigma < history
        if compensated:
            u = g * g
            u = u * (w - versions[stamp])
            u = u * np.float32(lam)
            g = g + u
        g = g * np.float32(1.0)  # step 4: s = 1
        d = g + w * np.float32(decay) if decay else g
        if beta:
            v = v * np.float32(beta) + d
            step = v
        else:
            step = d
        w = w + step * np.float32(-lr)
        versions[clock + 1] = w
        yield w, compensated


async def serve_pushes(w0, pushes, **settings):
    """Replay ``pushes`` ((stamp, gradient) pairs, one learner) against a real server: the
    weights after each, and the server's statistics."""
    layout = Layout.from_shapes([("w", w0.shape)])
    async with run_server(kernel="numpy", protocol="async", lr_policy="constant", **settings) as ps:
        client = await Client.connect(ps.addresses[0], layout, w0)
        served = [(await client.push_pull(g, stamp)).array.copy() for stamp, g in pushes]
        await client.close()
        return served, ps.stats()


async def test_compensated_weights_are_predicted_bit_for_bit_through_the_wire():
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal(50).astype(np.float32)
    lags = [0, 1, 2, 1, 3, 0, 5, 1, 2, 9, 4, 1] * 4  # 9 > history: applied as it is
    pushes = [(max(0, clock - lag), rng.standard_normal(50).astype(np.float32)) for clock, lag in enumerate(lags)]
    settings = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "dc_lambda": 0.7, "dc_history": 6}
    served, stats = await serve_pushes(w0, pushes, **settings)
    expected = list(reference_weights(w0, pushes, 0.05, 0.9, 0.01, 0.7, 6))
    for k, (got, (want, _)) in enumerate(zip(served, expected)):
        assert np.array_equal(got, want), f"update {k}"
    plain = list(reference_weights(w0, pushes, 0.05, 0.9, 0.01, 0.0, 6))
    assert not np.array_equal(served[-1], plain[-1][0])  # the compensation changed the weights
    beyond = sum(1 for clock, (stamp, _) in enumerate(pushes) if clock - stamp >= 6)
    assert beyond > 0 and stats["dc_uncompensated"] == beyond


def worked_example() -> list[dict[str, str]]:
    """The rows of protocols.md's delay-compensation worked example."""
    text = PROTOCOLS_MD.read_text()
    section = text.split("### Delay compensation", 1)[1].split("\n### ", 1)[0]
    table = section.split("| push | learner |", 1)[1]
    header = ["push", "learner", *[c.strip() for c in table.split("\n", 1)[0].strip(" |").split("|")]]
    rows = []
    for line in table.split("\n")[2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, [c.strip() for c in line.strip(" |").split("|")])))
    return rows


def vector(cell: str) -> np.ndarray:
    return np.array([float(x) for x in re.findall(r"-?[\d.e-]+", cell)], np.float32)


async def test_the_documented_worked_example_is_what_a_server_computes():
    rows = worked_example()
    assert len(rows) == 3
    w0 = np.array([1, -2, 0.5], np.float32)
    pushes = [(int(r["stamp"]), vector(r["gradient"])) for r in rows]
    served, stats = await serve_pushes(w0, pushes, lr=0.1, momentum=0.0, dc_lambda=0.5)
    for row, got, (want, compensated) in zip(rows, served, reference_weights(w0, pushes, 0.1, 0.0, 0.0, 0.5, 8)):
        assert np.array_equal(vector(row["θ after"]), got), row["push"]
        assert np.array_equal(got, want) and compensated == (row["σ"] != "0"), row["push"]
        assert [repr(float(x)) for x in got] == [repr(float(x)) for x in vector(row["θ after"])]
    assert stats["dc_uncompensated"] == 0


async def test_without_staleness_compensation_changes_nothing():
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(20).astype(np.float32)
    pushes = [(clock, rng.standard_normal(20).astype(np.float32)) for clock in range(10)]
    with_dc, _ = await serve_pushes(w0, pushes, lr=0.1, dc_lambda=2.0)
    without, _ = await serve_pushes(w0, pushes, lr=0.1)
    assert all(np.array_equal(a, b) for a, b in zip(with_dc, without))


def test_the_kept_versions_bound_the_memory_and_stay_unchanged():
    from rudra_async.kernels import SGD
    from rudra_async.server.store import WeightStore

    layout = Layout.from_shapes([("w", (1000,))])
    store = WeightStore(layout, np.zeros(1000, np.float32), "numpy", history=4)
    g = np.ones(1000, np.float32)
    seen = {}
    for clock in range(40):
        with store.lease() as (_, published):  # a reply being written meanwhile
            seen[clock] = published.copy()
            stamps = [max(0, clock - 2), max(0, clock - 5)]
            bases = store.versions(stamps)
            for stamp, base in zip(stamps, bases):
                if stamp < clock and clock - stamp < 4:  # kept: exactly the weights published then
                    assert base is not None and np.array_equal(base, seen[stamp])
                else:
                    assert base is None
            store.apply([g, g], [0.5, 0.5], SGD(0.1), dc=(0.5, bases))
    assert len(store._buffers) <= 4 + 1  # the kept versions and the one an update writes


@pytest.mark.parametrize("settings", [{"dc_lambda": -0.1}, {"dc_lambda": float("nan")}, {"dc_history": 0}])
def test_bad_settings_are_refused(settings):
    with pytest.raises(ConfigError):
        ServerConfig(**settings).validate()


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def test_compensation_on_the_update_thread_equals_the_inline_one(monkeypatch, kernel):
    from rudra_async.kernels import SGD
    from rudra_async.server import store
    from rudra_async.server.store import Background, WeightStore

    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    layout = Layout.from_shapes([("w", (3000,))])
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(3000).astype(np.float32)
    background = Background()
    inline = WeightStore(layout, w0, kernel, history=3)
    threaded = WeightStore(layout, w0, kernel, background=background, history=3)
    for clock in range(15):
        grads = [rng.standard_normal(3000).astype(np.float32) for _ in range(2)]
        stamps = [max(0, clock - 1), max(0, clock - clock % 4)]
        for ws in (inline, threaded):
            ws.apply(grads, [0.5, 0.5], SGD(0.05, 0.9), dc=(0.3, ws.versions(stamps)))
    np.testing.assert_array_equal(threaded.weights, inline.weights)
    assert not np.array_equal(inline.weights, w0)
    threaded.close()
    background.close()


async def test_the_overflow_bound_of_compensated_gradients_recovers_after_a_check():
    """The bound of a compensated gradient grows with every update (it compounds through the
    weights' bound) until an update takes the checked path, which makes the weights' bound
    exact again; the bound then uses the weights' bounds at the gradient's two clocks, so after
    the kept versions' span the updates go the fast way again (a bound over every version ever
    kept would send every later update to the check). The weights follow the documented steps."""
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(30).astype(np.float32)
    pushes = [(max(0, clock - clock % 3), rng.standard_normal(30).astype(np.float32)) for clock in range(400)]
    layout = Layout.from_shapes([("w", (30,))])
    settings = {"kernel": "numpy", "protocol": "async", "lr_policy": "constant", "lr": 0.1, "momentum": 0.9}
    async with run_server(**settings, dc_lambda=2.0) as ps:
        client = await Client.connect(ps.addresses[0], layout, w0)
        store = ps.core.store
        apply, checked = store.apply, []

        def counting(*args, **kwargs):
            checked.append(kwargs.get("check", False))
            return apply(*args, **kwargs)

        store.apply = counting
        served = [(await client.push_pull(g, stamp)).array.copy() for stamp, g in pushes]
        await client.close()
    assert len(checked) == 400 and 0 < sum(checked) <= 40  # 11 here; 212 with a bound over every version ever kept
    expected = [w for w, _ in reference_weights(w0, pushes, 0.1, 0.9, 0.0, 2.0, 8)]
    assert all(np.array_equal(a, b) for a, b in zip(served, expected))

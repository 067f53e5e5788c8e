"""LR policies and schedules; choosing protocols and policies by name, plugins included."""

import numpy as np
import pytest
from helpers import run_server

from rudra_async import ConfigError, registry
from rudra_async.config import ServerConfig, make_lr_policy, make_protocol
from rudra_async.lr import Constant, MeanStaleness, Schedule, Staleness, StalenessPlusOne
from rudra_async.sync import Softsync, SyncProtocol


def test_per_gradient_policies():
    assert [Constant().factor(s) for s in (0, 1, 4)] == [1, 1, 1]
    assert [Staleness().factor(s) for s in (0, 1, 4)] == [1, 1, 0.25]
    assert [StalenessPlusOne().factor(s) for s in (0, 1, 4)] == [1, 0.5, 0.2]


def test_mean_staleness_over_the_run_and_a_window():
    run, win = MeanStaleness(), MeanStaleness(window=2)
    for s in (0, 0, 4, 8):
        run.observe(s)
        win.observe(s)
    assert run.factor(0) == pytest.approx(1 / 3)  # ⟨σ⟩ = 3 over the run
    assert win.factor(0) == pytest.approx(1 / 6)  # ⟨σ⟩ = 6 over the last two
    fresh = MeanStaleness()
    fresh.observe(0)
    assert fresh.factor(0) == 1.0  # ⟨σ⟩ < 1 never raises the rate above α0


def test_schedule_step_decay_warmup_and_linear_scaling():
    s = Schedule(0.1, decay_at=(10, 20), decay=0.1)
    assert [s.rate(t) for t in (0, 9, 10, 19, 20)] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.001])
    w = Schedule(0.1, warmup=4)
    assert [w.rate(t) for t in range(5)] == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1])
    e = Schedule(0.1, decay_at=(2,), decay=0.5, decay_unit="epochs")
    assert e.rate(1000, epoch=1.9) == pytest.approx(0.1) and e.rate(0, epoch=2.0) == pytest.approx(0.05)
    lin = Schedule(0.1, scale_ref_batch=32)
    assert lin.rate(0, batch_samples=8 * 16) == pytest.approx(0.4)  # μλ/μ_ref = 128/32


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(base=0),
        dict(base=0.1, decay=0),
        dict(base=0.1, warmup=-1),
        dict(base=0.1, decay_unit="weeks"),
        dict(base=0.1, scale_ref_batch=0),
    ],
)
def test_bad_schedules(kwargs):
    with pytest.raises(ConfigError):
        Schedule(**kwargs)


def test_registry_names_and_errors():
    assert set(registry.known("protocol")) >= {"async", "softsync", "hardsync", "bounded", "backup"}
    assert registry.resolve("protocol", "rudra_async.sync:Softsync") is Softsync  # module:attr
    with pytest.raises(ConfigError, match=r"known: .*hardsync"):
        registry.resolve("protocol", "warp-speed")
    with pytest.raises(ConfigError, match=r"known: .*staleness"):
        registry.resolve("lr policy", "warp-speed")
    with pytest.raises(ConfigError, match="cannot load"):
        registry.resolve("protocol", "no_such_module:Thing")
    with pytest.raises(ConfigError, match=r"is not a rudra_async\.sync\.SyncProtocol"):
        make_protocol(ServerConfig(protocol="rudra_async.lr:Constant"))
    with pytest.raises(ConfigError, match="rejected its options"):
        make_protocol(ServerConfig(protocol="async", protocol_options={"bogus": 1}))


def test_example_plugin_is_found_through_entry_points():
    assert "fixed-batch" in registry.known("protocol")
    assert "exp-staleness" in registry.known("lr policy")
    proto = make_protocol(ServerConfig(protocol="fixed-batch", protocol_options={"c": 3}))
    assert isinstance(proto, SyncProtocol) and proto.c == 3
    policy = make_lr_policy(ServerConfig(lr_policy="exp-staleness", lr_policy_options={"gamma": 0.5}))
    assert policy.factor(3) == pytest.approx(0.125)
    with pytest.raises(ConfigError, match="fixed-batch needs"):
        make_protocol(ServerConfig(protocol="fixed-batch", protocol_options={"c": 0}))


async def test_example_plugin_drives_a_real_server():
    from rudra_async.client import Client
    from rudra_async.layout import Layout

    layout = Layout.from_shapes([("w", (3,))])
    async with run_server(
        protocol="fixed-batch",
        protocol_options={"c": 3},
        lr_policy="exp-staleness",
        lr_policy_options={"gamma": 0.5},
        lr=1.0,
        momentum=0.0,
    ) as ps:
        a = await Client.connect(ps.addresses[0], layout, np.zeros(3, np.float32))
        g = np.ones(3, np.float32)
        assert [(await a.push(g, 0)).status for _ in range(3)] == ["pending", "pending", "applied"]
        await a.push(g, 0)
        await a.push(g, 1)
        await a.push(g, 1)  # clock 1: σ = 1, 0, 0 → factors 0.5, 1, 1
        np.testing.assert_allclose(ps.core.store.weights, -(1.0 + 2.5 / 3))
        await a.close()


@pytest.mark.parametrize("window", [0, 3])
def test_mean_staleness_state_survives_a_checkpoint(window):
    run = MeanStaleness(window)
    for sigma in [4, 0, 2, 7, 1]:
        run.observe(sigma)
    resumed = MeanStaleness(window)
    resumed.load_state(run.state())
    for p in (run, resumed):
        p.observe(3)
    assert resumed.mean == run.mean == (pytest.approx((7 + 1 + 3) / 3) if window else pytest.approx(17 / 6))

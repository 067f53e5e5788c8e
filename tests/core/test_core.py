"""The server core without sockets or an event loop: registration, every push refusal,
the update, snapshot and restore. Requests are frames built by the wire format itself."""

import numpy as np
import pytest

from rudra_async.config import ServerConfig
from rudra_async.errors import ConfigError, RequestError
from rudra_async.layout import Layout
from rudra_async.server.core import ServerCore
from rudra_async.wire import Frame, FrameReader, MsgType, encode_frame

LAYOUT = Layout.from_shapes([("w", (2, 3)), ("b", (3,))])
W0 = np.arange(LAYOUT.size, dtype=np.float32) / 10


def frame(msg_type: MsgType, meta: dict, arrays=()) -> Frame:
    """A received frame, exactly as a transport would hand it over."""
    reader = FrameReader()
    frames = []
    for part in encode_frame(msg_type, meta, list(arrays)):
        data = memoryview(part).cast("B")
        while len(data):
            buf = reader.get_buffer()
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            frames += reader.advance(n)
    (out,) = frames
    return out


def hello(core: ServerCore, initial=W0, layout=LAYOUT, **meta):
    wire_layout = layout.to_wire() if isinstance(layout, Layout) else layout
    f = frame(MsgType.HELLO, {"name": "t", "layout": wire_layout, **meta}, [] if initial is None else [initial])
    return core.register(f.meta, f.arrays, "test")


def push(core: ServerCore, learner, grad, **meta):
    """``grad``: one array, or a list of arrays sent as the gradient's segments."""
    f = frame(MsgType.PUSH, {"timestamp": core.clock, **meta}, grad if isinstance(grad, list) else [grad])
    return core.push(learner, f.meta, f)


def code_of(call) -> str:
    with pytest.raises(RequestError) as info:
        call()
    return info.value.code


def test_the_first_hello_brings_the_weights_and_later_ones_must_match():
    core = ServerCore(ServerConfig(kernel="numpy"))
    assert core.store is None
    assert code_of(lambda: hello(core, initial=None)) == "no_weights"
    assert code_of(lambda: hello(core, initial=W0[:-1])) == "no_weights"
    assert code_of(lambda: hello(core, initial=W0.astype(np.float64))) == "no_weights"
    assert code_of(lambda: hello(core, layout="nonsense")) == "bad_request"  # a wrong type (schema)
    assert code_of(lambda: hello(core, layout=[["w", [-1]]])) == "bad_layout"
    assert code_of(lambda: hello(core, layout=[["w", [1] * 33]])) == "bad_layout"
    assert code_of(lambda: hello(core, shard=[1, 2])) == "shard_mismatch"
    assert code_of(lambda: hello(core, shard="x")) == "bad_request"
    assert core.store is None and not core.learners  # nothing refused changed anything
    a = hello(core)
    np.testing.assert_array_equal(core.store.weights, W0)
    b = hello(core, initial=None)  # later learners need not send weights
    assert (a.learner_id, b.learner_id) == (0, 1)
    assert code_of(lambda: hello(core, initial=None, layout=Layout.from_shapes([("w", (9,))]))) == "layout_mismatch"
    welcome = core.welcome(b)
    assert welcome["learner_id"] == 1 and welcome["layout"] == LAYOUT.to_wire() and welcome["clock"] == 0
    assert welcome["range"] == [0, LAYOUT.size] and welcome["protocol"] == "async"
    core.leave(a)
    assert not a.connected and b.connected
    assert core.protocol.members == {1}


def test_every_push_refusal_has_its_code_and_changes_nothing():
    changes = []
    core = ServerCore(ServerConfig(kernel="numpy", max_updates=2), on_change=lambda: changes.append(1))
    learner = hello(core)
    good = np.ones(LAYOUT.size, np.float32)
    nan = good.copy()
    nan[3] = np.nan
    cases = {
        "bad_request": [
            lambda: push(core, learner, good, learner_id=7),
            lambda: push(core, learner, good, timestamp="x"),
            lambda: push(core, learner, good, timestamp=True),
            lambda: push(core, learner, good, samples=-1),
            lambda: push(core, learner, good, samples=1.5),
        ],
        "bad_timestamp": [
            lambda: push(core, learner, good, timestamp=-1),
            lambda: push(core, learner, good, timestamp=1),
        ],
        "bad_shape": [
            lambda: push(core, learner, good[:-1]),
            lambda: push(core, learner, good.reshape(3, 3)),
            lambda: push(core, learner, [good[:4], good[5:]]),  # segments one value short
            lambda: push(core, learner, [good[:4], good[4:], good[:1]]),  # one value too many
            lambda: push(core, learner, [good[:4].reshape(2, 2), good[4:]]),  # not one-dimensional
            lambda: push(core, learner, []),
        ],
        "bad_dtype": [
            lambda: push(core, learner, good.astype(np.float64)),
            lambda: push(core, learner, good.astype(np.int32)),
            lambda: push(core, learner, [good[:4], good[4:].astype(np.float16)]),  # a mix
        ],
        "bad_gradient": [
            lambda: push(core, learner, nan),
            lambda: push(core, learner, np.full(LAYOUT.size, np.inf, np.float32)),
        ],
    }
    changes.clear()
    for code, calls in cases.items():
        for call in calls:
            assert code_of(call) == code
    assert core.clock == 0 and not changes
    np.testing.assert_array_equal(core.store.weights, W0)
    for _ in range(2):
        assert push(core, learner, good).outcome == "applied"
    assert core.stopped
    assert code_of(lambda: push(core, learner, good)) == "stopped"
    assert core.clock == 2


def test_an_update_follows_sgd_and_is_accounted():
    updates = []
    core = ServerCore(ServerConfig(kernel="numpy", lr=0.5, momentum=0.0), on_update=updates.append)
    learner = hello(core)
    g = np.linspace(-1, 1, LAYOUT.size).astype(np.float32)
    pending = push(core, learner, g, samples=4, loss=2.5)
    assert (pending.outcome, pending.staleness, updates) == ("applied", 0, [1])
    np.testing.assert_allclose(core.store.weights, W0 - 0.5 * g, rtol=1e-6)
    stale = push(core, learner, g, timestamp=0)
    assert stale.staleness == 1
    stats = core.stats()
    assert (stats["updates"], stats["gradients"], stats["samples"]) == (2, 2, 4)
    assert stats["staleness_histogram"] == {"0": 1, "1": 1}
    assert stats["learners"]["0"]["gradients"] == 2 and stats["loss_curve"] == [[0, 2.5]]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_gradient_in_segments_is_applied_as_their_values_end_to_end(dtype):
    """A learner may push each tensor's gradient as its own segment (docs/wire.md): the
    update is the one of the single concatenated array, bit for bit."""
    g = np.linspace(-1, 1, LAYOUT.size).astype(dtype)
    cores = [ServerCore(ServerConfig(kernel="numpy", lr=0.5, momentum=0.9)) for _ in range(2)]
    learners = [hello(core) for core in cores]
    for _ in range(3):
        push(cores[0], learners[0], g)
        push(cores[1], learners[1], [g[:6], g[6:6], g[6:]])  # the layout's w, an empty one, b
    np.testing.assert_array_equal(cores[0].store.weights, cores[1].store.weights)
    assert cores[1].clock == 3


def test_snapshot_and_restore_continue_the_run_bit_for_bit():
    cfg = dict(kernel="numpy", lr=0.1, momentum=0.9, lr_policy="mean-staleness", mean_staleness_window=3)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(LAYOUT.size).astype(np.float32) for _ in range(6)]

    def run(core, learner, gs, stale_every=2):
        for i, g in enumerate(gs):
            push(core, learner, g, timestamp=max(0, core.clock - (i % stale_every)), samples=3)

    original = ServerCore(ServerConfig(**cfg))
    learner = hello(original)
    run(original, learner, grads[:4])
    with original.store.lease() as (clock, weights):
        state = original.snapshot(clock, weights)
    resumed = ServerCore(ServerConfig(**cfg))
    resumed.restore(state)
    assert (resumed.clock, resumed.samples) == (original.clock, original.samples) == (4, 12)
    assert resumed.staleness.to_dict() == original.staleness.to_dict()
    assert resumed.lr_policy.state() == original.lr_policy.state()
    np.testing.assert_array_equal(resumed.store.updater.momentum, original.store.updater.momentum)
    run(original, learner, grads[4:])
    run(resumed, hello(resumed, initial=None), grads[4:])
    np.testing.assert_array_equal(resumed.store.weights, original.store.weights)
    assert resumed.stats()["staleness_histogram"] == original.stats()["staleness_histogram"]


def test_restore_refuses_a_foreign_shard_or_a_second_source():
    core = ServerCore(ServerConfig(kernel="numpy"))
    hello(core)
    with core.store.lease() as (clock, weights):
        state = core.snapshot(clock, weights)
    with pytest.raises(ConfigError, match="not both"):
        core.restore(state)
    from rudra_async.layout import Shard

    with pytest.raises(ConfigError, match="holds shard 0/1, but this server is shard 1/2"):
        ServerCore(ServerConfig(kernel="numpy", shard=Shard(1, 2))).restore(state)


def test_gradients_a_protocol_still_holds_when_the_run_stops_are_answered_dropped():
    """bounded s = 1: a's second gradient is held for d (computing on clock 1) when the update
    that reaches max_updates happens; it must be settled `dropped`, not left pending."""
    core = ServerCore(ServerConfig(kernel="numpy", protocol="bounded", staleness_bound=1, max_updates=2))
    a, b, c, d = (hello(core, initial=W0 if i == 0 else None) for i in range(4))
    g = np.ones(LAYOUT.size, np.float32)
    for learner in (a, b, c):
        core.pulled(learner, 0)
    assert push(core, a, g).outcome == "applied"  # clock 1
    core.pulled(a, 1)
    core.pulled(d, 1)
    held = push(core, a, g)
    assert held.outcome == "pending" and held.wait_applied  # b and c still compute on clock 0
    assert push(core, b, g, timestamp=0).outcome == "pending"
    assert push(core, c, g, timestamp=0).outcome == "applied"  # b and c go together: clock 2
    assert core.stopped and core.clock == 2
    assert held.outcome == "dropped"
    assert core.rejected["stopped"] == 1 and not core.protocol.held


def test_parameter_groups_come_with_the_first_hello_and_later_hellos_must_match():
    core = ServerCore(ServerConfig(kernel="numpy", lr=0.5, momentum=0.0))
    bad = [[1, 0.1, 0.0]], [[2, 0.1, -1.0]], [[2, float("nan"), 0.0]], [[0, 0.1, 0.0], [2, 0.1, 0.0]]
    for groups in bad:
        assert code_of(lambda g=groups: hello(core, groups=g)) == "bad_groups"
    assert code_of(lambda: hello(core, groups="x")) == "bad_request"  # not even a list: the schema's
    learner = hello(core, groups=[[1, 0.1, 0.01], [1, 0.2, 0.0]])  # w (2x3) with lr 0.1, b (3) with lr 0.2
    assert core.welcome(learner)["groups"] == [[1, 0.1, 0.01], [1, 0.2, 0.0]]
    assert code_of(lambda: hello(core, initial=None, groups=[[2, 0.5, 0.0]])) == "groups_mismatch"
    hello(core, initial=None)  # a learner that declares no groups takes the server's
    g = np.ones(LAYOUT.size, np.float32)
    push(core, learner, g)
    expected = np.concatenate([W0[:6] - 0.1 * (g[:6] + 0.01 * W0[:6]), W0[6:] - 0.2 * g[6:]])
    np.testing.assert_allclose(core.store.weights, expected, rtol=1e-6)
    with core.store.lease() as (clock, weights):
        state = core.snapshot(clock, weights)
    resumed = ServerCore(ServerConfig(kernel="numpy", lr=0.5, momentum=0.0))
    resumed.restore(state)
    assert resumed.groups == core.groups


def test_a_shard_applies_the_part_of_each_group_it_holds():
    """Shard 0/2 of 9 values holds [0, 5), part of w's group; shard 1/2 the rest of it and all of b's."""
    from rudra_async.layout import Shard

    cfg = dict(kernel="numpy", lr=0.5, momentum=0.0)
    groups = [[1, 0.1, 0.0], [1, 0.2, 0.0]]
    whole = ServerCore(ServerConfig(**cfg))
    push(whole, hello(whole, groups=groups), np.ones(LAYOUT.size, np.float32))
    for index in (0, 1):
        shard = ServerCore(ServerConfig(**cfg, shard=Shard(index, 2)))
        lo, hi = Shard(index, 2).range(LAYOUT.size)
        learner = hello(shard, initial=W0[lo:hi], shard=[index, 2], groups=groups)
        push(shard, learner, np.ones(hi - lo, np.float32))
        np.testing.assert_array_equal(shard.store.weights, whole.store.weights[lo:hi])


# -- rules of issue 12: a model that stays finite, bounded inputs, hung learners ------------------


def test_an_update_that_would_overflow_is_skipped_and_the_clock_still_advances():
    core = ServerCore(ServerConfig(kernel="numpy", lr=0.5, momentum=0.9, lr_policy="mean-staleness"))
    learner = hello(core)
    huge = np.full(LAYOUT.size, 3e38, np.float32)  # finite; v = 0.9·v + g overflows on the second push
    assert push(core, learner, huge).outcome == "applied"
    weights, momentum = core.store.weights.copy(), core.store.updater.momentum
    assert np.isfinite(weights).all()
    refused = push(core, learner, huge)
    assert (refused.outcome, refused.refusal_code) == ("refused", "update_not_finite")
    assert core.clock == 2  # the round advanced, so every protocol stays in step
    np.testing.assert_array_equal(core.store.weights, weights)
    np.testing.assert_array_equal(core.store.updater.momentum, momentum)
    assert core.rejected["update_not_finite"] == 1 and core.stats()["gradients"] == 1
    assert core.lr_policy.state()["count"] == 1  # mean-staleness observes applied gradients only
    ok = push(core, learner, np.zeros(LAYOUT.size, np.float32))  # the model is usable afterwards
    assert ok.outcome == "applied" and np.isfinite(core.store.weights).all()
    assert core.lr_policy.state()["count"] == 2


def test_the_gradient_norm_bound_refuses_before_anything_changes():
    core = ServerCore(ServerConfig(kernel="numpy", max_grad_norm=10.0))
    learner = hello(core)
    assert code_of(lambda: push(core, learner, np.full(LAYOUT.size, 1e30, np.float32))) == "gradient_too_large"
    assert code_of(lambda: push(core, learner, np.full(LAYOUT.size, 4.0, np.float16))) == "gradient_too_large"
    assert core.clock == 0
    np.testing.assert_array_equal(core.store.weights, W0)
    assert push(core, learner, np.full(LAYOUT.size, 3.0, np.float32)).outcome == "applied"  # norm 9


def test_samples_are_bounded_per_push_and_the_run_total_saturates():
    core = ServerCore(ServerConfig(kernel="numpy"))
    learner = hello(core)
    g = np.zeros(LAYOUT.size, np.float32)
    assert code_of(lambda: push(core, learner, g, samples=2**64 - 1)) == "bad_request"
    core.samples = 2**63 - 10
    push(core, learner, g, samples=2**32)
    assert core.samples == 2**63 - 1  # still what a checkpoint (msgpack int64) can hold
    with core.store.lease() as (clock, weights):
        core.snapshot(clock, weights)


def test_non_finite_initial_weights_are_refused():
    core = ServerCore(ServerConfig(kernel="numpy"))
    bad = W0.copy()
    bad[2] = np.nan
    assert code_of(lambda: hello(core, initial=bad)) == "no_weights"
    assert core.store is None
    with pytest.raises(ConfigError, match="NaN"):
        ServerCore(ServerConfig(kernel="numpy"), initial={"w": np.array([np.inf], np.float32)})


def test_a_hung_learner_is_evicted_from_the_round_and_rejoins():
    now = [0.0]
    core = ServerCore(ServerConfig(kernel="numpy", protocol="hardsync", momentum=0.0), now=lambda: now[0])
    a, b = hello(core), hello(core, initial=None)
    g = np.ones(LAYOUT.size, np.float32)
    core.active(a)
    waiting = push(core, a, g)  # a waits for b: the round needs both
    assert waiting.outcome == "pending"
    now[0] = 5.0
    assert core.evict_hung(now[0], 10.0) == []  # b has had its weights for 5 s only
    now[0] = 11.0
    assert core.evict_hung(now[0], 10.0) == [b]  # a is busy (waiting), b is hung
    assert waiting.outcome == "applied" and core.clock == 1  # the round completed without b
    assert b.evicted and core.stats()["evictions"] == 1
    core.active(b)  # b wakes up: it rejoins, and its late gradient (stamp 0) is dropped
    late = core.push(b, frame(MsgType.PUSH, {"timestamp": 0}, [g]).meta, frame(MsgType.PUSH, {"timestamp": 0}, [g]))
    assert late.outcome == "dropped" and not b.evicted and 1 in core.protocol.members
    core.idle(b)


@pytest.mark.parametrize("protocol, options", [("bounded", {"staleness_bound": 1})])
def test_an_evicted_learners_late_gradient_is_dropped_under_every_protocol_that_evicts(protocol, options):
    """Not only hardsync: a learner evicted while it computed on θ_0 comes back with that
    gradient after the others moved the clock on; it is answered dropped (under bounded it
    would break the bound: σ = 3 > s = 1), and its next gradient, on new weights, counts."""
    now = [0.0]
    cfg = ServerConfig(kernel="numpy", protocol=protocol, momentum=0.0, **options)
    core = ServerCore(cfg, now=lambda: now[0])
    a, b = hello(core), hello(core, initial=None)
    g = np.ones(LAYOUT.size, np.float32)

    def pull(learner):
        core.active(learner)
        core.pulled(learner, core.clock)
        core.idle(learner)

    pull(a)
    pull(b)
    now[0] = 11.0
    core.active(a)
    push(core, a, g)  # applied
    assert core.evict_hung(now[0], 10.0) == [b]
    core.idle(a)
    while core.clock < 3:
        pull(a)
        core.active(a)
        assert push(core, a, g).outcome == "applied"
        core.idle(a)
    core.active(b)  # b is back, with the gradient it computed on θ_0
    late = push(core, b, g, timestamp=0)
    assert late.outcome == "dropped" and b.dropped == 1 and core.clock == 3
    core.idle(b)
    pull(b)
    core.active(b)
    fresh = push(core, b, g)
    assert fresh.outcome == "applied" and core.clock >= 4
    assert max(int(s) for s in core.stats()["staleness_histogram"]) <= 1


@pytest.mark.parametrize("protocol, options", [("async", {}), ("softsync", {"n": 1})])
def test_protocols_that_wait_for_nobody_never_evict(protocol, options):
    """Under async and softsync no learner is waited for (softsync's c gradients may come from
    any learners), so a slow one is never evicted: its gradients, however late, still count."""
    now = [0.0]
    core = ServerCore(ServerConfig(kernel="numpy", protocol=protocol, momentum=0.0, **options), now=lambda: now[0])
    a, b = hello(core), hello(core, initial=None)
    core.pulled(b, 0)
    g = np.ones(LAYOUT.size, np.float32)
    for _ in range(3):
        core.active(a)
        push(core, a, g)
        core.idle(a)
    now[0] = 1e9
    assert core.evict_hung(now[0], 1.0) == [] and not b.evicted
    core.active(b)
    assert push(core, b, g, timestamp=0).outcome in ("applied", "pending") and b.dropped == 0


def test_the_learner_table_keeps_a_bounded_history():
    core = ServerCore(ServerConfig(kernel="numpy", learner_history=3))
    first = hello(core)
    push(core, first, np.zeros(LAYOUT.size, np.float32))
    core.leave(first)
    for _ in range(5):
        core.leave(hello(core, initial=None))
    stats = core.stats()
    assert len(core.learners) == 3 and stats["learners_forgotten"] == 3
    assert stats["gradients"] == 1 and "0" not in stats["learners"]


def test_each_learner_has_its_last_request_time_mean_staleness_and_slow_flag():
    now = [100.0]
    core = ServerCore(ServerConfig(kernel="numpy"), now=lambda: now[0])
    a, b = hello(core), hello(core, initial=None)
    assert a.last_active == b.last_active == 100.0 and a.staleness_mean == 0.0
    stamp = core.clock
    now[0] = 101.0
    push(core, a, np.zeros(LAYOUT.size, np.float32))  # σ = 0
    push(core, a, np.zeros(LAYOUT.size, np.float32))  # σ = 0
    core.active(a)
    core.idle(a)
    now[0] = 102.5
    core.active(b)
    push(core, b, np.zeros(LAYOUT.size, np.float32), timestamp=stamp)  # σ = 2
    assert (a.last_active, b.last_active) == (101.0, 102.5)
    assert (a.staleness_sum, b.staleness_sum) == (0, 2) and b.staleness_mean == 2.0
    now[0] = 110.0
    stats = core.stats()["learners"]
    assert stats["0"]["last_seen_s"] == 9.0 and stats["1"]["staleness_mean"] == 2.0
    assert stats["0"]["peer"] == "test" and not stats["0"]["slow"]
    # slow: idle for longer than the limit, unless a request of its own is in the server
    assert core.newly_slow(7.0) == [a] and a.slow  # b's request is still in the server
    core.idle(b)
    now[0] = 120.0
    assert core.newly_slow(7.0) == [b]  # a is reported once
    assert core.newly_slow(7.0) == []
    core.active(b)
    assert not b.slow and b.last_active == 120.0
    core.idle(b)
    core.leave(a, clean=False)
    now[0] = 200.0
    assert core.newly_slow(7.0) == [b]  # a left: never slow
    assert "loss_curve" in core.stats() and "loss_curve" not in core.stats(loss_curve=False)


def test_a_learner_is_alone_while_no_other_has_a_request_in_progress():
    """What decides whether a weights reply may lease the weights before its update is
    computed (Session._send_weights): no other learner's request in progress."""
    core = ServerCore(ServerConfig(kernel="numpy"))
    a, b = hello(core), hello(core)
    assert core.alone(a) and core.alone(b)
    core.active(a)
    assert core.alone(a) and not core.alone(b)
    core.active(b)
    assert not core.alone(a)
    core.idle(b)
    core.idle(a)
    assert core.alone(a) and core.alone(b)
    core.active(a)
    core.writing(a)  # a push whose gradient a still writes: not yet in progress
    assert core.alone(b)
    core.not_written(a)
    assert not core.alone(b)


def test_updates_dropped_at_the_end_of_a_run_are_not_counted_by_the_protocol():
    """A bounded drain that releases two updates when the run has room for one: the second is
    dropped, and the protocol's clock stays the server's, so a run extended afterwards
    (``stop_at``) checks its bound against the right clock."""
    cfg = ServerConfig(kernel="numpy", protocol="bounded", staleness_bound=1, momentum=0.0, max_updates=2)
    core = ServerCore(cfg)
    a, b, c = hello(core), hello(core, initial=None), hello(core, initial=None)
    g = np.ones(LAYOUT.size, np.float32)
    for learner in (a, b, c):
        core.pulled(learner, 0)
    assert push(core, b, g).outcome == "applied"
    core.pulled(b, 1)
    held = [push(core, b, g), push(core, c, g, timestamp=0)]  # would take a past the bound: held
    assert [p.outcome for p in held] == ["pending", "pending"] and core.clock == 1
    core.leave(a)  # releases both: the first ends the run, the second is dropped
    assert core.clock == 2 and core.stopped and sorted(p.outcome for p in held) == ["applied", "dropped"]
    assert core.protocol.clock == core.clock
    core.stop_at(100)
    d = hello(core, initial=None)
    core.pulled(b, 2)
    core.pulled(d, 2)
    assert push(core, b, g).outcome == "applied" and core.clock == 3  # σ of d becomes 1 <= s: at once

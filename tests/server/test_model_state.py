"""The model's state besides its trained weights on the server side, through the wire: frozen
parameters and buffers (HELLO ``state``, STATE), the rule that combines learners' buffers,
format-2 checkpoints; learner indices and λ (WELCOME, WEIGHTS); a push's ``lr``."""

import numpy as np
import pytest
from helpers import initial_weights, run_server, small_layout

from rudra_async import checkpoint as ckpt
from rudra_async.client import Client
from rudra_async.errors import CheckpointError, RemoteError, RequestError
from rudra_async.model_state import RunState, StateLayout

LAYOUT = small_layout()
STATE = StateLayout.from_wire(
    [
        ["frozen.weight", "<f4", [2, 2], "frozen"],
        ["bn.running_mean", "<f4", [3], "buffer"],
        ["bn.num_batches_tracked", "<i8", [], "buffer"],
    ]
)


def state_values(seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((2, 2)).astype(np.float32), rng.standard_normal(3).astype(np.float32), np.array(seed)]


async def learner(ps, state=STATE, **kwargs):
    return await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT), state=state, **kwargs)


def test_buffers_are_the_mean_of_the_newest_reports_of_the_last_peak_learners():
    run = RunState(STATE)
    run.seed(state_values(0))
    frozen = run.values[0].copy()
    a, b, c = (np.array([1, 2, 3], np.float32), np.array([3, 4, 7], np.float32), np.array([0, 0, 2], np.float32))
    run.report(1, [a, np.array(10)], peak=2)
    assert np.array_equal(run.values[1], a) and run.values[2] == 10
    run.report(0, [b, np.array(7)], peak=2)
    assert np.array_equal(run.values[1], (a + b) / 2) and run.values[2] == 7  # an integer buffer: the newest
    run.report(1, [c, np.array(11)], peak=2)  # learner 1 again: its report replaces its older one
    assert np.array_equal(run.values[1], (b + c) / 2)
    run.report(5, [a, np.array(12)], peak=2)  # a third learner with a peak of 2: learner 0's report is the oldest
    assert np.array_equal(run.values[1], (c + a) / 2)
    assert np.array_equal(run.values[0], frozen)  # frozen parameters keep their seeded values
    with pytest.raises(RequestError, match=r"bn\.running_mean"):
        run.report(1, [np.zeros(4, np.float32), np.array(1)], peak=2)


def test_a_state_layout_names_the_first_tensor_that_differs():
    other = StateLayout.from_wire([["frozen.weight", "<f4", [2, 3], "frozen"], *STATE.to_wire()[1:]])
    assert "frozen 'frozen.weight' (<f4, shape [2, 2])" in STATE.mismatch(other)
    assert "bn.num_batches_tracked" in STATE.mismatch(StateLayout(STATE.tensors[:2]))
    assert STATE.mismatch(StateLayout.from_wire(STATE.to_wire())) is None
    for bad in (["x"], [["a", "<c8", [1], "buffer"]], [["a", "<f4", [1], "weight"]], [["a", "<f4", [1], "frozen"]] * 2):
        with pytest.raises(RequestError) as info:
            StateLayout.from_wire(bad)
        assert info.value.code == "bad_layout"


async def test_the_first_learners_state_is_the_runs_and_reports_reach_the_checkpoint(tmp_path):
    path = tmp_path / "run.ckpt"
    async with run_server(kernel="numpy", checkpoint=str(path)) as ps:
        first, second = await learner(ps), await learner(ps)
        assert first.welcome["state"] == STATE.to_wire()
        values = await second.exchange_state(state_values(2), every=True, reply=True)  # seeds: the first to send
        assert all(np.array_equal(v, w) for v, w in zip(values, state_values(2)))
        values = await first.exchange_state(state_values(1), every=True, reply=True)  # takes the run's, not its own
        assert all(np.array_equal(v, w) for v, w in zip(values, state_values(2)))
        buffers = [np.array([1, 1, 1], np.float32), np.array(3)]
        assert await first.exchange_state(buffers, every=False, reply=False) == []
        await second.exchange_state([np.array([3, 5, 7], np.float32), np.array(4)], every=False, reply=False)
        await first.close()
        await second.close()
    saved = ckpt.load(path)
    assert saved.model_state == STATE and saved.state["rates"] == [0.03]
    assert np.array_equal(saved.model_state_values[0], state_values(2)[0])
    assert np.array_equal(saved.model_state_values[1], [2, 3, 4]) and saved.model_state_values[2] == 4
    async with run_server(kernel="numpy", resume=str(path)) as ps:  # a resumed server holds them
        client = await learner(ps)
        values = await client.exchange_state(state_values(9), every=True, reply=True)
        assert np.array_equal(values[1], [2, 3, 4])
        await client.close()


async def test_state_requests_that_cannot_be_taken_are_refused_with_their_reason():
    async with run_server(kernel="numpy") as ps:
        plain = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        with pytest.raises(RemoteError) as info:  # no learner declared any state
            await plain.exchange_state([], every=False, reply=False)
        assert info.value.code == "no_state"
        client = await learner(ps)  # the first hello that declares a state sets the run's
        with pytest.raises(RemoteError) as info:  # a state that differs from the run's, named
            await learner(ps, state=StateLayout(STATE.tensors[:2]))
        assert info.value.code == "layout_mismatch" and "bn.num_batches_tracked" in str(info.value)
        with pytest.raises(RemoteError) as info:  # buffers before anyone sent the values
            await client.exchange_state(state_values(0)[1:], every=False, reply=False)
        assert info.value.code == "no_state"
        with pytest.raises(RemoteError) as info:
            await client.exchange_state([np.zeros(3, np.float32)] * 3, every=True, reply=False)
        assert info.value.code == "bad_shape" and "frozen.weight" in str(info.value)
        await plain.close()
        await client.close()


async def test_learners_get_distinct_indices_and_the_runs_lambda():
    async with run_server(kernel="numpy", expected_learners=3) as ps:
        a = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        b = await Client.connect(ps.addresses[0], LAYOUT, index=2)
        c = await Client.connect(ps.addresses[0], LAYOUT, index=2)  # taken: the lowest free one
        assert [(x.index, x.learners) for x in (a, b, c)] == [(0, 3), (2, 3), (1, 3)]
        await b.close()
        d = await Client.connect(ps.addresses[0], LAYOUT, index=7)  # beyond λ: the lowest free one
        assert d.index == 2
        for x in (a, c, d):
            await x.close()
    async with run_server(kernel="numpy") as ps:  # no --expected-learners: λ is who is connected
        a = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        assert (a.index, a.learners) == (0, 1)
        b = await Client.connect(ps.addresses[0], LAYOUT)
        await a.pull()
        assert a.learners == 2 and b.index == 1  # WEIGHTS carry λ
        await b.close()
        await a.pull()
        assert a.learners == 1
        await a.close()


async def test_a_pushs_lr_sets_the_group_rates_from_the_next_update():
    async with run_server(kernel="numpy", lr=0.5, momentum=0.0) as ps:
        client = await Client.connect(ps.addresses[0], LAYOUT, np.zeros(LAYOUT.size, np.float32))
        w = await client.pull()
        ones = np.ones(LAYOUT.size, np.float32)
        w = await client.push_pull(ones, w.timestamp)
        assert np.allclose(w.array, -0.5)
        w = await client.push_pull(ones, w.timestamp, lr=[0.25])
        assert np.allclose(w.array, -0.75) and ps.core.rates == (0.25,)
        w = await client.push_pull(ones, w.timestamp)  # stays in force
        assert np.allclose(w.array, -1.0)
        with pytest.raises(RemoteError) as info:
            await client.push_pull(ones, w.timestamp, lr=[0.1, 0.1])
        assert info.value.code == "bad_request" and "'lr'" in str(info.value)
        assert ps.core.rates == (0.25,) and ps.clock == 3
        await client.close()


def test_a_format_2_checkpoint_round_trips_and_hostile_state_is_refused(tmp_path):
    zeros = np.zeros(LAYOUT.size, np.float32)
    path = tmp_path / "s.ckpt"
    ckpt.save(path, ckpt.Checkpoint(LAYOUT, 3, zeros, zeros, model_state=STATE, model_state_values=state_values(1)))
    loaded = ckpt.load(path)
    assert loaded.model_state == STATE
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(loaded.model_state_values, state_values(1)))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of the last state tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="CRC-32"):
        ckpt.load(path)
    with pytest.raises(CheckpointError, match=r"frozen\.weight"):  # values that are not the layout's
        ckpt.save(path, ckpt.Checkpoint(LAYOUT, 3, zeros, zeros, model_state=STATE, model_state_values=[zeros] * 3))
    with pytest.raises(CheckpointError, match="rates"):
        ckpt.save(path, ckpt.Checkpoint(LAYOUT, 3, zeros, zeros, state={"rates": [0.1, 0.2]}))

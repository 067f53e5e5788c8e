"""Sharded server groups: S servers each hold a contiguous part of the parameters; a learner
pushes and pulls every part at once. A group must compute what one server does."""

import asyncio
import contextlib
import itertools
import json
import signal

import numpy as np
import pytest
from helpers import (
    free_port,
    initial_weights,
    last_json,
    push_sequence,
    random_batches,
    reap,
    run_cli,
    run_server,
    sgd_reference,
    small_layout,
    start_cli,
    start_server,
)

from rudra_async import ConfigError, ParameterServer, ServerConfig
from rudra_async.client import Client, ShardedClient, connect
from rudra_async.errors import RemoteError
from rudra_async.layout import Layout, Shard

SGD = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


@pytest.mark.parametrize("size, count", [(16, 1), (16, 3), (17, 4), (5, 5), (1000, 7)])
def test_shard_ranges_cover_the_buffer_in_balanced_contiguous_parts(size, count):
    ranges = [Shard(i, count).range(size) for i in range(count)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    lengths = [hi - lo for lo, hi in ranges]
    assert max(lengths) - min(lengths) <= 1


def test_bad_shards_are_refused():
    for text in ["2/2", "-1/2", "a/b", "3", "0/0"]:
        with pytest.raises(ConfigError, match="shard must be"):
            Shard.parse(text)
    with pytest.raises(ConfigError, match="cannot split 3 parameters into 4 shards"):
        Shard(0, 4).range(3)
    with pytest.raises(ConfigError, match=r"shard must be a Shard \(e.g. Shard.parse\('0/2'\)\), got '0/2'"):
        ServerConfig(listen=["tcp://127.0.0.1:0"], shard="0/2").validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "metrics, second",
    [("127.0.0.1:9320", "127.0.0.1:9321"), ("http://127.0.0.1:9320/", "127.0.0.1:9321"), ("9320", "127.0.0.1:9321"),
     ("[::1]:9320", "[::1]:9321"), ("127.0.0.1:0", "127.0.0.1:0")],
)  # fmt: skip
def test_shard_i_serves_its_metrics_at_port_plus_i_whatever_the_form(metrics, second):
    cfg = ServerConfig(metrics=metrics).for_shard(Shard(1, 2), "tcp://127.0.0.1:0")
    assert cfg.metrics == second and cfg.validate()


@contextlib.asynccontextmanager
async def run_group(count, **config):
    """``count`` real servers on loopback ports, shard i/count each; yields (servers, joined URL)."""
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(run_server(shard=Shard(i, count), **config)) for i in range(count)]
        yield servers, ",".join(ps.addresses[0] for ps in servers)


@pytest.mark.parametrize("count", [2, 3])
async def test_a_sharded_group_computes_what_one_server_does(count):
    layout = small_layout()
    w0 = initial_weights(layout)
    batches = list(random_batches(layout.size, 15, 1))
    async with run_server(protocol="async", **SGD) as ps:
        single, _ = await push_sequence(ps.addresses[0], layout, [g[0] for g, _ in batches], w0)
    async with run_group(count, protocol="async", **SGD) as (servers, url):
        sharded, stamps = await push_sequence(url, layout, [g[0] for g, _ in batches], w0)
        assert [ps.clock for ps in servers] == [15] * count
        for ps, (lo, hi) in zip(servers, (Shard(i, count).range(layout.size) for i in range(count))):
            np.testing.assert_array_equal(ps.core.store.weights, sharded[lo:hi])  # each holds only its part
            assert ps.core.store.layout.size == hi - lo
    assert stamps == [(k,) * count for k in range(16)]
    # the same arithmetic per element; only the kernel's vector/scalar split of each slice may round differently
    np.testing.assert_allclose(sharded, single, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("count", [1, 3])
async def test_a_gradient_given_in_parts_pushes_what_the_whole_array_does(count):
    """Parts cut anywhere (not at shard bounds, one of them empty, one 2-D) go to each shard
    as views of its range: the same weights, bit for bit, as pushing the gathered array."""
    layout = small_layout()
    w0 = initial_weights(layout)
    grads = [g[0] for g, _ in random_batches(layout.size, 5, 2)]
    cuts = [0, 3, 3, 9, layout.size - 2, layout.size]  # layout.size is 16
    parts = [[g[lo:hi] for lo, hi in itertools.pairwise(cuts)] for g in grads]
    for p in parts:
        p[1], p[2] = p[1].reshape(0, 4), p[2].reshape(-1, 2)  # an empty part, a 2-D one (6 values)
    async with run_group(count, protocol="async", **SGD) as (_, url):
        whole, _ = await push_sequence(url, layout, grads, w0)
    async with run_group(count, protocol="async", **SGD) as (_, url):
        in_parts, _ = await push_sequence(url, layout, parts, w0)
    np.testing.assert_array_equal(in_parts, whole)
    assert not np.array_equal(whole, w0)


@pytest.mark.torch
async def test_sharded_hardsync_equals_torch_sgd_on_the_combined_gradient():
    layout, learners, steps = small_layout(), 3, 6
    w0 = initial_weights(layout)
    batches = list(random_batches(layout.size, steps, learners))
    expected = list(sgd_reference(w0, [(g, [1 / learners] * learners) for g, _ in batches], **SGD))
    async with run_group(2, protocol="hardsync", **SGD) as (servers, url):
        clients = [await connect(url, layout, w0) for _ in range(learners)]
        ws = [await c.pull() for c in clients]
        for step, (grads, _) in enumerate(batches):
            ws = await asyncio.gather(*(c.push_pull(g, w.timestamp) for c, g, w in zip(clients, grads, ws)))
            for w in ws:
                assert w.timestamp == (step + 1, step + 1)
                np.testing.assert_allclose(w.array, expected[step], rtol=1e-5, atol=1e-6)
        assert all(ps.stats()["staleness_max"] == 0 for ps in servers)
        for c in clients:
            await c.close()


async def test_a_learner_must_address_the_right_shard():
    layout = small_layout()
    async with run_group(2, protocol="async") as (servers, url):
        first, second = url.split(",")
        with pytest.raises(RemoteError) as info:
            await ShardedClient.connect([second, first], layout, initial_weights(layout))  # swapped order
        assert info.value.code == "shard_mismatch"
        with pytest.raises(RemoteError) as info:
            await Client.connect(first, layout, initial_weights(layout))  # a whole-model hello
        assert info.value.code == "shard_mismatch"
        assert all(ps.core.store is None for ps in servers)  # nothing was initialized by the refused hellos


async def test_a_model_smaller_than_the_group_is_refused_with_a_reason():
    async with run_group(3, protocol="async") as (_, url):
        tiny = Layout.from_shapes([("w", (2,))])
        with pytest.raises(ConfigError, match="cannot split 2 parameters into 3 shards"):  # caught by the client
            await ShardedClient.connect(url.split(","), tiny, np.zeros(2, np.float32))
        with pytest.raises(RemoteError) as info:  # and by the server, for clients that do not check
            await Client.connect(url.split(",")[0], tiny, np.zeros(1, np.float32), shard=Shard(0, 3))
        assert info.value.code == "bad_layout" and "cannot split 2 parameters into 3 shards" in str(info.value)


def test_an_embedded_shard_takes_its_part_of_the_initial_weights():
    w = np.arange(10, dtype=np.float32)
    ps = ParameterServer(ServerConfig(shard=Shard(1, 3)), initial={"a": w[:4], "b": w[4:].reshape(2, 3)})
    np.testing.assert_array_equal(ps.core.store.weights, w[4:7])
    assert ps.core.layout == Layout.from_shapes([("a", (4,)), ("b", (2, 3))])


@pytest.mark.torch
def test_sharded_processes_train_checkpoint_and_evaluate(tmp_path):
    """Two `rudra-async server --shard i/2` processes, two learner processes connected to
    both; each shard checkpoints its part; `evaluate` joins the parts."""
    ports = [free_port(), free_port()]
    url = ",".join(f"tcp://127.0.0.1:{p}" for p in ports)
    ckpts = [tmp_path / f"shard{i}.ckpt" for i in range(2)]
    template = str(tmp_path / "shard{shard}.ckpt")  # one command line for both, as the --checkpoint help says
    servers, learners = [], []
    try:
        servers = [
            start_server(ports[i], "--shard", f"{i}/2", "--max-updates", "300", "--checkpoint", template)
            for i in range(2)
        ]
        learners = [start_cli("learner", "--connect", url, "--index", str(i), "--json") for i in range(2)]
        steps = 0
        for p in learners:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            steps += last_json(out)["steps"]
        # the group stopped at 300 updates; a last push racing the stop may be applied by one
        # shard and refused by the other, and then it does not count as a step of its learner
        assert 300 - len(learners) <= steps <= 300
        stats = []
        for s in servers:
            s.send_signal(signal.SIGTERM)
            _, err = s.communicate(timeout=30)
            assert s.returncode == 0, err
            stats.append(last_json(err))
        assert [st["shard"] for st in stats] == ["0/2", "1/2"] and [st["updates"] for st in stats] == [300, 300]
    finally:
        reap(*servers, *learners)
    run = run_cli("evaluate", str(ckpts[1]), str(ckpts[0]), "--json")
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["clocks"] == [300, 300] and result["test_accuracy"] >= 0.8, result
    run = run_cli("evaluate", str(ckpts[0]))
    assert run.returncode == 2 and "need one checkpoint for every shard of 2" in run.stderr
    run = run_cli(
        "server", "--listen", f"tcp://127.0.0.1:{free_port()}", "--shard", "1/2", "--resume", str(ckpts[0]), timeout=60
    )
    assert run.returncode == 2 and "holds shard 0/2, but this server is shard 1/2" in run.stderr


@pytest.mark.torch
def test_train_with_a_shard_group_gives_the_accuracy_of_its_joined_checkpoints(tmp_path):
    results, ckpt = tmp_path / "r.json", str(tmp_path / "part-{shard}.ckpt")
    run = run_cli(
        "train",
        "-q",
        "--shards",
        "2",
        "-l",
        "2",
        "--protocol",
        "hardsync",
        "--updates",
        "60",
        "--checkpoint",
        ckpt,
        "--results",
        str(results),
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(results.read_text())
    assert res["shards"] == 2 and res["updates"] == 60 and res["staleness_max"] == 0
    run = run_cli("evaluate", ckpt.replace("{shard}", "1"), ckpt.replace("{shard}", "0"), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["test_accuracy"] == res["test_accuracy"]


async def test_a_group_whose_shards_run_other_settings_is_refused():
    """Shard servers started with other settings (a typo on one host) would train differently
    shard by shard: connecting to such a group is a ConfigError naming what differs, and no
    learner is left registered."""
    layout = small_layout()
    async with contextlib.AsyncExitStack() as stack:
        servers = [
            await stack.enter_async_context(run_server(shard=Shard(i, 2), momentum=momentum, kernel="numpy"))
            for i, momentum in enumerate((0.9, 0.0))
        ]
        url = ",".join(ps.addresses[0] for ps in servers)
        with pytest.raises(
            ConfigError, match=r"shard 1 of the group runs other settings than shard 0: momentum 0\.0 there"
        ):
            await ShardedClient.connect(url.split(","), layout, initial_weights(layout))
        for _ in range(100):
            if not any(info.connected for ps in servers for info in ps.core.learners.values()):
                break
            await asyncio.sleep(0.02)
        assert not any(info.connected for ps in servers for info in ps.core.learners.values())


@pytest.mark.torch
def test_evaluate_refuses_shard_checkpoints_of_different_updates(tmp_path):
    """The parts of one model come from one update: a shard's file left from a crash between
    periodic checkpoints, or from another run, would join into a model nobody trained."""
    from rudra_async import checkpoint
    from rudra_async.learner.evaluation import evaluate_checkpoint

    layout = small_layout()
    paths = []
    for index, clock in ((0, 50), (1, 5)):
        shard = Shard(index, 2)
        lo, hi = shard.range(layout.size)
        part = np.zeros(hi - lo, np.float32)
        path = str(tmp_path / f"part-{index}.ckpt")
        checkpoint.save(path, checkpoint.Checkpoint(layout, clock, part, part, 0, shard=shard))
        paths.append(path)
    with pytest.raises(ConfigError, match=r"of different updates \(shard 0 at update 50, shard 1 at update 5\)"):
        evaluate_checkpoint(paths)

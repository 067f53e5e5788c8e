"""Checkpoints: the file format refuses anything incomplete, and a server resumed from a
checkpoint continues exactly where the checkpointed one was (weights, momentum, clock)."""

import asyncio
import concurrent.futures
import fcntl
import os
import shutil
import signal
import subprocess
import time
import tracemalloc
import zlib

import msgpack
import numpy as np
import pytest
from helpers import (
    CLI_ARGS,
    free_port,
    initial_weights,
    last_json,
    push_sequence,
    random_batches,
    reap,
    run_server,
    small_layout,
    start_cli,
    start_server,
    subprocess_env,
)

from rudra_async import CheckpointError, ConfigError, ParameterServer, ServerConfig
from rudra_async import checkpoint as ckpt
from rudra_async.client import Client
from rudra_async.lr import MAX_WINDOW, MeanStaleness
from rudra_async.server.checkpointer import Checkpointer
from rudra_async.wire import Header, MsgType, encode_frame

SGD = dict(protocol="async", lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True)


def sample_checkpoint(clock=7):
    layout = small_layout()
    rng = np.random.default_rng(clock)
    return ckpt.Checkpoint(
        layout,
        clock,
        rng.standard_normal(layout.size).astype(np.float32),
        rng.standard_normal(layout.size).astype(np.float32),
        samples=123,
        info={"lr": 0.05},
    )


def test_round_trip_and_no_temporary_left(tmp_path):
    path = tmp_path / "run.ckpt"
    state = sample_checkpoint()
    ckpt.save(path, state)
    ckpt.save(path, sample_checkpoint(clock=8))  # replaces atomically
    back = ckpt.load(path)
    assert (back.clock, back.samples, back.info, back.layout) == (8, 123, {"lr": 0.05}, state.layout)
    np.testing.assert_array_equal(back.weights, sample_checkpoint(clock=8).weights)
    np.testing.assert_array_equal(back.momentum, sample_checkpoint(clock=8).momentum)
    assert os.listdir(tmp_path) == ["run.ckpt"]


def test_concurrent_saves_leave_one_whole_file(tmp_path):
    path = tmp_path / "run.ckpt"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda clock: ckpt.save(path, sample_checkpoint(clock)), range(1, 9)))
    back = ckpt.load(path)
    np.testing.assert_array_equal(back.weights, sample_checkpoint(back.clock).weights)
    assert os.listdir(tmp_path) == ["run.ckpt"]


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip a body byte":
        data[-5] ^= 0xFF
    elif how == "cut in the header":
        data = data[:10]
    elif how == "cut in the metadata":
        data = data[:40]
    elif how == "cut in the body":
        data = data[:-3]
    elif how == "padded":
        data += b"\0"
    elif how == "not rudra":
        data = b"PK\x03\x04" + data[4:]
    elif how == "empty":
        data = b""
    elif how == "change the clock":  # still valid msgpack: only the CRC of the metadata can tell
        at = data.index(b"\xa5clock\x07")
        data[at + 6] = 0x08
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, message",
    [
        ("flip a body byte", "fails its CRC-32"),
        ("cut in the header", "not a rudra-async checkpoint"),
        ("cut in the metadata", "truncated"),
        ("cut in the body", "truncated"),
        ("padded", "padded"),
        ("not rudra", "bad magic"),
        ("empty", "not a rudra-async checkpoint"),
        ("change the clock", "metadata fails its CRC-32"),
    ],
)
def test_damaged_files_are_refused_with_the_reason(tmp_path, how, message):
    path = tmp_path / "run.ckpt"
    ckpt.save(path, sample_checkpoint())
    corrupt(path, how)
    with pytest.raises(CheckpointError, match=message):
        ckpt.load(path)


def test_other_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*No such file"):
        ckpt.load(tmp_path / "missing.ckpt")
    frame = tmp_path / "frame.bin"
    frame.write_bytes(b"".join(bytes(b) for b in encode_frame(MsgType.PUSH, {"timestamp": 0})))
    with pytest.raises(CheckpointError, match="type 3, not a checkpoint"):
        ckpt.load(frame)
    state = sample_checkpoint()
    wrong = tmp_path / "wrong.ckpt"
    wrong.write_bytes(
        b"".join(
            bytes(b)
            for b in encode_frame(
                MsgType.CHECKPOINT,
                {"format": 99, "clock": 1, "layout": state.layout.to_wire(), "crc32": [0, 0]},
                [state.weights, state.momentum],
            )
        )
    )
    with pytest.raises(CheckpointError, match="format 99"):
        ckpt.load(wrong)
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        ckpt.save(tmp_path / "no-such-dir" / "x.ckpt", state)


async def test_resumed_run_equals_the_uninterrupted_one(tmp_path):
    grads = [g[0] for g, _ in random_batches(small_layout().size, 20, 1)]
    w0 = initial_weights(small_layout())
    async with run_server(**SGD) as ps:
        uninterrupted, _ = await push_sequence(ps.addresses[0], small_layout(), grads, w0)
    path = str(tmp_path / "run.ckpt")
    async with run_server(**SGD, checkpoint=path) as ps:
        await push_sequence(ps.addresses[0], small_layout(), grads[:12], w0)
    assert ckpt.load(path).clock == 12  # written at close
    async with run_server(**SGD, resume=path) as ps:
        assert ps.clock == 12
        resumed, _ = await push_sequence(
            ps.addresses[0], small_layout(), grads[12:], np.zeros_like(w0)
        )  # its initial weights are ignored
        assert ps.stats()["updates"] == 20
    np.testing.assert_array_equal(resumed, uninterrupted)  # bit for bit: the momentum came back too


async def test_resume_keeps_the_staleness_statistics_and_the_mean_staleness_rate(tmp_path):
    path = str(tmp_path / "run.ckpt")
    layout = small_layout()
    grad = np.full(layout.size, 0.01, np.float32)
    config = dict(protocol="async", lr_policy="mean-staleness", lr=0.05)
    async with run_server(**config, checkpoint=path) as ps:
        a, b = [await Client.connect(ps.addresses[0], layout, initial_weights(layout)) for _ in range(2)]
        for _ in range(5):  # b always pushes on weights one update old: σ = 0, 1, 0, 1, …
            stamp = (await b.pull()).timestamp
            await a.push(grad, ps.clock)
            await b.push(grad, stamp)
        before = (ps.stats()["staleness_histogram"], ps.core.lr_policy.mean)
        await a.close()
        await b.close()
    assert before[0] == {"0": 5, "1": 5} and before[1] == 0.5
    async with run_server(**config, resume=path) as ps:
        assert (ps.stats()["staleness_histogram"], ps.core.lr_policy.mean) == before


async def test_periodic_checkpoints_hold_the_weights_of_their_update(tmp_path):
    """Written every 3 updates while pushes go on; each file is the state at its own clock."""
    path = tmp_path / "run.ckpt"
    grads = [g[0] for g, _ in random_batches(small_layout().size, 10, 1)]
    seen = {}
    async with run_server(**SGD, checkpoint=str(path), checkpoint_every=3) as ps:
        client = await Client.connect(ps.addresses[0], small_layout(), initial_weights(small_layout()))
        w = await client.pull()
        for g in grads:
            w = await client.push_pull(g, w.timestamp)
            seen[w.timestamp] = w.array.copy()
            await ps.checkpointer.settled()  # let a due one land before the next may start
            if path.exists():
                state = ckpt.load(path)
                np.testing.assert_array_equal(state.weights, seen[state.clock])
                assert state.clock % 3 == 0
        await client.close()
        assert ps.stats()["checkpoint"]["written"] == 3  # 3, 6, 9
    assert ckpt.load(path).clock == 10  # and the final one at close


async def test_a_failing_checkpoint_does_not_stop_training_but_close_reports_it(tmp_path):
    directory = tmp_path / "ckpts"
    directory.mkdir()
    grads = [g[0] for g, _ in random_batches(small_layout().size, 6, 1)]
    ps = ParameterServer(
        ServerConfig(listen=["tcp://127.0.0.1:0"], **SGD, checkpoint=str(directory / "run.ckpt"), checkpoint_every=2)
    )
    await ps.start()
    try:
        shutil.rmtree(directory)  # e.g. a volume that went away
        await push_sequence(ps.addresses[0], small_layout(), grads, initial_weights(small_layout()))
        assert ps.clock == 6
        await ps.checkpointer.settled()
        assert ps.stats()["checkpoint"]["failed"] >= 1 and ps.stats()["checkpoint"]["written"] == 0
    finally:
        with pytest.raises(CheckpointError, match="cannot write checkpoint"):
            await ps.close()


async def test_checkpoints_fall_due_even_when_the_clock_jumps_and_survive_odd_failures():
    written = []

    async def write(path):
        if not written:
            written.append(None)
            raise TypeError("a plugin's state is not serializable")
        written.append(path)
        return 0

    schedule = Checkpointer("x.ckpt", 10, write)
    for clock in (9, 11):  # one decision applied two batches: 9 -> 11 passes the multiple 10
        schedule.after_update(clock)
    await schedule.settled()
    assert schedule.stats["failed"] == 1  # logged and counted; training goes on
    schedule.after_update(12)  # same period: nothing new falls due
    schedule.after_update(21)
    await schedule.settled()
    assert written == [None, "x.ckpt"]
    await schedule.final(21)  # still writes the final one
    assert written == [None, "x.ckpt", "x.ckpt"]


def test_bad_checkpoint_settings_fail_before_serving(tmp_path):
    with pytest.raises(ConfigError, match="--checkpoint-every needs --checkpoint"):
        ParameterServer(ServerConfig(checkpoint_every=5))
    with pytest.raises(ConfigError, match="does not exist"):
        ParameterServer(ServerConfig(checkpoint=str(tmp_path / "nope" / "x.ckpt")))
    with pytest.raises(ConfigError, match="is a directory"):
        ParameterServer(ServerConfig(checkpoint=str(tmp_path)))
    with pytest.raises(CheckpointError, match="No such file"):
        ParameterServer(ServerConfig(resume=str(tmp_path / "missing.ckpt")))
    ckpt.save(tmp_path / "ok.ckpt", sample_checkpoint())
    with pytest.raises(ConfigError, match="not both"):
        ParameterServer(ServerConfig(resume=str(tmp_path / "ok.ckpt")), initial={"w": np.zeros(3, np.float32)})


async def test_a_learner_with_another_model_cannot_join_a_resumed_server(tmp_path):
    ckpt.save(tmp_path / "ok.ckpt", sample_checkpoint())
    from rudra_async.errors import RemoteError
    from rudra_async.layout import Layout

    async with run_server(resume=str(tmp_path / "ok.ckpt")) as ps:
        with pytest.raises(RemoteError) as info:
            await Client.connect(ps.addresses[0], Layout.from_shapes([("w", (5,))]))
        assert info.value.code == "layout_mismatch"


@pytest.mark.torch
def test_killed_server_resumes_from_its_checkpoint_and_the_learner_reconnects(tmp_path):
    """Real processes: a learner (--reconnect) trains against a server checkpointing every
    10 updates; the server is SIGKILLed; a new one resumes from the file; the same learner
    process reconnects and trains on until the new server's --max-updates; SIGTERM then
    writes the final checkpoint."""
    path = tmp_path / "run.ckpt"
    port = free_port()
    first = start_server(port, "--checkpoint", str(path), "--checkpoint-every", "10")
    learner = start_cli("learner", "--connect", f"tcp://127.0.0.1:{port}", "--reconnect", "60", "--json")
    second = None
    try:
        deadline = time.monotonic() + 60
        while not (path.exists() and ckpt.load(path).clock >= 30):
            assert time.monotonic() < deadline, "no checkpoint of update 30"
            assert learner.poll() is None, learner.communicate()
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # no final checkpoint: the periodic one must do
        first.communicate(timeout=30)
        state = ckpt.load(path)
        assert state.clock >= 30 and state.samples == state.clock * 32
        second = start_server(
            port, "--resume", str(path), "--checkpoint", str(path), "--max-updates", str(state.clock + 50)
        )
        out, err = learner.communicate(timeout=120)
        assert learner.returncode == 0, err
        assert last_json(out)["reconnects"] == 1
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 0, err
    finally:
        reap(first, learner, second)
    stats = last_json(err)
    assert stats["updates"] == state.clock + 50 and stats["checkpoint"]["clock"] == state.clock + 50
    final = ckpt.load(path)
    assert final.clock == state.clock + 50 and final.samples == final.clock * 32
    assert not np.array_equal(final.weights, state.weights)


@pytest.mark.torch
async def test_a_learner_without_reconnect_stops_with_a_clear_error_when_the_server_is_lost():
    async with run_server() as ps:
        learner = await asyncio.create_subprocess_exec(
            *CLI_ARGS,
            "learner",
            "--connect",
            ps.addresses[0],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=subprocess_env(),
        )
        try:
            deadline = time.monotonic() + 60
            while ps.clock < 20:
                assert time.monotonic() < deadline and learner.returncode is None
                await asyncio.sleep(0.05)
        except BaseException:
            learner.kill()
            raise
    _, err = await asyncio.wait_for(learner.communicate(), 60)  # the server is gone now
    assert learner.returncode == 2 and b"error: " in err and b"Traceback" not in err


async def test_resuming_with_another_lr_says_that_the_checkpoints_groups_are_used(tmp_path, caplog):
    """The checkpoint's parameter groups (their lr and weight decay) are restored: a --lr or
    --weight-decay given at --resume that differs is not used, and the server says so."""
    path = str(tmp_path / "run.ckpt")
    w0 = initial_weights(small_layout())
    async with run_server(lr=0.1, checkpoint=path) as ps:
        await push_sequence(ps.addresses[0], small_layout(), [np.ones(small_layout().size, np.float32)], w0)
    async with run_server(lr=0.1, resume=path):
        assert "parameter groups" not in caplog.text
    async with run_server(lr=0.05, weight_decay=0.01, resume=path) as ps:
        assert ps.core.groups[0].lr == 0.1
    assert (
        "parameter groups [[2, 0.1, 0.0]] ([tensors, lr, weight_decay]); --lr 0.05 --weight-decay 0.01 apply only"
        in caplog.text
    )


def test_a_save_deletes_the_temporaries_of_saves_killed_midway(tmp_path):
    """A save killed midway (SIGKILL) leaves its model-sized temporary; the next save of the
    same checkpoint deletes those no save holds locked, and keeps those of saves still writing."""
    path = tmp_path / "run.ckpt"
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f".run.ckpt.{dead.pid}.abc123_x.tmp"
    living = tmp_path / f".run.ckpt.{os.getppid()}.def456yz.tmp"  # another save, still writing: it holds its lock
    others = [  # other checkpoints' temporaries (run.ckpt.1000's, a save still writing), and stray names
        tmp_path / f".other.ckpt.{dead.pid}.ghi789_z.tmp",
        tmp_path / f".run.ckpt.1000.{os.getpid()}.jkl012ab.tmp",
        tmp_path / ".run.ckpt.99999999999999999999.abcdefgh.tmp",
        tmp_path / ".run.ckpt.\u00b2.abcdefgh.tmp",
    ]
    for f in (orphan, living, *others):
        f.write_bytes(b"partial")
    with open(living, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        ckpt.save(path, sample_checkpoint())
    assert not orphan.exists() and living.exists() and all(f.exists() for f in others)
    assert len(list(tmp_path.iterdir())) == 2 + len(others)
    assert ckpt.load(path).clock == sample_checkpoint().clock


def test_a_leftover_with_this_processs_pid_is_deleted(tmp_path):
    """A container's server has the same pid at every start: the temporary of a save of its
    previous start, killed midway, bears this process's pid, and is still deleted (no save
    holds its lock), while a temporary symlink of that name is left alone."""
    path = tmp_path / "run.ckpt"
    leftover = tmp_path / f".run.ckpt.{os.getpid()}.abcd1234.tmp"
    leftover.write_bytes(b"\0" * 1024)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / f".run.ckpt.{os.getpid()}.efgh5678.tmp"
    link.symlink_to(target)
    ckpt.save(path, sample_checkpoint())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([link.name, "run.ckpt", "target"])
    assert target.read_bytes() == b"keep"


def test_a_cleanup_that_deletes_a_new_temporary_before_its_lock_makes_the_save_start_again(tmp_path, monkeypatch):
    """The window between a temporary's creation and its lock: a cleanup that locks and
    deletes it there makes the save make another, and the save succeeds."""
    made = []
    real = ckpt.tempfile.mkstemp

    def mkstemp_then_cleanup(**kwargs):
        fd, name = real(**kwargs)
        made.append(name)
        if len(made) == 1:  # another save's cleanup, between this one's mkstemp and its flock
            ckpt._remove_orphans(str(tmp_path), ".run.ckpt.")
        return fd, name

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", mkstemp_then_cleanup)
    ckpt.save(tmp_path / "run.ckpt", sample_checkpoint())
    assert len(made) == 2 and os.listdir(tmp_path) == ["run.ckpt"]


def test_a_file_without_the_metadata_crc_of_earlier_versions_still_loads(tmp_path):
    state = sample_checkpoint()
    path = tmp_path / "old.ckpt"
    ckpt.save(path, state)
    back = ckpt.load(path)
    meta = {  # what earlier versions wrote: no meta_crc32
        "format": 1,
        "clock": state.clock,
        "layout": state.layout.to_wire(),
        "shard": [0, 1],
        "samples": state.samples,
        "crc32": [zlib.crc32(state.weights.data), zlib.crc32(state.momentum.data)],
        "saved_at": 0.0,
        "state": {},
        "info": {},
    }
    path.write_bytes(
        b"".join(bytes(b) for b in encode_frame(MsgType.CHECKPOINT, meta, [state.weights, state.momentum]))
    )
    old = ckpt.load(path)
    assert old.clock == back.clock == state.clock
    np.testing.assert_array_equal(old.weights, back.weights)


def write_raw(path, weights=None, meta_bytes=None, **fields):
    """A checkpoint file of the small layout with CRC-valid contents whatever ``fields`` say
    (``meta_bytes``: the metadata as given, not a map of ``fields``)."""
    layout = small_layout()
    w = np.ones(layout.size, np.float32) if weights is None else weights
    v = np.zeros(layout.size, np.float32)
    meta = {
        "format": 1,
        "clock": 7,
        "layout": layout.to_wire(),
        "shard": [0, 1],
        "samples": 0,
        "crc32": [zlib.crc32(w.data), zlib.crc32(v.data)],
        "saved_at": 0.0,
        "state": {"staleness": {}, "lr_policy": {}},
        "info": {},
        "seg": [["<f4", [layout.size]]] * 2,
        **fields,
    }
    meta["meta_crc32"] = zlib.crc32(msgpack.packb(meta, use_bin_type=True))
    packed = msgpack.packb(meta, use_bin_type=True) if meta_bytes is None else meta_bytes
    body = 0 if meta_bytes is not None else 2 * w.nbytes
    with open(path, "wb") as f:
        f.write(Header(MsgType.CHECKPOINT, 0, len(packed), body).pack() + packed)
        if meta_bytes is None:
            f.write(w.tobytes() + v.tobytes())


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"state": [1, 2]}, "'state': must be a map"),
        ({"clock": 2**63}, r"'clock' must be an integer in \[0, 2\^63-1\]"),
        ({"clock": 2**64 - 1}, "'clock' must be an integer"),
        ({"samples": 2**64 - 1}, "'samples' must be an integer"),
        ({"clock": 1.5}, "'clock' must be an integer"),
        ({"state": {"staleness": [1]}}, "histogram must be a map"),
        ({"state": {"staleness": {"1": float("inf")}}}, "count inf of staleness 1"),
        ({"state": {"staleness": {"1": 2**64 - 1}}}, "count 18446744073709551615"),
        ({"state": {"staleness": {"1": -3}}}, "count -3"),
        ({"state": {"staleness": {"1": "x"}}}, "count 'x'"),
        ({"state": {"staleness": {"1": True}}}, "count True"),
        ({"state": {"staleness": {"-5": 3}}}, "key '-5'"),
        ({"state": {"staleness": {"01": 3}}}, "key '01'"),
        ({"state": {"staleness": {"x": 3}}}, "key 'x'"),
        ({"state": {"staleness": {str(2**63): 3}}}, "key '9223372036854775808'"),
        ({"state": {"lr_policy": 5}}, "LR policy's state must be a map"),
        ({"state": {"lr_policy": {"recent": [float("inf")]}}}, "'recent' must be a list of ints"),
        ({"state": {"lr_policy": {"recent": [-1]}}}, "'recent' must be a list of ints"),
        ({"state": {"lr_policy": {"recent": 3}}}, "'recent' must be a list of ints"),
        ({"state": {"lr_policy": {"sum": float("inf"), "count": 1}}}, "'sum' must be an int"),
        ({"state": {"lr_policy": {"sum": 1, "count": float("nan")}}}, "'count' must be an int"),
        ({"state": {"lr_policy": {"sum": -1, "count": 1}}}, "'sum' must be an int"),
        ({"state": {"lr_policy": {"window": 2, "sum": 3, "count": 3, "recent": [1]}}}, "inconsistent"),
        ({"state": {"lr_policy": {"window": 2, "sum": 1, "count": 3, "recent": [1, 2]}}}, "inconsistent"),
        ({"state": {"lr_policy": {"window": 0, "count": 3}}}, "no 'sum' or 'count'"),
        ({"state": {"groups": 5}}, "groups: must be a non-empty list"),
        ({"state": {"groups": [[2, float("nan"), 0.0]]}}, "lr must be a finite number"),
        ({"state": {"groups": [[1, 0.1, 0.0]]}}, "cover 1 tensors; the layout has 2"),
    ],
)
def test_crc_valid_files_with_values_a_server_cannot_resume_from_are_refused(tmp_path, fields, message):
    path = tmp_path / "hostile.ckpt"
    write_raw(path, **fields)
    with pytest.raises(CheckpointError, match=message):
        ckpt.load(path)


@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_file_of_weights_that_are_not_finite_is_refused(tmp_path, value):
    weights = np.ones(small_layout().size, np.float32)
    weights[3] = value
    write_raw(tmp_path / "nan.ckpt", weights=weights)
    with pytest.raises(CheckpointError, match="not finite"):
        ckpt.load(tmp_path / "nan.ckpt")


def test_a_refused_file_leaves_the_server_as_it_was(tmp_path):
    """ServerCore.restore of what load returns cannot fail half-way: a bad file never gets
    that far, so restoring a good one afterwards works."""
    from rudra_async.server.core import ServerCore

    write_raw(tmp_path / "bad.ckpt", state={"staleness": {"1": "x"}})
    write_raw(tmp_path / "good.ckpt", state={"staleness": {"0": 2, "3": 1}, "lr_policy": {}})
    core = ServerCore(ServerConfig(kernel="numpy", lr_policy="mean-staleness"))
    with pytest.raises(CheckpointError):
        core.restore(ckpt.load(tmp_path / "bad.ckpt"))
    assert core.store is None
    core.restore(ckpt.load(tmp_path / "good.ckpt"))
    assert core.clock == 7 and core.staleness.to_dict() == {"0": 2, "3": 1}
    core.close()


def test_a_checkpoint_that_a_load_would_refuse_is_not_written(tmp_path):
    state = sample_checkpoint()
    state.state = {"staleness": {"1": -1}}
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*staleness histogram count -1"):
        ckpt.save(tmp_path / "run.ckpt", state)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "meta, message",
    [  # {"x": [{}, {}, ...]}: a byte per map; nested, so that no one list is long; a long string
        (b"\x81\xa1x\xdd" + (4 << 20).to_bytes(4, "big") + b"\x80" * (4 << 20), "lists and maps"),
        (b"\x81\xa1x\xdc\x10\x00" + (b"\xdc\x10\x00" + b"\x90" * 4096) * 512, "lists and maps"),
        (b"\x81\xa1x\xdb" + (2 << 20).to_bytes(4, "big") + b"a" * (2 << 20), "max_str_len"),
        (b"\x81\xa1x\xc6" + (2 << 20).to_bytes(4, "big") + b"a" * (2 << 20), "max_bin_len"),
        (b"\x81\xa1x\xd4\x01\x00", "max_ext_len"),
    ],
)
def test_metadata_that_would_decode_into_a_huge_object_graph_is_refused_early(tmp_path, meta, message):
    """A file of a few MiB whose metadata decodes into millions of objects: refused before
    they are all made (they would take ~100 times the file's size)."""
    path = tmp_path / "bomb.ckpt"
    write_raw(path, meta_bytes=meta)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=message):
            ckpt.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 150 << 20


def test_a_real_checkpoint_of_the_longest_window_and_a_large_layout_loads(tmp_path):
    """The bounds leave room for what a server writes: the longest mean-staleness window
    the settings allow (2^23 values; a longer one made every checkpoint fail), 10^4
    staleness histogram entries, 10^5 tensors."""
    from rudra_async.layout import Layout

    layout = Layout.from_shapes([(f"t{i}", (1, 1)) for i in range(100_000)])
    recent = [i % 1000 for i in range(MAX_WINDOW)]
    state = {
        "staleness": {str(s): 1 for s in range(10_000)},
        "lr_policy": {"window": len(recent), "sum": sum(recent), "count": len(recent), "recent": recent},
        "groups": [[1, 0.1, 0.0]] * len(layout.tensors),
    }
    zeros = np.zeros(layout.size, np.float32)
    ckpt.save(tmp_path / "big.ckpt", ckpt.Checkpoint(layout, 3, zeros, zeros, state=state))
    assert ckpt.load(tmp_path / "big.ckpt").state == state


def test_running_out_of_memory_for_the_arrays_is_a_checkpoint_error(tmp_path, monkeypatch):
    ckpt.save(tmp_path / "run.ckpt", sample_checkpoint())
    real = np.empty

    def empty(shape, *args, **kwargs):
        if shape in (small_layout().size, (small_layout().size,)):
            raise MemoryError("Unable to allocate 48 B for an array")  # as numpy's _ArrayMemoryError
        return real(shape, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(np, "empty", empty)
        with pytest.raises(CheckpointError, match="not enough memory"):
            ckpt.load(tmp_path / "run.ckpt")


def mean_staleness_checkpoint(path, window, sigmas):
    """A checkpoint of a server whose mean-staleness policy (``window``) observed ``sigmas``."""
    policy = MeanStaleness(window)
    for s in sigmas:
        policy.observe(s)
    state = sample_checkpoint()
    state.state = {"lr_policy": policy.state()}
    ckpt.save(path, state)
    return policy


@pytest.mark.parametrize(
    "written, resumed, mean",
    [
        (0, 0, 17 / 6),  # the same window: the same mean
        (3, 3, (7 + 1 + 3) / 3),
        (3, 0, 17 / 6),  # the whole run from a windowed run: its sum and count are the run's
        (3, 2, (1 + 3) / 2),  # a smaller window: its last values
        (5, 6, 17 / 6),  # a larger window the run has not filled yet
    ],
)
def test_mean_staleness_resumes_with_another_window_where_the_file_has_what_it_needs(tmp_path, written, resumed, mean):
    path = tmp_path / "run.ckpt"
    mean_staleness_checkpoint(path, written, [4, 0, 2, 7, 1])
    policy = MeanStaleness(resumed)
    policy.load_state(ckpt.load(path).state["lr_policy"])
    policy.observe(3)
    assert policy.mean == pytest.approx(mean)


@pytest.mark.parametrize(
    "written, resumed, message",
    [
        (0, 3, "keeps the last 0 of the run's 5 staleness values .* resume with --mean-staleness-window 0$"),
        (
            2,
            3,
            "keeps the last 2 of the run's 5 .* needs the last 3: resume with --mean-staleness-window 0 or at most 2",
        ),
    ],
)
def test_mean_staleness_refuses_a_window_the_file_cannot_fill(tmp_path, written, resumed, message):
    path = tmp_path / "run.ckpt"
    mean_staleness_checkpoint(path, written, [4, 0, 2, 7, 1])
    with pytest.raises(ValueError, match=message):
        MeanStaleness(resumed).load_state(ckpt.load(path).state["lr_policy"])


@pytest.mark.parametrize(
    "old, resumed, mean",
    [
        ({"sum": 14, "count": 5, "recent": []}, 0, 17 / 6),  # written without a window
        ({"sum": 8, "count": 3, "recent": [0, 7, 1]}, 3, (7 + 1 + 3) / 3),  # with a window of 3
        ({"sum": 8, "count": 3, "recent": [0, 7, 1]}, 5, (0 + 7 + 1 + 3) / 4),  # a larger one: all it has
        ({"sum": 0, "count": 0, "recent": []}, 4, 3.0),
        ({}, 0, 3.0),
    ],
)
def test_mean_staleness_states_of_earlier_versions_still_load(old, resumed, mean):
    policy = MeanStaleness(resumed)
    policy.load_state(old)
    policy.observe(3)
    assert policy.mean == pytest.approx(mean)


def test_mean_staleness_refuses_the_whole_run_from_a_windowed_state_of_an_earlier_version():
    with pytest.raises(ValueError, match="keeps only the window's staleness values"):
        MeanStaleness(0).load_state({"sum": 8, "count": 3, "recent": [0, 7, 1]})


def test_a_server_resumed_with_a_window_the_checkpoint_cannot_fill_refuses_to_start(tmp_path):
    path = tmp_path / "run.ckpt"
    mean_staleness_checkpoint(path, 0, [4, 0, 2, 7, 1])
    config = dict(listen=["tcp://127.0.0.1:0"], resume=str(path), lr_policy="mean-staleness", kernel="numpy")
    with pytest.raises(CheckpointError, match="resume with --mean-staleness-window 0"):
        ParameterServer(ServerConfig(**config, mean_staleness_window=3))
    ps = ParameterServer(ServerConfig(**config))
    assert ps.core.lr_policy.mean == pytest.approx(14 / 5)
    ps.core.close()

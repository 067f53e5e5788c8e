"""Checkpoints: the file format refuses anything incomplete, and a server resumed from a
checkpoint continues exactly where the checkpointed one was (weights, momentum, clock)."""

import asyncio
import concurrent.futures
import os
import shutil
import signal
import subprocess
import time
import zlib

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
from rudra_async.server.checkpointer import Checkpointer
from rudra_async.wire import MsgType, encode_frame

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
    same checkpoint deletes those of processes that are gone, and keeps those of living ones."""
    path = tmp_path / "run.ckpt"
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f".run.ckpt.{dead.pid}.abc123_x.tmp"
    living = tmp_path / f".run.ckpt.{os.getppid()}.def456yz.tmp"  # another save, still running
    others = [  # other checkpoints' temporaries (run.ckpt.1000's, a save still writing), and stray names
        tmp_path / f".other.ckpt.{dead.pid}.ghi789_z.tmp",
        tmp_path / f".run.ckpt.1000.{os.getpid()}.jkl012ab.tmp",
        tmp_path / ".run.ckpt.99999999999999999999.abcdefgh.tmp",
        tmp_path / ".run.ckpt.\u00b2.abcdefgh.tmp",
    ]
    for f in (orphan, living, *others):
        f.write_bytes(b"partial")
    ckpt.save(path, sample_checkpoint())
    assert not orphan.exists() and living.exists() and all(f.exists() for f in others)
    assert len(list(tmp_path.iterdir())) == 2 + len(others)
    assert ckpt.load(path).clock == sample_checkpoint().clock


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

"""Checkpoints written while the server trains: one at a time and in order, a cancelled one
keeping its lease on the weights until its thread is done, and ``--resume`` naming each
shard's file as ``--checkpoint`` does. Real servers on loopback, a numpy learner."""

import asyncio
import threading
import time

import numpy as np
import pytest
from helpers import initial_weights, run_server, small_layout

from rudra_async import checkpoint
from rudra_async.client import connect
from rudra_async.config import ServerConfig
from rudra_async.layout import Shard
from rudra_async.server import ParameterServer


def slow_first_save(monkeypatch) -> threading.Event:
    """The next checkpoint.save takes 0.3 s longer (a slow disk); the event is set once it is done."""
    done, real, calls = threading.Event(), checkpoint.save, []

    def save(path, snapshot, *args):
        calls.append(path)
        if len(calls) > 1:
            real(path, snapshot, *args)
            return
        time.sleep(0.3)
        real(path, snapshot, *args)
        done.set()

    monkeypatch.setattr(checkpoint, "save", save)
    return done


async def train(client, steps: int, w):
    grad = np.full(client.layout.size, 0.01, np.float32)
    for _ in range(steps):
        w = await client.push_pull(grad, w.timestamp)
    return w


async def test_a_cancelled_checkpoint_keeps_its_lease_until_its_thread_is_done(tmp_path, monkeypatch):
    """Cancelling ``checkpoint()`` while its thread writes the file returns only once the thread
    no longer reads the weights, so updates after the cancellation cannot reach the file: it
    holds the weights of its clock, whole."""
    done = slow_first_save(monkeypatch)
    layout, path = small_layout(), str(tmp_path / "manual.ckpt")
    async with run_server(kernel="numpy", momentum=0.0) as ps:
        client = await connect(ps.addresses[0], layout, initial_weights(layout))
        w = await train(client, 3, await client.pull())
        clock, weights = ps.clock, ps.core.store.weights.copy()
        saving = asyncio.ensure_future(ps.checkpoint(path))
        await asyncio.sleep(0.05)
        saving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await saving
        assert done.is_set(), "checkpoint() returned while its thread still read the leased weights"
        await train(client, 5, w)
        await client.close()
    saved = checkpoint.load(path)
    assert saved.clock == clock and np.array_equal(saved.weights, weights)


async def test_checkpoints_land_in_the_order_they_were_asked_for(tmp_path, monkeypatch):
    """A checkpoint asked for while an earlier one is still being written is written after it,
    so the file ends with the later clock (the final checkpoint at close included)."""
    slow_first_save(monkeypatch)
    layout, path = small_layout(), str(tmp_path / "run.ckpt")
    async with run_server(kernel="numpy", checkpoint=path) as ps:
        client = await connect(ps.addresses[0], layout, initial_weights(layout))
        w = await train(client, 2, await client.pull())
        first = asyncio.ensure_future(ps.checkpoint())
        await asyncio.sleep(0.05)
        await train(client, 3, w)
        second = await ps.checkpoint()
        assert await first == 2 and second == 5
        assert checkpoint.load(path).clock == 5 and ps.stats()["checkpoint"]["clock"] == 5
        await client.close()


async def test_resume_names_each_shards_file_as_checkpoint_does(tmp_path):
    """``{shard}`` in ``--resume`` becomes the shard's index, as in ``--checkpoint``."""
    layout, pattern = small_layout(), str(tmp_path / "group-{shard}.ckpt")
    shard = Shard(1, 2)
    part = initial_weights(layout)[slice(*shard.range(layout.size))]
    config = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", shard=shard, checkpoint=pattern)
    async with ParameterServer(config, initial={"w": np.zeros((3, 4), np.float32), "b": np.zeros(4, np.float32)}):
        pass  # written at close: group-1.ckpt
    assert (tmp_path / "group-1.ckpt").exists() and not (tmp_path / "group-{shard}.ckpt").exists()
    resumed = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", shard=shard, resume=pattern)
    async with ParameterServer(resumed) as ps:
        assert ps.core.store is not None and ps.core.store.weights.shape == part.shape

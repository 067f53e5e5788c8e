"""What an attacker or a stray client met (issue "what an attacker and a cluster user hit"),
each reproduced against a real server: a client that pulls but never pushes, the handshake as
an offline guessing oracle, weak secrets, a flood of idle connections, an insider's huge
push, a first hello that takes the model, a full disk, metrics open to the network."""

import asyncio
import os
import re
import time

import numpy as np
import pytest
from helpers import initial_weights, read_frame, run_cli, run_server, small_layout

from rudra_async import checkpoint as ckpt
from rudra_async import security
from rudra_async.client import Client
from rudra_async.config import ServerConfig
from rudra_async.errors import CheckpointError, ConfigError, ConnectError, RemoteError, ServerBusy
from rudra_async.layout import Layout
from rudra_async.monitor.view import fetch
from rudra_async.server import ParameterServer
from rudra_async.wire import MsgType, encode_frame

LAYOUT = small_layout()
SECRET = "4f9c2b7e1a8d3c6f0e5b9a2d7c4f1e8b"


def raw(msg_type, meta, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta, arrays))


async def honest_learner(url, stop, counts, **kwargs):
    client = await Client.connect(url, LAYOUT, initial_weights(LAYOUT), **kwargs)
    w = await client.pull()
    while not stop.is_set():
        w = await client.push_pull(np.full(LAYOUT.size, 1e-3, np.float32), w.timestamp)
        counts.append(1)
    await client.close()


async def puller(url, stop, every, **kwargs):
    client = await Client.connect(url, LAYOUT, **kwargs)
    while not stop.is_set():
        await client.pull()
        await asyncio.sleep(every)
    await client.close()


async def rounds_with(puller_kwargs, seconds=2.5, **server):
    """Updates a hardsync server makes in ``seconds`` with two honest learners and a client
    that pulls every 0.2 s and never pushes; and its evictions."""
    async with run_server(kernel="numpy", protocol="hardsync", **server) as ps:
        stop, counts = asyncio.Event(), []
        url = ps.addresses[0]
        first = asyncio.create_task(honest_learner(url, stop, counts))
        await asyncio.sleep(0.2)
        tasks = [first, asyncio.create_task(honest_learner(url, stop, counts))]
        await asyncio.sleep(0.3)
        tasks.append(asyncio.create_task(puller(url, stop, 0.2, **puller_kwargs)))
        await asyncio.sleep(seconds)
        updates, evictions = ps.clock, ps.stats()["evictions"]
        stop.set()
        ps.core.stop_at(ps.clock + 1)  # release a round that waits, so that the learners can end
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        return updates, evictions


async def test_a_client_that_pulls_and_never_pushes_is_evicted_and_a_reader_never_joins():
    """It used to stall hardsync forever (each pull counted as activity and rejoined it):
    1.2 updates/s with a pull a second, 0 evictions."""
    updates, evictions = await rounds_with({}, learner_timeout=0.5)
    assert evictions >= 1 and updates > 100, (updates, evictions)
    updates, evictions = await rounds_with({"reader": True})  # no --learner-timeout needed
    assert evictions == 0 and updates > 100, (updates, evictions)


async def test_a_reader_cannot_push_and_holds_no_index():
    async with run_server(kernel="numpy", protocol="hardsync") as ps:
        learner = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        reader = await Client.connect(ps.addresses[0], LAYOUT, reader=True)
        assert (reader.index, learner.index, learner.learners) == (-1, 0, 1)
        with pytest.raises(RemoteError) as info:
            await reader.push(np.zeros(LAYOUT.size, np.float32), 0)
        assert info.value.code == "read_only" and ps.clock == 0
        await reader.close()
        await learner.close()


async def test_the_handshake_gives_nothing_to_test_a_guess_against_before_the_peer_proves():
    async with run_server(kernel="numpy", secret=SECRET) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(raw(MsgType.AUTH, {"nonce": security.new_nonce(), "seq": 1}))
        challenge = await read_frame(reader)
        assert challenge.msg_type == MsgType.CHALLENGE and set(challenge.meta) == {"nonce", "seq"}
        writer.close()  # abandoned after the challenge: counted
        deadline = time.monotonic() + 5
        while not ps.core.rejected["auth_abandoned"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert ps.core.rejected["auth_abandoned"] == 1
        client = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT), secret=SECRET)
        await client.close()  # the server proves itself once the learner has


def test_weak_secrets_are_refused_with_the_reason_and_the_secret_command_writes_a_strong_one(tmp_path):
    for weak, reason in [
        ("short", "at least 16 are needed"),
        ("summer2026summer", "'summe' comes back|comes back in it"),
        ("ab" * 20, "only 2 different characters"),
    ]:
        with pytest.raises(ConfigError, match=reason):
            ParameterServer(ServerConfig(kernel="numpy"), secret=weak)
    path = tmp_path / "secret"
    proc = run_cli("secret", str(path))
    assert proc.returncode == 0, proc.stderr
    assert path.stat().st_mode & 0o777 == 0o600 and security.load_secret(str(path)) is not None
    again = run_cli("secret", str(path))
    assert again.returncode == 2 and "never overwritten" in again.stderr


async def test_a_flood_of_idle_connections_closes_them_and_not_a_learner_in_its_handshake():
    """Past --max-unauthenticated a new connection used to close the oldest connection without
    hello, a learner in the middle of its handshake as well as any: now the least advanced go
    first (told why: ERROR evicted), and a full server says so (ServerBusy), which a learner
    with reconnect tries again."""
    async with run_server(kernel="numpy", secret=SECRET, max_unauthenticated=4) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))  # a learner that has begun
        nonce = security.new_nonce()
        writer.write(raw(MsgType.AUTH, {"nonce": nonce}))
        challenge = await read_frame(reader)
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(8)]  # the flood
        await asyncio.sleep(0.2)
        writer.write(
            raw(MsgType.PROOF, {"proof": security.client_proof(SECRET.encode(), nonce, challenge.meta["nonce"])})
        )
        assert (await read_frame(reader)).msg_type == MsgType.AUTHENTICATED  # still there
        evicted = await read_frame(idle[0][0])  # the oldest idle one was told why it goes
        assert evicted.meta["code"] == "evicted" and evicted.meta["fatal"] is True
        assert ps.core.rejected["evicted"] >= 4
        for _, w in [*idle, (reader, writer)]:
            w.close()
    async with run_server(kernel="numpy", max_connections=3) as ps:
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        crowd = [await asyncio.open_connection(host, int(port)) for _ in range(3)]  # the server is full
        with pytest.raises(ServerBusy) as info:
            await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        assert info.value.reason == "too_many_connections" and "--max-connections" in str(info.value)
        crowd.pop()[1].close()  # room again: a learner that tries again gets in
        await asyncio.sleep(0.2)
        client = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        await client.close()
        for _, w in crowd:
            w.close()


async def test_a_gradient_far_outside_the_runs_history_is_refused_and_checkpoints_keep_the_one_before(tmp_path):
    """One insider push of float16's largest finite value took the weights from 0.978 to
    0.114 accuracy, and the next periodic checkpoint overwrote the last good model."""
    path = tmp_path / "run.ckpt"
    async with run_server(kernel="numpy", checkpoint=str(path), checkpoint_every=10, momentum=0.9) as ps:
        client = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
        w = await client.pull()
        rng = np.random.default_rng(0)
        for _ in range(40):
            w = await client.push_pull(rng.standard_normal(LAYOUT.size).astype(np.float32) * 0.1, w.timestamp)
        before = ps.weights()
        for huge in (65504.0, 1e30):
            with pytest.raises(RemoteError) as info:
                await client.push_pull(np.full(LAYOUT.size, huge, np.float32), w.timestamp)
            assert info.value.code == "gradient_outlier"
        assert all(np.array_equal(before[k], v) for k, v in ps.weights().items())
        for _ in range(5):  # the run goes on; normal gradients are still taken
            w = await client.push_pull(rng.standard_normal(LAYOUT.size).astype(np.float32) * 0.1, w.timestamp)
        await client.close()
    newest, previous = ckpt.load(path), ckpt.load(f"{path}.1")
    assert newest.clock == 45 and 10 <= previous.clock < 45  # a periodic one (one at a time: a slow disk skips some)
    assert not (tmp_path / "run.ckpt.2").exists()  # --checkpoint-keep 2: the newest and the one before


async def test_a_first_hello_cannot_take_the_model_with_huge_names_or_hold_unbounded_memory():
    async with run_server(kernel="numpy", max_model_bytes=1 << 20) as ps:
        with pytest.raises(RemoteError) as info:
            await Client.connect(ps.addresses[0], Layout.from_shapes([("w" * 900_000, (4,))]), np.zeros(4, np.float32))
        assert info.value.code == "bad_layout" and ps.core.store is None
        host, port = ps.addresses[0].removeprefix("tcp://").rsplit(":", 1)
        meta = {"layout": [["w", [1 << 18]]], "seg": [["<f4", [1 << 18]]]}
        frame = raw(MsgType.HELLO, meta, [np.zeros(1 << 18, np.float32)])
        slow = []
        for _ in range(3):  # each announces 1 MiB of initial weights and sends a little of it
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(frame[: len(frame) - (1 << 19)])
            slow.append((reader, writer))
        await asyncio.sleep(0.3)
        assert ps.initial_bytes.taken <= 2 << 20  # at most twice --max-model-bytes, whoever asks
        refused = await read_frame(slow[2][0])
        assert refused.meta["code"] == "frame_too_large" and "other connections" in refused.meta["message"]
        for _, w in slow:
            w.close()


async def test_a_full_disk_at_the_final_checkpoint_leaves_the_model_elsewhere_and_says_where(tmp_path, monkeypatch):
    real = ckpt.save

    def full_disk(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise CheckpointError(f"cannot write checkpoint {path}: No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "save", full_disk)
    ps = ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", checkpoint=str(tmp_path / "c")))
    await ps.start()
    client = await Client.connect(ps.addresses[0], LAYOUT, initial_weights(LAYOUT))
    w = await client.pull()
    await client.push_pull(np.ones(LAYOUT.size, np.float32), w.timestamp)
    await client.close()
    with pytest.raises(CheckpointError, match=r"the model was written to (.*) instead") as info:
        await ps.close()
    rescue = re.search("written to (.*) instead", str(info.value)).group(1)
    try:
        assert ckpt.load(rescue).clock == 1
    finally:
        os.unlink(rescue)


async def test_metrics_beyond_loopback_need_a_token_or_an_explicit_insecure(tmp_path):
    with pytest.raises(ConfigError, match="--metrics-token-file"):
        ServerConfig(metrics="0.0.0.0:0").validate()
    ServerConfig(metrics="0.0.0.0:0", metrics_insecure=True).validate()
    token = tmp_path / "token"
    token.write_text(SECRET)
    async with run_server(kernel="numpy", metrics="127.0.0.1:0", metrics_token_file=str(token)) as ps:
        url = ps.monitor.url + "/status.json"
        with pytest.raises(ConnectError, match="401"):
            await asyncio.to_thread(fetch, url)
        assert (await asyncio.to_thread(fetch, url, 5.0, SECRET.encode()))["updates"] == 0

"""What an attacker or a stray client met (issue "what an attacker and a cluster user hit"),
each reproduced against a real server: a client that pulls but never pushes, the handshake as
an offline guessing oracle, weak secrets."""

import asyncio
import time

import numpy as np
import pytest
from helpers import initial_weights, read_frame, run_cli, run_server, small_layout

from rudra_async import security
from rudra_async.client import Client
from rudra_async.config import ServerConfig
from rudra_async.errors import ConfigError, RemoteError
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

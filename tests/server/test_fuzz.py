"""Fuzzing the server as an attacker would, while two honest learners train.

Hostile byte streams are mutations of a recorded honest session (bit flips, truncations,
length fields set to extremes, replays, garbage, spliced and retyped frames, random
segment descriptors) sent over slow, half-open, non-reading and ordinary connections. With
a secret (phase A, hardsync) the server must not crash, the honest learners must finish
with weights bit-identical to a run without the attack, and the server's peak RSS must stay
within 10% + 50 MB of that run. Without a secret (phase B, an insider: async, fuzzed frames
may say hello and push) the server must not crash, the learners finish and the model stays
finite. ``RUDRA_FUZZ_CASES`` sets the number of cases of phase A (default 10,000); the slow
test runs 200,000.
"""

import asyncio
import os
import signal
import struct
import subprocess
import time

import msgpack
import numpy as np
import pytest
from helpers import CLI_ARGS, free_port, reap, rss_mb, subprocess_env, wait_listening

from rudra_async import security
from rudra_async.client import Client
from rudra_async.layout import Layout
from rudra_async.wire import HEADER, MsgType, encode_frame

LAYOUT = Layout.from_shapes([("w", (40, 25)), ("b", (25,))])
SECRET = "fuzz-secret-" + "0123456789abcdef"
STEPS = 60
CASES = int(os.environ.get("RUDRA_FUZZ_CASES", "10000"))
WORKERS = 32
EXTREMES = [0, 1, 1023, 1 << 16, (1 << 20) + 1, 1 << 32, 1 << 33, (1 << 63) - 1, (1 << 64) - 1]
DTYPES = ["<f4", "<f2", "<f8", "|u1", "<i8", "|b1", ">f4", "xx", 7]


def frame(msg_type, meta, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta, arrays))


def gradient(learner, step, w):
    """Deterministic: the same weights give the same gradient in every run."""
    noise = np.random.default_rng([learner, step]).standard_normal(LAYOUT.size).astype(np.float32)
    return (w - np.float32(0.5 + learner)) + np.float32(0.01) * noise


async def honest(url, learner, secret, pace):
    initial = np.linspace(-1, 1, LAYOUT.size, dtype=np.float32)
    client = await Client.connect(url, LAYOUT, initial, secret=secret, name=f"honest-{learner}", timeout=30)
    w = await client.pull()
    for step in range(STEPS):
        await pace(step)
        w = await client.push_pull(gradient(learner, step, w.array), w.timestamp, step=step, samples=8)
    weights = w.array.copy()
    await client.close()
    return weights


def recorded_session(handshake):
    """The bytes of an honest learner's session: the handshake given, then HELLO, PUSH, PULL, BYE."""
    w = np.linspace(-1, 1, LAYOUT.size, dtype=np.float32)
    return [
        *handshake,
        frame(MsgType.HELLO, {"name": "x", "layout": LAYOUT.to_wire(), "seq": 0}, [w]),
        frame(MsgType.PUSH, {"learner_id": 0, "timestamp": 0, "step": 0, "samples": 8, "pull": True, "seq": 1}, [w]),
        frame(MsgType.PUSH, {"timestamp": 0, "samples": 8, "seq": 2}, [w.astype(np.float16)]),
        frame(MsgType.PULL, {"newer_than": -1, "seq": 3}),
        frame(MsgType.BYE, {"reason": "done", "seq": 4}),
    ]


def mutate(rng, frames):
    kind = rng.integers(9)
    data = b"".join(frames)
    if kind == 0:  # bit flips
        b = bytearray(data)
        for _ in range(rng.integers(1, 9)):
            i = rng.integers(len(b))
            b[i] ^= 1 << rng.integers(8)
        return bytes(b)
    if kind == 1:  # truncation
        return data[: rng.integers(0, len(data))]
    if kind == 2:  # a length field set to an extreme
        i = rng.integers(len(frames))
        f = bytearray(frames[i])
        struct.pack_into("<Q", f, 8 + 8 * int(rng.integers(2)), EXTREMES[rng.integers(len(EXTREMES))])
        return b"".join(frames[:i]) + bytes(f) + b"".join(frames[i + 1 :])
    if kind == 3:  # replay
        return data
    if kind == 4:  # garbage, sometimes behind a valid magic
        junk = rng.bytes(int(rng.integers(1, 4096)))
        return (b"RDRA\x01" + junk) if rng.random() < 0.5 else junk
    if kind == 5:  # frames spliced and repeated
        return b"".join(frames[j] for j in rng.integers(len(frames), size=rng.integers(1, 12)))
    if kind == 6:  # a frame retyped
        i = rng.integers(len(frames))
        f = bytearray(frames[i])
        f[5] = int(rng.integers(256))
        return b"".join(frames[:i]) + bytes(f)
    if kind == 7:  # random metadata and segment descriptors
        meta = {
            "seg": [[DTYPES[rng.integers(len(DTYPES))], [int(x) for x in rng.integers(-2, 5000, rng.integers(0, 70))]]],
            "timestamp": [-1, 0, 2**63 - 1][rng.integers(3)],
            "samples": [0, 2**64 - 1, -5][rng.integers(3)],
            "layout": [["w", [int(x) for x in rng.integers(0, 2**40, rng.integers(0, 40))]]],
            "nonce": rng.bytes(int(rng.integers(0, 64))),
        }
        body = rng.bytes(int(rng.integers(0, 512)))
        head = HEADER.pack(b"RDRA", 1, int(rng.integers(1, 14)), 0, 0, len(body))
        packed = msgpack.packb(meta, use_bin_type=True)
        return head[:8] + struct.pack("<QQ", len(packed), len(body)) + packed + body
    return b"".join(frames) * int(rng.integers(2, 5))  # a burst, never read


async def attack_one(port, rng, frames):
    data = mutate(rng, frames)
    style = rng.integers(20)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    except (OSError, asyncio.TimeoutError):
        return
    try:
        if style == 0:  # slow: a few bytes at a time
            for i in range(0, min(len(data), 64), 8):
                writer.write(data[i : i + 8])
                await asyncio.sleep(0.01)
        else:
            writer.write(data)
        if style == 1 and writer.can_write_eof():  # half-open
            writer.write_eof()
        await asyncio.wait_for(writer.drain(), 2)
        if style < 5:  # sometimes read what comes back
            await asyncio.wait_for(reader.read(1 << 16), 0.1)
    except (OSError, RuntimeError, asyncio.TimeoutError):  # uvloop: RuntimeError writing to a closed transport
        pass
    finally:
        await closed(writer)


async def closed(writer):
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1)
    except (OSError, asyncio.TimeoutError):
        pass


async def attack(port, cases, seed, frames, done):
    rng = np.random.default_rng(seed)
    seeds = rng.integers(2**63, size=WORKERS)

    async def worker(k):
        wrng = np.random.default_rng(seeds[k])
        while done[0] < cases:
            done[0] += 1
            await attack_one(port, wrng, frames)

    await asyncio.gather(*(worker(k) for k in range(WORKERS)))


async def record_handshake(port, secret):
    """AUTH and PROOF of a real, successful handshake (the connection then goes without hello)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    nonce = security.new_nonce()
    auth = frame(MsgType.AUTH, {"nonce": nonce, "seq": 0})
    writer.write(auth)
    from helpers import read_frame

    challenge = await read_frame(reader)
    proof = frame(MsgType.PROOF, {"proof": security.client_proof(secret, nonce, challenge.meta["nonce"]), "seq": 1})
    writer.write(proof)
    assert (await read_frame(reader)).msg_type == MsgType.AUTHENTICATED
    await closed(writer)
    return [auth, proof]


async def run_phase(tmp_path, cases, *, secret, protocol, seed=1):
    """One server process, two honest learners, ``cases`` hostile streams; returns
    (final weights of learner 0, the server's peak RSS in MB, its stderr, seconds)."""
    port = free_port()
    args = ["--kernel", "numpy", "--protocol", protocol, "--lr", "0.05", "--handshake-timeout", "2"]
    if secret:
        (tmp_path / "secret").write_text(SECRET)
        (tmp_path / "secret").chmod(0o600)
        args += ["--secret-file", str(tmp_path / "secret")]
    log = open(tmp_path / f"server-{port}.log", "w+")  # noqa: SIM115 (a pipe could fill up and stall the server)
    server = subprocess.Popen(
        [*CLI_ARGS, "server", "--listen", f"tcp://127.0.0.1:{port}", *args], stderr=log, env=subprocess_env()
    )
    wait_listening(port)
    url = f"tcp://127.0.0.1:{port}"
    try:

        async def main():
            done = [0]

            async def pace(step):  # spread the honest steps over the attack
                while cases and done[0] < cases * step / STEPS:
                    await asyncio.sleep(0.005)

            learners = [asyncio.ensure_future(honest(url, i, SECRET if secret else None, pace)) for i in range(2)]
            started = time.monotonic()
            try:
                if cases:
                    handshake = await record_handshake(port, SECRET.encode()) if secret else []
                    await attack(port, cases, seed, recorded_session(handshake), done)
            except BaseException:
                for task in learners:
                    task.cancel()
                raise
            weights = await asyncio.wait_for(asyncio.gather(*learners), 600)
            return weights[0], time.monotonic() - started

        weights, seconds = await main()
        peak = rss_mb(server.pid, "VmHWM")
        assert server.poll() is None, "the server died"
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        log.seek(0)
        err = log.read()
        assert server.returncode == 0, err[-3000:]
        faults = [line for line in err.splitlines() if "Traceback" in line or " ERROR " in line or " CRITICAL " in line]
        assert not faults, faults[:5]  # refusals are WARNINGs; anything worse is a fault of the server
        return weights, peak, err, seconds
    finally:
        reap(server)
        log.close()


async def check_hardsync_fuzz(tmp_path, cases):
    clean, clean_rss, _, _ = await run_phase(tmp_path, 0, secret=True, protocol="hardsync")
    attacked, attacked_rss, err, seconds = await run_phase(tmp_path, cases, secret=True, protocol="hardsync")
    print(
        f"\nphase A: {cases} hostile streams in {seconds:.1f} s; server peak RSS {clean_rss:.0f} MB without, "
        f"{attacked_rss:.0f} MB with the attack"
    )
    np.testing.assert_array_equal(attacked, clean)  # bit for bit
    assert attacked_rss <= clean_rss * 1.1 + 50
    assert "refused [auth_required]" in err or "refused [bad_magic]" in err


async def test_fuzz_hardsync_with_a_secret_changes_nothing(tmp_path):
    await check_hardsync_fuzz(tmp_path, CASES)


async def test_fuzz_an_insider_without_a_secret_cannot_crash_the_server_or_break_the_model(tmp_path):
    cases = max(2000, CASES // 2)
    weights, rss, _, seconds = await run_phase(tmp_path, cases, secret=False, protocol="async", seed=2)
    print(f"\nphase B: {cases} hostile streams in {seconds:.1f} s; server peak RSS {rss:.0f} MB")
    assert np.isfinite(weights).all()


@pytest.mark.slow
@pytest.mark.timeout(3600)
async def test_fuzz_long_run(tmp_path):
    await check_hardsync_fuzz(tmp_path, 200_000)

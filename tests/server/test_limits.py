"""Limits on peers that have not authenticated and said hello: caps from the first byte,
memory that follows the bytes actually sent and is freed at once, deadlines, connection
counts; hung learners evicted from a hardsync round."""

import asyncio
import gc
import signal
import sys
import textwrap
import weakref

import msgpack
import numpy as np
import pytest
from helpers import free_port, initial_weights, read_frame, reap, rss_mb, run_server, start_server, subprocess_env

from rudra_async.bodies import BodyBudget
from rudra_async.client import Client
from rudra_async.layout import Layout
from rudra_async.wire import HEADER, MAGIC, BufferPool, MsgType, encode_frame

MiB = 1 << 20


def header(msg_type, meta_len, body_len):
    return HEADER.pack(MAGIC, 1, int(msg_type), 0, meta_len, body_len)


def oversize(msg_type, body_len, sent=MiB):
    """A frame announcing ``body_len`` bytes of body, of which ``sent`` follow at once."""
    meta = msgpack.packb({"timestamp": 0, "layout": [["w", [body_len // 4]]], "seg": [["<f4", [body_len // 4]]]})
    return header(msg_type, len(meta), body_len) + meta + bytes(sent)


async def train(url, layout, steps, initial=None, **kw):
    client = await Client.connect(url, layout, initial, timeout=10, **kw)
    w = await client.pull()
    for _ in range(steps):
        w = await client.push_pull(np.full(layout.size, 0.01, np.float32), w.timestamp)
    await client.close()
    return w.timestamp


async def first_packet(port, data):
    """Connect and send ``data`` at once (it arrives with the connection); the reply, if any."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await read_frame(reader, timeout=10)
    except (EOFError, ConnectionError):
        return None
    finally:
        writer.close()


async def test_oversize_frames_in_the_first_packet_are_refused_before_and_after_the_model_exists():
    port = free_port()
    server = start_server(port, "--kernel", "numpy", "--max-model-bytes", str(64 * MiB))
    try:
        base = rss_mb(server.pid)
        before = [
            oversize(MsgType.PUSH, 256 * MiB),  # anything but HELLO before hello: 64 KiB at most
            oversize(MsgType.HELLO, 8 << 30),  # initial weights over --max-model-bytes
            oversize(MsgType.PULL, 1 << 40),
        ]
        for data in before * 4:
            reply = await first_packet(port, data)
            assert reply is not None and reply.meta["code"] == "frame_too_large" and reply.meta["fatal"]
        layout = Layout.from_shapes([("w", (1000,))])
        assert await train(f"tcp://127.0.0.1:{port}", layout, 2, initial_weights(layout)) == 2  # the model exists
        after = [oversize(MsgType.HELLO, 256 * MiB), oversize(MsgType.PUSH, 1 << 33)]
        for data in after * 4:
            reply = await first_packet(port, data)
            assert reply is not None and reply.meta["code"] == "frame_too_large"
        assert rss_mb(server.pid, "VmHWM") - base < 100
        assert await train(f"tcp://127.0.0.1:{port}", layout, 2) == 4
    finally:
        reap(server)


async def test_a_secret_server_refuses_everything_in_the_first_packet():
    async with run_server(kernel="numpy", secret="4f9c2b7e1a8d3c6f0e5b9a2d7c4f1e8b") as ps:
        port = int(ps.addresses[0].rsplit(":", 1)[1])
        for data in (oversize(MsgType.HELLO, 256 * MiB), oversize(MsgType.PUSH, 8 << 30)):
            reply = await first_packet(port, data)
            assert reply.meta["code"] == "auth_required" and reply.meta["fatal"]
        assert ps.core.store is None


async def test_buffers_are_freed_when_a_connection_closes_without_the_cycle_collector(monkeypatch):
    taken = []
    original = BufferPool.take

    def tracking(self, nbytes):
        buf = original(self, nbytes)
        taken.append(weakref.ref(buf))
        return buf

    original_lease = BodyBudget.take

    def tracking_lease(self, nbytes, *, force=False):
        lease = original_lease(self, nbytes, force=force)
        if lease is not None:
            taken.append(weakref.ref(lease.buffer))
        return lease

    monkeypatch.setattr(BufferPool, "take", tracking)
    monkeypatch.setattr(BodyBudget, "take", tracking_lease)
    layout = Layout.from_shapes([("w", (4 * MiB,))])  # 16 MiB of weights
    gc.collect()
    gc.disable()
    try:
        async with run_server(kernel="numpy", momentum=0.0) as ps:
            port = int(ps.addresses[0].rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            hello = encode_frame(MsgType.HELLO, {"layout": layout.to_wire()}, [initial_weights(layout)])
            push = encode_frame(MsgType.PUSH, {"timestamp": 0}, [np.zeros(layout.size, np.float32)])
            for frame in (hello, push):
                writer.writelines([bytes(p) for p in frame])
                assert (await read_frame(reader)).msg_type in (MsgType.WELCOME, MsgType.ACK)
            writer.write(oversize(MsgType.PUSH, 8 * MiB, sent=4 * MiB))  # a body in progress
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()
            for _ in range(50):
                await asyncio.sleep(0.02)
                if not ps._sessions:
                    break
            assert len(taken) >= 3
            kept = {id(b) for b in ps.bodies.kept}  # the server's warm buffers, for any connection's next push
            alive = [ref() for ref in taken if ref() is not None and id(ref()) not in kept]
            assert not alive, f"{len(alive)} body buffers ({sum(b.nbytes for b in alive)} bytes) outlive the connection"
            assert ps.bodies.in_use == 0 and len(kept) <= ps.bodies.limit
    finally:
        gc.enable()


SLOW = 50
IDLE = 1000
STALLED = 200


async def test_idle_stalled_and_slow_peers_cost_little_and_are_closed_by_the_deadlines():
    port = free_port()
    args = ["--kernel", "numpy", "--handshake-timeout", "4", "--max-unauthenticated", "2000"]
    server = start_server(port, *args, "--max-connections", "2000")
    url = f"tcp://127.0.0.1:{port}"
    layout = Layout.from_shapes([("w", (10_000,))])
    peers = []
    try:
        assert await train(url, layout, 2, initial_weights(layout)) == 2
        base = rss_mb(server.pid)
        hello = b"".join(bytes(p) for p in encode_frame(MsgType.HELLO, {"layout": layout.to_wire()}))
        stalled_header = header(MsgType.HELLO, 1_000_000, 0) + b"\x81" + bytes(100)  # 1 MB of metadata promised

        async def open_peer(data=b""):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if data:
                writer.write(data)
            peers.append((reader, writer))
            return reader, writer

        for _ in range(IDLE):
            await open_peer()
        for _ in range(STALLED):
            await open_peer(stalled_header)

        async def dribble():
            _, writer = await open_peer()
            for byte in hello:
                writer.write(bytes([byte]))
                await asyncio.sleep(1.0)

        slow = [asyncio.create_task(dribble()) for _ in range(SLOW)]
        await asyncio.sleep(0.5)
        assert await train(url, layout, 5) == 7  # an honest learner joins and trains meanwhile
        peak = rss_mb(server.pid)
        closed = await asyncio.gather(*(asyncio.wait_for(r.read(), 15) for r, _ in peers), return_exceptions=True)
        assert all(c == b"" or isinstance(c, ConnectionError) for c in closed), "a peer was not closed"
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        assert peak - base < 100, f"server RSS grew by {peak - base:.0f} MB"
        assert await train(url, layout, 1) == 8
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        assert server.returncode == 0
        assert "handshake_timeout" in err and "Traceback" not in err
    finally:
        for _, writer in peers:
            writer.close()
        reap(server)


async def test_connections_beyond_the_limits_are_closed_and_counted():
    layout = Layout.from_shapes([("w", (4,))])
    async with run_server(kernel="numpy", max_connections=4, max_unauthenticated=2) as ps:
        port = int(ps.addresses[0].rsplit(":", 1)[1])
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        await asyncio.sleep(0.1)
        assert ps.core.rejected["evicted"] == 2  # a new one closes the oldest of those without hello
        for reader, _ in idle[:2]:  # told why (one ERROR frame), then closed
            told = await asyncio.wait_for(reader.read(), 5)
            assert told[:4] == b"RDRA" and b"evicted" in told
        learners = [await Client.connect(ps.addresses[0], layout, np.zeros(4, np.float32)) for _ in range(2)]
        more = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.1)
        assert ps.core.rejected["too_many_connections"] >= 1  # 2 learners + 2 without hello: full
        w = await learners[0].push_pull(np.ones(4, np.float32), 0)  # the learners are served all along
        assert w.timestamp == 1
        for c in learners:
            await c.close()
        for _, writer in idle + more:
            writer.close()


HUNG_LEARNER = textwrap.dedent("""
    import asyncio, sys, numpy as np
    from rudra_async.client import Client
    from rudra_async.layout import Layout
    async def main():
        layout = Layout.from_shapes([("w", (64,))])
        client = await Client.connect(sys.argv[1], layout, np.zeros(64, np.float32))
        print(client.learner_id, flush=True)
        w = await client.pull()
        while not w.stop:
            w = await client.push_pull(np.ones(64, np.float32), w.timestamp)
            await asyncio.sleep(0.005)
        await client.close()
    asyncio.run(main())
""")


@pytest.mark.timeout(120)
async def test_a_sigstopped_learner_is_evicted_from_the_hardsync_round_and_rejoins_after_sigcont():
    async with run_server(kernel="numpy", protocol="hardsync", learner_timeout=1.0, momentum=0.0) as ps:
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                HUNG_LEARNER,
                ps.addresses[0],
                stdout=asyncio.subprocess.PIPE,
                env=subprocess_env(),
            )
            for _ in range(3)
        ]
        try:
            ids = [int(await asyncio.wait_for(p.stdout.readline(), 30)) for p in procs]

            async def until(cond, timeout):
                deadline = asyncio.get_running_loop().time() + timeout
                while not cond():
                    assert asyncio.get_running_loop().time() < deadline, ps.stats()
                    await asyncio.sleep(0.02)

            await until(lambda: ps.clock >= 20, 30)
            victim = str(ids[0])
            procs[0].send_signal(signal.SIGSTOP)
            stopped_at = ps.clock
            await until(lambda: ps.clock >= stopped_at + 20, 10)  # the others go on after the deadline
            assert ps.stats()["learners"][victim]["evictions"] == 1
            applied = ps.stats()["learners"][victim]["gradients"]
            procs[0].send_signal(signal.SIGCONT)
            await until(lambda: ps.stats()["learners"][victim]["gradients"] > applied + 5, 20)  # it rejoined
            ps.stop_at(ps.clock + 10)
            for p in procs:
                assert await asyncio.wait_for(p.wait(), 30) == 0
            assert ps.stats()["dropped"] >= 1  # its late gradient
        finally:
            for p in procs:
                if p.returncode is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    await p.wait()


async def test_samples_near_the_limit_leave_periodic_and_final_checkpoints_written(tmp_path):
    from rudra_async import checkpoint

    path = str(tmp_path / "c.ckpt")
    layout = Layout.from_shapes([("w", (4,))])
    async with run_server(kernel="numpy", checkpoint=path, checkpoint_every=1) as ps:
        client = await Client.connect(ps.addresses[0], layout, np.zeros(4, np.float32))
        ps.core.samples = 2**63 - 3  # a long run's count, one push away from msgpack's limit
        with pytest.raises(Exception, match="samples") as info:
            await client.push(np.ones(4, np.float32), 0, samples=2**64 - 1)  # refused: out of range
        assert info.value.code == "bad_request"
        for t in range(3):
            await client.push(np.ones(4, np.float32), t, samples=2**32)
        await client.close()
        await ps.checkpointer.settled()
        assert ps.checkpointer.stats["failed"] == 0 and ps.checkpointer.stats["written"] >= 1
    assert checkpoint.load(path).clock == 3 and checkpoint.load(path).samples == 2**63 - 1  # the final one

"""The shared-memory transport: bodies read in place, segments reused, nothing left in /dev/shm."""

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory

import msgpack
import numpy as np
import pytest
from helpers import CLI_ARGS, reap, run_cli, run_server, sgd_reference, subprocess_env

from rudra_async import transports
from rudra_async.client import Client, SyncClient
from rudra_async.errors import PeerGone, RemoteError, UpdateFailed
from rudra_async.eventloop import run_sync
from rudra_async.kernels import SGD, numpy_kernel
from rudra_async.layout import Layout
from rudra_async.server import pipeline, store
from rudra_async.server.core import ServerCore
from rudra_async.transports import shm
from rudra_async.wire import MsgType


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def collector(frames: list | asyncio.Queue):
    """A listener handler that keeps every frame it receives (unreleased) until the peer goes."""

    async def keep(conn):
        while True:
            try:
                frame = await conn.recv()
            except Exception:
                return
            if isinstance(frames, asyncio.Queue):
                await frames.put(frame)
            else:
                frames.append(frame)

    return keep


async def test_large_bodies_are_read_in_place_and_segments_reused():
    got = asyncio.Queue()
    listener = await transports.listen("shm://", collector(got))
    conn = await transports.connect(listener.address)
    grad = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    for step in range(5):
        grad[0] = step
        await conn.send(MsgType.PUSH, {"step": step}, [grad])
        frame = await asyncio.wait_for(got.get(), 10)
        assert frame.meta["step"] == step and frame.arrays[0][0] == step
        assert isinstance(frame.body.obj, __import__("mmap").mmap)  # a view of shared memory, not a copy
        frame.release()
        await asyncio.sleep(0.01)  # let the RELEASE notice arrive
    assert len(conn._out.segments) == 1  # one segment, allocated once and reused
    small = np.ones(16, np.float32)
    await conn.send(MsgType.PUSH, {}, [small])
    assert (await got.get()).body.obj is not None  # small bodies go inline
    conn.close()
    await listener.close()


async def test_a_released_body_returns_its_segment_without_a_message():
    got, conns = asyncio.Queue(), []

    async def keep(conn):
        conns.append(conn)
        await collector(got)(conn)

    listener = await transports.listen("shm://", keep)
    conn = await transports.connect(listener.address)
    grad = np.ones(1 << 18, np.float32)  # 1 MiB
    for step in range(4):
        grad[:] = step
        await conn.send(MsgType.PUSH, {}, [grad])
        frame = await asyncio.wait_for(got.get(), 10)
        assert (frame.arrays[0] == step).all()
        frame.release()  # stores the ticket in the segment: the sender sees it free at once
    assert len(conn._out.segments) == 1  # reused every time, though no notice ever came
    assert conns[0].bytes_out == 0 and conn.bytes_in == 0  # not one RELEASE notice crossed the socket
    conn.close()
    await listener.close()


def test_a_late_notice_for_an_earlier_body_does_not_free_a_reused_segment():
    out = shm.segments._Outgoing()
    try:
        body = np.ones(1 << 18, np.float32)
        seg, first = out.take([body], body.nbytes)
        seg.control[0] = first  # the receiver released the first body ...
        again, second = out.take([body], body.nbytes)
        assert again is seg and second == first + 1  # ... so the segment carries the second
        out.released(seg.shm.name, first)  # a notice for the first body, arriving late
        assert not seg.free  # must not free the second body's segment while it is read
        out.released(seg.shm.name, second)
        assert seg.free
    finally:
        out.destroy()


def test_a_receiver_never_stores_an_earlier_ticket_over_a_later_one():
    """Tickets are stored from the update thread (as soon as a gradient is read) and again at
    its release: a store for an earlier body never makes the later one look unreleased."""
    out = shm.segments._Outgoing()
    try:
        body = np.ones(1 << 18, np.float32)
        seg, first = out.take([body], body.nbytes)
        attached = shm.segments._Attached(seg.shm.name, os.getuid())
        attached.mark_released(first)
        again, second = out.take([body], body.nbytes)
        assert again is seg and second == first + 1
        attached.mark_released(second)
        attached.mark_released(first)  # the first body's release, late
        assert seg.free
        attached.close()
        attached.mark_released(second)  # after a close: nothing to store, no error
    finally:
        out.destroy()


async def test_a_blocking_sender_waits_for_a_segment_and_is_woken_by_the_notice():
    frames, conns = [], []

    async def keep(conn):
        conns.append(conn)
        await collector(frames)(conn)

    listener = await transports.listen("shm://", keep)
    conn = shm.transport.connect_blocking(listener.address)
    big = np.ones(1 << 18, np.float32)

    def send(i: int) -> None:
        big[:] = i
        run_sync(conn.send(MsgType.PUSH, {"i": i}, [big]))

    for i in range(shm.segments.MAX_SEGMENTS):
        send(i)
    blocked = asyncio.get_running_loop().run_in_executor(None, send, 99)
    try:
        await asyncio.sleep(0.2)
        assert not blocked.done()  # every segment is held by the receiver
        assert [f.arrays[0][0] for f in frames] == list(range(shm.segments.MAX_SEGMENTS))  # none overwritten
        assert conns[0].bytes_out == 0
        frames[1].release()  # the sender asked for notices: this one wakes it
        assert conns[0].bytes_out > 0  # the RELEASE notice
        await asyncio.wait_for(asyncio.shield(blocked), 5)
        await asyncio.sleep(0.05)
        assert frames[-1].arrays[0][0] == 99 and [f.arrays[0][0] for f in frames[2:4]] == [2, 3]
        assert not any(seg.control[1] for seg in conn._out.segments.values())  # it stopped asking
    finally:
        await listener.close()  # a sender still waiting sees the peer gone and returns
        await asyncio.gather(blocked, return_exceptions=True)
        conn.close()


async def test_held_bodies_make_the_sender_use_another_segment_then_wait():
    frames = []
    listener = await transports.listen("shm://", collector(frames))
    conn = await transports.connect(listener.address)
    big = np.ones(1 << 18, np.float32)
    for i in range(shm.segments.MAX_SEGMENTS):
        big[:] = i
        await conn.send(MsgType.PUSH, {"i": i}, [big])
    await asyncio.sleep(0.05)
    assert [f.arrays[0][0] for f in frames] == list(range(shm.segments.MAX_SEGMENTS))  # none overwritten
    blocked = asyncio.create_task(conn.send(MsgType.PUSH, {"i": 99}, [big]))
    await asyncio.sleep(0.1)
    assert not blocked.done()  # back-pressure: every segment is held by the receiver
    frames[0].release()
    await asyncio.wait_for(blocked, 5)
    conn.close()
    await listener.close()


def wait_until(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def shm_listening(name: str) -> bool:
    """Whether a server listens on ``shm://NAME`` (its abstract Unix socket is bound)."""
    with open("/proc/net/unix") as table:
        return any(line.rstrip().endswith(f"@rudra-async/{name}") for line in table)


def test_no_segment_survives_a_crash_of_either_side(tmp_path):
    before = shm_files()
    name = f"crash-{os.getpid()}"
    env = subprocess_env()
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115 (the children write to it until the test ends)
    server = subprocess.Popen([*CLI_ARGS, "server", "--listen", f"shm://{name}"], stderr=log, env=env)
    learners = []
    try:
        # a learner finding nobody there exits at once
        wait_until(lambda: server.poll() is not None or shm_listening(name), timeout=60)
        assert server.poll() is None, "the server died before it listened"
        learners = [
            subprocess.Popen(
                [*CLI_ARGS, "learner", "--connect", f"shm://{name}", "--index", str(i)], stdout=log, stderr=log, env=env
            )
            for i in range(2)
        ]
        wait_until(lambda: len(shm_files() - before) >= 3)  # segments of both learners and the server
        learners[0].send_signal(signal.SIGKILL)  # a learner dies: its segments go too
        learners[0].wait()
        time.sleep(0.5)
        server.send_signal(signal.SIGKILL)  # then the server dies mid-run
        server.wait()
        learners[1].wait(timeout=30)  # the other learner notices and stops
        wait_until(lambda: not (shm_files() - before))
    finally:
        reap(server, *learners)
        log.close()
    assert not (shm_files() - before)


KILLED_WHILE_CREATING = """
import os, signal, _posixshmem
from multiprocessing import shared_memory
from rudra_async.transports import shm

def shm_open(name, flags, mode=0o777):
    fd = real(name, flags, mode)
    if flags & os.O_CREAT:
        print(name, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the segment exists; SharedMemory has not registered it
    return fd

real, _posixshmem.shm_open = _posixshmem.shm_open, shm_open
shm.segments._Segment(1 << 20)
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=60
    )


def test_a_segment_is_cleaned_up_if_its_owner_is_killed_the_moment_it_is_created():
    proc = run_python(KILLED_WHILE_CREATING)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    name = proc.stdout.split()[0].lstrip("/")
    try:
        wait_until(lambda: name not in shm_files())  # the owner's resource tracker unlinked it
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


FAILS_TO_SIZE = """
import os
from rudra_async.transports import shm

def ftruncate(fd, size):
    raise OSError(28, "No space left on device")

os.ftruncate = ftruncate
for _ in range(2):
    try:
        shm.segments._Segment(1 << 20)
    except OSError as exc:
        print(exc)
"""


def test_a_segment_that_cannot_be_sized_is_gone_and_untracked():
    before = shm_files()
    proc = run_python(FAILS_TO_SIZE)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("No space left") == 2
    assert "Error" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr  # the tracker had nothing to undo
    assert not {n for n in shm_files() - before if n.startswith("rudra-")}


@pytest.mark.long
def test_train_over_shm_and_ucx_reaches_tcp_accuracy(tmp_path):
    before = shm_files()
    results = {}
    for transport in ("tcp", "shm", "ucx"):
        out = tmp_path / f"{transport}.json"
        proc = run_cli("train", "-q", "--transport", transport, "--results", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr
        results[transport] = json.loads(out.read_text())
    for transport in ("shm", "ucx"):
        assert results[transport]["transport"] == transport
        assert results[transport]["test_accuracy"] >= 0.93
        assert abs(results[transport]["test_accuracy"] - results["tcp"]["test_accuracy"]) < 0.04
    assert not (shm_files() - before)  # a normal run leaves nothing behind


async def test_server_listens_on_tcp_and_shm_at_once():
    layout = Layout.from_shapes([("w", (10_000,))])
    async with run_server(listen=["tcp://127.0.0.1:0", "shm://"]) as ps:
        tcp_url, shm_url = ps.addresses
        assert tcp_url.startswith("tcp://") and shm_url.startswith("shm://")
        a = await Client.connect(tcp_url, layout, np.zeros(10_000, np.float32))
        b = await Client.connect(shm_url, layout)
        g = np.ones(10_000, np.float32)
        await a.push(g, 0)
        w = await b.push_pull(g, 1)
        assert w.timestamp == 2
        np.testing.assert_array_equal(w.array, ps.core.store.weights)
        for c in (a, b):
            await c.close()


@contextlib.asynccontextmanager
async def lending_weights():
    """A connection whose send of exported weights (all 7.0) is under way: ``(conn,
    sending, frame)``, ``frame`` the reader's copy of it, not released yet."""
    frames = asyncio.Queue()
    listener = await transports.listen("shm://", collector(frames))
    conn = await transports.connect(listener.address)
    weights = shm.exported.allocate(4 * 300_000).view(np.float32)
    weights[:] = 7.0
    sending = asyncio.create_task(conn.send(MsgType.WEIGHTS, {"timestamp": 1}, [weights]))
    try:
        yield conn, sending, await asyncio.wait_for(frames.get(), 5)
    finally:
        conn.close()
        shm.exported.free(weights)
        await asyncio.wait_for(listener.close(), 10)


async def test_exported_memory_is_sent_by_reference_and_held_until_released():
    """The server publishes weights in exported shared memory: a pull moves a reference (no
    copy on the server), and the sender's send (and so the weights' lease) lasts until the
    reader released the frame: the reader never sees the buffer change under it."""
    async with lending_weights() as (conn, sending, frame):
        await asyncio.sleep(0.05)
        assert not sending.done()  # held: the reader has not released yet
        assert conn._out.segments == {}  # no staging segment: nothing was copied
        assert np.all(frame.arrays[0] == 7.0)
        frame.release()
        await asyncio.wait_for(sending, 5)


async def test_a_send_by_reference_cancelled_before_the_release_hangs_up_first():
    """A send of lent memory that is cancelled before the reader released it (a reply cut
    off at shutdown) returns to a caller whose lease then ends, so the memory may change
    while the reader still copies it: the socket is shut down before the cancellation
    returns, so the reader's check after its copy (``Frame.lent``) already says no."""
    async with lending_weights() as (conn, sending, frame):
        assert frame.lent is not None and frame.lent()  # still lent: the reader may trust its copy
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(sending, 5)
        lent_after = frame.lent()  # the lease ends here: the reader must not trust what it copies
        frame.release()
        assert conn.is_closed
    assert not lent_after


class DocsOnlyShmLearner:
    """A learner written from docs/wire.md and docs/transports.md ("The shm:// format") alone:
    a blocking Unix socket, struct, msgpack and a POSIX shared-memory segment of its own."""

    def __init__(self, server_name: str, size: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect("\0rudra-async/" + server_name)
        self.size = size
        nbytes = 4 * size  # a multiple of 8 here: a progress word, then the control block, follow at once
        self.seg = shared_memory.SharedMemory(create=True, size=nbytes + 8 + 16)
        self.body = np.ndarray((size,), "<f4", self.seg.buf)
        self.word = np.ndarray((1,), "<i8", self.seg.buf, offset=nbytes)  # of a push written after its reference
        self.control = np.ndarray((2,), "<i8", self.seg.buf, offset=nbytes + 8)  # [released ticket, sender waits]
        self.tickets = 0

    def hello_with_zeros(self) -> None:
        """Say hello with zero initial weights of this learner's size, and read the WELCOME."""
        self.send(1, {"layout": [["w", [self.size]]], "~shm": self.by_reference(np.zeros(self.size, np.float32))})
        assert self.recv()[0] == MsgType.WELCOME

    def send(self, msg_type: int, meta: dict) -> None:
        packed = msgpack.packb(meta)
        self.sock.sendall(b"RDRA" + struct.pack("<BBHQQ", 1, msg_type, 0, len(packed), 0) + packed)

    def recv(self) -> tuple[int, dict]:
        magic, version, msg_type, _flags, meta_len, body_len = struct.unpack("<4sBBHQQ", self._exactly(24))
        assert (magic, version, body_len) == (b"RDRA", 1, 0), "a body this large travels by reference"
        return msg_type, msgpack.unpackb(self._exactly(meta_len))

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the server closed the connection"
            data += chunk
        return data

    def read_weights(self, meta: dict) -> np.ndarray:
        """The body a WEIGHTS reference names, copied out; then its RELEASE notice."""
        name, nbytes, seg, offset, *ticket = meta["~shm"]
        assert seg == [["<f4", [self.size]]] and nbytes == 4 * self.size and not ticket  # exported: no ticket
        assert "~progress" not in meta, "this learner's HELLO did not say it follows progress words"
        weights = np.fromfile(f"/dev/shm/{name}", "<f4", self.size, offset=offset)
        self.send(250, {"name": name, "offset": offset})
        return weights

    def by_reference(self, values: np.ndarray) -> list:
        """``values`` written into this learner's segment as the next body: its reference."""
        assert self.tickets == 0 or self.control[0] == self.tickets, "the segment is still being read"
        self.body[:] = values
        self.tickets += 1
        return [self.seg.name, 4 * self.size, [["<f4", [self.size]]], 0, self.tickets]

    def push(self, grad: np.ndarray, timestamp: int) -> None:
        self.send(3, {"timestamp": timestamp, "pull": True, "~shm": self.by_reference(grad)})

    def push_before_writing(self, timestamp: int) -> None:
        """A PUSH whose body the learner writes after the reference: the progress word (0
        now) says how much of it is written."""
        self.word[0] = 0
        self.tickets += 1
        ref = [self.seg.name, 4 * self.size, [["<f4", [self.size]]], 0, self.tickets]
        self.send(3, {"timestamp": timestamp, "pull": True, "~shm": ref, "~progress": 4 * self.size})

    def close(self) -> None:
        del self.body, self.word, self.control
        self.sock.close()
        self.seg.close()
        self.seg.unlink()


@pytest.mark.parametrize("paths", ["defaults", "large-model paths"])
async def test_a_learner_written_from_the_docs_alone_trains_over_shm(paths, monkeypatch, send_threads):
    """Initial weights and gradients go by reference with tickets, weights come back by
    reference without one; the server returns each body through the control block alone,
    and with a RELEASE notice once the learner says it waits; the updates are SGD's, bit for bit.
    ``large-model paths``: updates computed off the loop in pieces and a stream's large
    frames written by sender threads while computed; over shm the weights must still go by
    reference (a reply with a body fails the learner's ``recv``)."""
    if paths == "large-model paths":
        monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
        monkeypatch.setattr(store, "PIECE_VALUES", 1000)
        send_threads(1)
    size = 50_000  # 200 KB: every body travels by reference
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(2)]
    expected = list(sgd_reference(w0, [([g], [1.0]) for g in grads], 0.05, 0.9, 0.0, False))
    async with run_server(listen=["shm://"], lr=0.05, momentum=0.9) as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> list[tuple[int, dict]]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.send(1, {"layout": [["w", [size]]], "~shm": me.by_reference(w0)})  # ticket 1
                assert me.recv()[0] == 2  # WELCOME
                replies = []
                for step, grad in enumerate(grads):
                    if step == 1:
                        me.control[1] = 1  # "sender waits": now the release also comes as a notice
                    me.push(grad, timestamp=step)
                    frames = [me.recv()]
                    if step == 1:
                        frames.append(me.recv())
                    replies += frames
                    weights = [meta for t, meta in frames if t == 5]
                    assert len(weights) == 1 and weights[0]["timestamp"] == step + 1
                    np.testing.assert_array_equal(me.read_weights(weights[0]), expected[step])
                    assert me.control[0] == me.tickets  # released through the control block
                me.send(8, {})
                assert me.recv()[0] == 8
                return replies
            finally:
                me.close()

        replies = await asyncio.to_thread(learn)
    notices = [meta for t, meta in replies if t == 250]
    assert len(replies) == 3 and len(notices) == 1  # no notice while the learner did not wait
    assert notices[0]["offset"] == 0 and notices[0]["ticket"] == 3  # hello 1, pushes 2 and 3


def numpy_sgd(w0: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The weights after each gradient, by the server's numpy kernel (whole, inline), with
    the learning rate 0.05 and momentum 0.9."""
    reference, w, out = numpy_kernel.NumpyUpdater(w0.size), w0.copy(), []
    for grad in grads:
        reference.apply(w, w, [grad], [1.0], SGD(0.05, 0.9))
        out.append(w.copy())
    return out


def push_pull_each(address: str, w0: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """A SyncClient pulls, then push+pulls each gradient in turn: the weights it got."""
    client = SyncClient(address, Layout.from_shapes([("w", (w0.size,))]), w0)
    try:
        w, got = client.pull(), []
        for grad in grads:
            w = client.push_pull(grad, w.timestamp)
            got.append(w.array.copy())
        return got
    finally:
        client.close()


def slow_pieces(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Make the numpy kernel take 2 ms per piece of an update (so a reply finds it in
    flight), and raise at its ``fail_at``-th piece; the list counts the pieces computed."""
    pieces: list[int] = []
    apply = numpy_kernel.NumpyUpdater.apply

    def slow(self, *args, **kwargs):
        pieces.append(1)
        if len(pieces) == fail_at:
            raise RuntimeError("a kernel that fails")
        time.sleep(0.002)
        return apply(self, *args, **kwargs)

    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    monkeypatch.setattr(store, "PIECE_VALUES", 5_000)
    monkeypatch.setattr(numpy_kernel.NumpyUpdater, "apply", slow)
    return pieces


@pytest.mark.parametrize("ordered", [True, False])
async def test_a_blocking_learner_over_shm_copies_the_weights_as_they_are_computed(ordered, monkeypatch):
    """A SyncClient over shm says in its HELLO that it follows progress words (on a machine
    with ordered stores), so a reply that finds its update in flight goes out at once, with
    where the body's progress word is: the learner copies each byte once the word says it
    is final. The weights are SGD's, bit for bit; without ordered stores nobody follows
    progress and the replies wait for their updates."""
    size = 50_000  # 10 pieces of 2 ms: the reply is sent while the update is computed
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    expected = numpy_sgd(w0, grads)
    slow_pieces(monkeypatch)
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", ordered)
    followed = []
    follow = shm.BlockingShmConnection._follow
    monkeypatch.setattr(shm.BlockingShmConnection, "_follow", lambda *a: followed.append(1) or follow(*a))
    async with run_server(listen=["shm://"], lr=0.05, momentum=0.9, kernel="numpy") as ps:
        got = await asyncio.to_thread(push_pull_each, ps.addresses[0], w0, grads)
    for mine, theirs in zip(got, expected):
        np.testing.assert_array_equal(mine, theirs)
    assert len(followed) == (len(grads) if ordered else 0)


async def test_a_learner_copying_weights_being_computed_learns_when_the_update_fails(monkeypatch):
    """The update fails halfway: the progress word says -1 and the learner raises PeerGone
    (it does not wait for bytes that will never be final); the server stops (UpdateFailed)."""
    pieces = slow_pieces(monkeypatch, fail_at=15)  # the second update's fifth piece
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    w0 = np.zeros(size, np.float32)
    with pytest.raises(UpdateFailed, match="a kernel that fails"):  # from serve(), awaited by run_server
        # one update thread: the pieces in order, so the failing one is the last computed (with
        # several, the next ones may be under way: test_background's failure test covers that)
        async with run_server(listen=["shm://"], lr=0.05, kernel="numpy", update_threads=1) as ps:

            def learn() -> None:
                client = SyncClient(ps.addresses[0], Layout.from_shapes([("w", (size,))]), w0)
                try:
                    w = client.push_pull(np.ones(size, np.float32), client.pull().timestamp)
                    client.push_pull(np.ones(size, np.float32), w.timestamp)
                finally:
                    client.close()

            with pytest.raises(PeerGone, match="computation of these weights failed"):
                await asyncio.wait_for(asyncio.to_thread(learn), 30)
    assert len(pieces) == 15


def test_a_progress_word_follows_the_latest_update_only():
    """Threads keep an exported allocation's progress word up to date as its update's bytes
    become final, and -1 once it fails; a thread of an earlier update into the same memory
    that wakes late (after a later update is followed) writes nothing."""

    def soon(condition) -> bool:
        end = time.monotonic() + 5
        while not condition() and time.monotonic() < end:
            time.sleep(0.001)
        return condition()

    buf = shm.exported.allocate(4000)
    stop, failures = threading.Event(), []
    where = shm.exported.locate(buf)
    name, pw = where[0], shm.exported.progress_word(where, 4000)
    seen = [np.frombuffer(shm.exported.segments[name].shm.buf, np.int64, 1, pw.at)]  # where a learner reads it

    def word() -> int:
        return int(seen[0][0])

    try:
        first, second = store.Progress(4000), store.Progress(4000)
        first.advance(1000)
        pw.follow(first, 4000, stop, lambda: failures.append("first"))
        assert word() == 1000, "the word says what is final before the reference goes out"
        first.advance(3000)
        assert soon(lambda: word() == 3000)
        pw.follow(second, 4000, stop, lambda: failures.append("second"))
        assert word() == 0
        first.advance(4000)  # the first update's thread wakes late: it must not write any more
        time.sleep(0.2)
        assert word() == 0
        second.advance(2000)
        assert soon(lambda: word() == 2000)
        second.fail(RuntimeError("a kernel that fails"))
        assert soon(lambda: word() == -1) and soon(lambda: failures == ["second"])
    finally:
        stop.set()
        seen.clear()  # no view of the segment left: it can close
        shm.exported.free(buf)


def write_ahead(monkeypatch, piece_s: float = 0.002) -> list[float]:
    """Make every body of 64 KiB or more a push written after its reference, in 16 KiB
    pieces that take ``piece_s`` each to write, and checked by the server 4,096 values at a
    time, off the loop; the list gets the time of each piece the server checks."""
    monkeypatch.setattr(shm.segments, "WRITE_AHEAD_MIN", 1 << 16)
    monkeypatch.setattr(shm.segments, "WRITE_PIECE", 1 << 14)
    monkeypatch.setattr(pipeline, "WRITTEN_PIECE_VALUES", 4096)
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)

    class SlowFence:  # taken after each piece is copied
        def __enter__(self):
            time.sleep(piece_s)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(shm.segments, "_FENCE", SlowFence())
    checked: list[float] = []
    max_abs = ServerCore.max_abs
    monkeypatch.setattr(ServerCore, "max_abs", lambda self, g: checked.append(time.monotonic()) or max_abs(self, g))
    return checked


@pytest.mark.parametrize("ordered, alone", [(True, True), (True, False), (False, True)])
async def test_a_blocking_learner_over_shm_pushes_before_writing_and_the_server_checks_as_it_writes(
    ordered, alone, monkeypatch
):
    """On a machine with ordered stores the server's WELCOME tells a SyncClient (whose HELLO
    said it follows progress words) that it reads them in pushes too; the learner then sends
    a large push's reference first and writes the body piece by piece, and the server
    checks each piece as the word says it is written, so the check ends right after the
    copy; while another learner has a request in progress (not ``alone``) it checks the
    whole gradient once written. The updates are SGD's, bit for bit; without ordered stores
    every push is written first."""
    size = 50_000  # 200 KB: 13 pieces of 2 ms
    rng = np.random.default_rng(8)
    w0 = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    expected = numpy_sgd(w0, grads)
    checked = write_ahead(monkeypatch)
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", ordered)
    pushed: list[tuple[float, float]] = []  # when each push's send began and ended
    send = shm.BlockingShmConnection.send

    async def timed_send(self, msg_type, meta=None, arrays=()):
        start = time.monotonic()
        await send(self, msg_type, meta, arrays)
        if msg_type == MsgType.PUSH:
            pushed.append((start, time.monotonic()))

    monkeypatch.setattr(shm.BlockingShmConnection, "send", timed_send)
    if not alone:
        monkeypatch.setattr(ServerCore, "alone", lambda self, learner: False)
    async with run_server(listen=["shm://"], lr=0.05, momentum=0.9, kernel="numpy") as ps:
        got = await asyncio.to_thread(push_pull_each, ps.addresses[0], w0, grads)
    for mine, theirs in zip(got, expected):
        np.testing.assert_array_equal(mine, theirs)
    during = [sum(start < t < end for t in checked) for start, end in pushed]
    if ordered and alone:  # 13 pieces written, most checked while they are (a late look may take two at once)
        assert all(n >= 6 for n in during), during
    else:  # each push checked whole, once it is written
        assert len(checked) == 3


async def test_pushes_written_after_their_reference_reuse_the_segment_of_the_hello(monkeypatch):
    """Every segment a learner makes has room for a progress word after a body of its size,
    so its pushes written after their reference go into the segment its HELLO's initial
    weights used (a new one would stay mapped by the server: a model's size of memory).
    The updates are computed inline, so each push's body is released before its reply goes
    out: with a background update it is released once the loop reaps the update, which may
    come after the learner's next push took a segment (which then makes a new one)."""
    write_ahead(monkeypatch, piece_s=0)
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1 << 30)  # write_ahead's 1: every update in the background
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 400_000  # 1.6 MB: beyond the smallest segment (1 MiB)
    names = []
    reserve = shm.segments._Outgoing.reserve
    monkeypatch.setattr(shm.segments._Outgoing, "reserve", lambda self, n: names.append(seg := reserve(self, n)) or seg)
    w0 = np.zeros(size, np.float32)
    grads = [np.full(size, 0.5, np.float32)] * 2
    async with run_server(listen=["shm://"], lr=0.05, momentum=0.9, kernel="numpy") as ps:
        got = await asyncio.to_thread(push_pull_each, ps.addresses[0], w0, grads)
    np.testing.assert_array_equal(got[-1], numpy_sgd(w0, grads)[-1])
    assert len(names) == 3 and len({seg.shm.name for seg in names}) == 1


async def test_a_nan_in_the_last_piece_of_a_push_written_after_its_reference_is_refused(monkeypatch):
    """The pieces checked as they are written find a NaN in the last one: the push is
    refused (bad_gradient), nothing is applied and the learner goes on."""
    checked = write_ahead(monkeypatch)
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    w0 = np.zeros(size, np.float32)
    async with run_server(listen=["shm://"], lr=0.05, kernel="numpy") as ps:

        def learn() -> np.ndarray:
            client = SyncClient(ps.addresses[0], Layout.from_shapes([("w", (size,))]), w0)
            try:
                stamp = client.pull().timestamp
                bad = np.ones(size, np.float32)
                bad[-1] = np.nan
                with pytest.raises(RemoteError) as refused:
                    client.push_pull(bad, stamp)
                assert refused.value.code == "bad_gradient"
                return client.push_pull(np.ones(size, np.float32), stamp).array.copy()
            finally:
                client.close()

        w = await asyncio.to_thread(learn)
        assert ps.clock == 1
    np.testing.assert_array_equal(w, np.full(size, -0.05, np.float32))
    assert len(checked) >= 2 * 5  # piece by piece: the NaN was in the last piece checked


def train_on_ones(address: str, w0: np.ndarray, steps: int) -> int:
    """A SyncClient's ``steps`` push+pulls of a gradient of ones from ``w0``: the last timestamp."""
    client = SyncClient(address, Layout.from_shapes([("w", w0.shape)]), w0)
    try:
        w = client.pull()
        for _ in range(steps):
            w = client.push_pull(np.ones_like(w0), w.timestamp)
        return w.timestamp
    finally:
        client.close()


async def test_a_learner_that_stops_writing_its_push_stalls_no_one_and_is_closed_by_the_deadline(monkeypatch):
    """A learner (written from the docs) sends a push's reference and never writes its body:
    another learner trains meanwhile, and the idle deadline closes the stalled one, counted
    push_not_written; nothing of its push is applied."""
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    w0 = np.zeros(size, np.float32)
    async with run_server(listen=["shm://"], lr=0.05, kernel="numpy", idle_timeout=1.0) as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def stall() -> bytes:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.send(1, {"layout": [["w", [size]]], "~shm": me.by_reference(w0), "~progress": True})
                kind, welcome = me.recv()
                assert kind == 2 and welcome["~progress"] is True  # pushes may be written after their reference
                me.body[: size // 2] = 1.0
                me.word[0] = 2 * size  # half of it, then nothing more
                me.push_before_writing(timestamp=0)
                me.sock.settimeout(20)
                return me.sock.recv(1 << 16)  # an ERROR? no: the connection just closes
            finally:
                me.close()

        stalled = asyncio.create_task(asyncio.to_thread(stall))
        await asyncio.sleep(0.3)
        assert await asyncio.wait_for(asyncio.to_thread(train_on_ones, ps.addresses[0], w0, 5), 10) == 5
        assert await asyncio.wait_for(stalled, 20) == b""
        assert ps.core.rejected["push_not_written"] == 1 and ps.clock == 5


async def test_a_learner_that_stops_writing_its_push_is_evicted_from_a_hardsync_round_by_the_learner_timeout(
    monkeypatch,
):
    """Under hardsync, a member that sends a push's reference and stops writing its body is
    evicted after --learner-timeout (not held until the idle timeout), so the other member's
    rounds complete without it; once it writes the rest it rejoins, and its late gradient is
    dropped."""
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    w0 = np.zeros(size, np.float32)
    go_on = threading.Event()
    cfg = dict(protocol="hardsync", learner_timeout=0.5, idle_timeout=60.0, lr=0.05, momentum=0.0, kernel="numpy")
    async with run_server(listen=["shm://"], **cfg) as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def stall_then_write() -> dict:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.send(1, {"layout": [["w", [size]]], "~shm": me.by_reference(w0), "~progress": True})
                assert me.recv()[0] == MsgType.WELCOME
                me.body[:] = 1.0
                me.word[0] = 2 * size  # half of it written, then nothing until told
                me.push_before_writing(timestamp=0)
                me.word[0] = 2 * size
                assert go_on.wait(30)
                me.word[0] = 4 * size
                me.sock.settimeout(20)
                kind, reply = me.recv()
                assert kind == MsgType.WEIGHTS, reply
                return reply
            finally:
                me.close()

        stalled = asyncio.create_task(asyncio.to_thread(stall_then_write))
        while ps.core.learners == {} or not any(i.writing for i in ps.core.learners.values()):
            await asyncio.sleep(0.01)
        trained = asyncio.to_thread(train_on_ones, ps.addresses[0], w0, 3)
        assert await asyncio.wait_for(trained, 15) == 3  # not held for the idle timeout
        evictions = [info["evictions"] for info in ps.stats()["learners"].values()]
        assert sorted(evictions) == [0, 1]
        go_on.set()
        reply = await asyncio.wait_for(stalled, 30)
        assert reply["timestamp"] == 3  # the weights of the rounds it missed
        assert ps.clock == 3 and ps.stats()["dropped"] == 1  # its gradient, stamped before them


async def test_a_refused_reference_gives_its_segment_back_and_a_ticket_beyond_int64_is_refused():
    """A PUSH whose reference is refused (its segment list does not describe the body) is
    answered malformed, not fatal, and its ticket is stored as released, so the sender may
    write the segment again; a ticket that does not fit the control block's int64 word, and a
    body reaching into the segment's last 16 bytes (its control block, which the receiver
    writes), are refused the same way; then a good push is applied."""
    size = 50_000
    async with run_server(listen=["shm://"], lr=0.5, momentum=0.0, kernel="numpy") as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> list[tuple[int, dict]]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.hello_with_zeros()
                replies = []
                bad = me.by_reference(np.ones(size, np.float32))
                bad[2] = [["<f4", [size - 1]]]  # does not describe nbytes
                me.send(MsgType.PUSH, {"timestamp": 0, "seq": 1, "~shm": bad})
                replies.append(me.recv())
                wait_until(lambda: me.control[0] == me.tickets, 5)  # the refused body was released
                huge = me.by_reference(np.ones(size, np.float32))
                huge[4] = 1 << 63
                me.send(MsgType.PUSH, {"timestamp": 0, "seq": 2, "~shm": huge})
                replies.append(me.recv())
                me.control[0] = me.tickets  # that ticket could not be stored: the body is the learner's again
                for seq, spoil in ((3, lambda ref: ref.__setitem__(1, True)), (4, lambda ref: ref.append(0))):
                    bad = me.by_reference(np.ones(size, np.float32))
                    spoil(bad)  # nbytes a msgpack true, not an int; a sixth element
                    me.send(MsgType.PUSH, {"timestamp": 0, "seq": seq, "~shm": bad})
                    replies.append(me.recv())
                    wait_until(lambda: me.control[0] == me.tickets, 5)
                me.tickets += 1  # a body that ends 8 bytes into the control block
                ref = [me.seg.name, 4 * size, [["<f4", [size]]], 16, me.tickets]
                me.send(MsgType.PUSH, {"timestamp": 0, "seq": 5, "~shm": ref})
                replies.append(next(reply for reply in iter(me.recv, None) if reply[0] != 250))
                wait_until(lambda: me.control[0] == me.tickets, 5)
                me.push(np.ones(size, np.float32), timestamp=0)
                replies.append(me.recv())
                return replies
            finally:
                me.close()

        *refused, (k6, ok) = await asyncio.to_thread(learn)
        for seq, (kind, error) in enumerate(refused, 1):
            assert kind == MsgType.ERROR and error["code"] == "malformed" and error["fatal"] is False
            assert error["seq"] == seq
        assert len(refused) == 5 and "overlaps the control block" in refused[4][1]["message"]
        assert k6 == MsgType.WEIGHTS and ok["timestamp"] == 1 and ps.clock == 1


async def test_only_the_hello_a_welcome_answers_can_ask_for_progress_words(monkeypatch):
    """A HELLO that says "~progress" but is refused does not turn progress words on: the
    WELCOME to the next HELLO, which does not say it, does not offer them either."""
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    async with run_server(listen=["shm://"], lr=0.05, kernel="numpy") as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> list[tuple[int, dict]]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                replies = []
                for hello in ({"layout": [["w", [size + 1]]], "~progress": True}, {"layout": [["w", [size]]]}):
                    me.send(1, {**hello, "~shm": me.by_reference(np.zeros(size, np.float32))})
                    replies.append(me.recv())
                return replies
            finally:
                me.close()

        (k1, refused), (k2, welcome) = await asyncio.to_thread(learn)
        assert k1 == MsgType.ERROR and refused["fatal"] is False
        assert k2 == MsgType.WELCOME and "~progress" not in welcome


@pytest.mark.parametrize("case", ["unannounced", "word inside the body", "word past the segment", "in a pull"])
async def test_a_push_written_after_its_reference_where_not_allowed_is_fatal(case, monkeypatch):
    """A reference with a progress word that the server did not announce, one whose word
    lies inside the body or beyond the segment, or one in any frame but a PUSH, ends the
    connection with a malformed error; nothing is applied."""
    monkeypatch.setattr(shm.segments, "ORDERED_STORES", True)
    size = 50_000
    async with run_server(listen=["shm://"], lr=0.05, kernel="numpy") as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> tuple[int, dict]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                hello = {"layout": [["w", [size]]], "~shm": me.by_reference(np.zeros(size, np.float32))}
                if case != "unannounced":
                    hello["~progress"] = True
                me.send(1, hello)
                assert me.recv()[0] == 2
                me.body[:] = 1.0
                me.tickets += 1
                ref = [me.seg.name, 4 * size, [["<f4", [size]]], 0, me.tickets]
                at = {"word inside the body": 8, "word past the segment": 4 * size + 16}.get(case, 4 * size)
                me.word[0] = 4 * size
                kind = MsgType.PULL if case == "in a pull" else MsgType.PUSH
                me.send(kind, {"timestamp": 0, "pull": True, "~shm": ref, "~progress": at})
                return me.recv()
            finally:
                me.close()

        kind, error = await asyncio.to_thread(learn)
        assert kind == MsgType.ERROR and error["code"] == "malformed" and error["fatal"] is True
        assert ps.clock == 0


async def test_weights_lent_by_reference_are_never_taken_torn_after_the_server_closed_the_connection():
    """shm lends its published weights by reference until the learner's RELEASE. If the
    server closes the connection first (here the reply_not_read deadline: the learner did
    not read its reply), the memory is the server's again once the socket is closed, and the
    next update may write it in place. A learner that reads the reference afterwards must
    not take what it copies as weights (it could mix updates): its pull fails with PeerGone."""
    n = 100_000  # a body that goes by reference
    layout = Layout.from_shapes([("w", (n,))])
    async with run_server(listen=["shm://"], lr=1.0, momentum=0.0, kernel="numpy", idle_timeout=0.5) as ps:
        b = await Client.connect(ps.addresses[0], layout, np.zeros(n, np.float32))
        a = await Client.connect(ps.addresses[0], layout)
        a.conn._transport.pause_reading()  # A's reply (the reference) waits in its socket
        pulled = asyncio.ensure_future(a.pull())
        for _ in range(12):  # past A's deadline (0.5 s), without an update
            await b.pull()
            await asyncio.sleep(0.1)
        for _ in range(3):  # in place, into the weights A's reply refers to
            await b.push(np.ones(n, np.float32), ps.clock)
        a.conn._transport.resume_reading()
        with pytest.raises(PeerGone, match="while its weights were being read"):
            await asyncio.wait_for(pulled, 10)
        await b.close()
        await a.close()


async def test_a_segment_its_peer_does_not_own_is_refused_and_never_written(monkeypatch):
    """A receiver maps only segments owned by its peer's user (SO_PEERCRED on the socket): a
    reference to any other segment it could open is refused (malformed, not fatal), and
    nothing is written into it: the body goes back by a RELEASE notice on the socket."""
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert shm.segments.peer_uid(a) == os.getuid()
    for side in (shm.connection, shm.blocking):  # where each side looks its peer's user up
        monkeypatch.setattr(side, "peer_uid", lambda sock: os.getuid() + 1)  # each takes the other for another user
    size = 50_000
    async with run_server(listen=["shm://"]) as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> tuple[list[tuple[int, dict]], int, str]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.send(1, {"layout": [["w", [size]]], "~shm": me.by_reference(np.zeros(size, np.float32))})
                return [me.recv(), me.recv()], int(me.control[0]), me.seg.name
            finally:
                me.close()

        ((kind, error), (notice_kind, notice)), released, name = await asyncio.to_thread(learn)
        assert ps.core.store is None  # the HELLO was not taken
    assert kind == MsgType.ERROR and error["code"] == "malformed" and error["fatal"] is False
    assert "is not the peer's" in error["message"]
    assert notice_kind == 250 and notice == {"name": name, "offset": 0, "ticket": 1}
    assert released == 0  # the server wrote nothing into the segment


async def test_a_refused_reference_quotes_at_most_80_characters_of_its_segment_name():
    """A reference to a segment that cannot be opened (here a 300-character name) is refused
    (malformed, not fatal), and the reply quotes the peer's name cut short."""
    size = 50_000
    async with run_server(listen=["shm://"]) as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> tuple[int, dict]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.hello_with_zeros()
                me.send(MsgType.PUSH, {"timestamp": 0, "~shm": ["n" * 300, 4 * size, [["<f4", [size]]], 0, 7]})
                return next(reply for reply in iter(me.recv, None) if reply[0] != 250)  # not a RELEASE notice
            finally:
                me.close()

        kind, error = await asyncio.to_thread(learn)
    assert kind == MsgType.ERROR and error["code"] == "malformed" and error["fatal"] is False
    assert "'" + "n" * 76 + "..." in error["message"] and "n" * 77 not in error["message"]


async def test_a_ucx_send_cancelled_mid_frame_closes_the_connection():
    """A frame is several UCX messages: a send cancelled after some went out would make the
    peer read the next frame's messages as the rest of this one. The connection closes
    instead, and the receiver never gets a frame made of two."""
    from rudra_async_ucx import transport

    received, go, peers = [], asyncio.Event(), []

    async def on_connection(conn):
        peers.append(conn.peer)
        await go.wait()
        with contextlib.suppress(Exception):
            while True:
                frame = await asyncio.wait_for(conn.recv(), 5)
                received.append((frame.msg_type, [a.nbytes for a in frame.arrays]))
                frame.release()

    listener = await transport.listen("ucx://127.0.0.1:0", on_connection)
    other = await transport.connect(listener.address, timeout=10)
    conn = await transport.connect(listener.address, timeout=10)
    try:
        for i in range(8):  # the receiver's inbox fills: it stops posting receives
            await conn.send(1, {"i": i})
        cut = asyncio.ensure_future(conn.send(2, {}, [np.ones(64 << 20, np.uint8), np.full(24, 5, np.uint8)]))
        await asyncio.sleep(0.3)
        with pytest.raises(asyncio.TimeoutError):  # queued behind it: nothing of this frame went out
            await asyncio.wait_for(conn.send(3, {}), 0.3)
        assert not conn.is_closed
        cut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut
        assert conn.is_closed
        go.set()
        await asyncio.sleep(1.0)
        assert all(sizes in ([], [64 << 20, 24]) for _, sizes in received), received
        assert len(set(peers)) == 2, peers  # the server's logs tell the learners apart
    finally:
        other.close()
        conn.close()
        await listener.close()


def test_a_bad_ucx_progress_mode_is_a_config_error():
    code = "from rudra_async_ucx import _ucxx; _ucxx()"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**subprocess_env(), "RUDRA_ASYNC_UCX_PROGRESS": "bogus"})  # fmt: skip
    assert (
        "ConfigError: RUDRA_ASYNC_UCX_PROGRESS must be one of blocking, polling, thread, thread-polling, got 'bogus'"
        in proc.stderr
    )


async def test_a_release_notice_with_fields_of_the_wrong_type_is_ignored(caplog):
    """RELEASE notices whose offset is a list (unhashable), whose name is a map or whose
    ticket is a string free nothing and raise nothing (they used to end the connection
    with a traceback): the weights lent stay lent until the real notice, and the learner
    is served on."""
    size = 50_000
    async with run_server(listen=["shm://"], kernel="numpy") as ps:
        server_name = ps.addresses[0].removeprefix("shm://")

        def learn() -> tuple[int, dict]:
            me = DocsOnlyShmLearner(server_name, size)
            try:
                me.hello_with_zeros()
                me.send(MsgType.PULL, {"seq": 1})
                kind, meta = me.recv()
                assert kind == MsgType.WEIGHTS and "~shm" in meta  # lent, until the notice
                name, offset = meta["~shm"][0], meta["~shm"][3]
                for bad in ({"name": name, "offset": [offset]}, {"name": {"a": 1}}, {"name": name, "ticket": "t"}):
                    me.send(250, bad)
                me.read_weights(meta)  # then the real notice
                me.send(MsgType.PULL, {"seq": 2})
                return me.recv()
            finally:
                me.close()

        kind, meta = await asyncio.to_thread(learn)
    assert kind == MsgType.WEIGHTS and meta["seq"] == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

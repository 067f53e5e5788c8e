"""Large frames written by sender threads (rudra_async.transports.offload): the threshold,
and what a send that is cancelled or outlived by its connection leaves behind."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rudra_async import transports
from rudra_async.errors import ConfigError, ConnectionClosed, PeerGone
from rudra_async.testing import _send_until_blocked
from rudra_async.transports import offload
from rudra_async.wire import MsgType

MiB = 1 << 20


def test_the_threshold_comes_from_the_environment_and_is_checked():
    def threshold(value):
        return subprocess.run(
            [sys.executable, "-c", "from rudra_async.transports import offload; print(offload.min_bytes())"],
            env={**os.environ, offload.ENV: value},
            capture_output=True,
            text=True,
        )

    assert threshold("").stdout.strip() == str(offload.DEFAULT_MIN_BYTES)
    assert threshold("0").stdout.strip() == "0"
    assert threshold("1048576").stdout.strip() == "1048576"
    bad = threshold("4M")
    assert bad.returncode != 0 and "RUDRA_ASYNC_SEND_THREAD_BYTES must be a whole number of bytes" in bad.stderr
    with pytest.raises(ConfigError, match=">= 0"):
        offload.set_min_bytes(-1)


def test_which_frames_go_to_a_thread(send_threads):
    send_threads(MiB)
    assert offload.wanted(MiB) and offload.wanted(64 * MiB)
    assert not offload.wanted(MiB - 1) and not offload.wanted(0)
    send_threads(0)
    assert not offload.wanted(64 * MiB)


async def clogged_pair():
    """A tcp connection whose peer reads nothing (its handler holds it until the listener
    closes), and the peer's end."""
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def hold(conn):
        accepted.set_result(conn)
        await asyncio.Event().wait()

    tcp = transports.transport_for("tcp://")
    listener = await tcp.listen("tcp://127.0.0.1:0", hold)
    conn = await tcp.connect(listener.address)
    return listener, conn, await accepted


@pytest.mark.parametrize("how", ["cancelled", "closed"])
async def test_a_thread_write_that_is_abandoned_ends_the_connection_and_the_thread(how, send_threads):
    """A send stuck in a thread (its peer reads nothing) that is cancelled, or whose
    connection is closed, ends the connection: the peer sees it gone, and the thread stops
    writing instead of waiting for room forever."""
    send_threads(MiB)
    listener, conn, peer = await clogged_pair()
    try:
        blocked = await _send_until_blocked(conn, np.zeros(4 * MiB, np.uint8))
        assert send_threads.calls, "the frames should have been written by threads"
        assert send_threads.writing == 1
        if how == "cancelled":
            blocked.cancel()
            with pytest.raises(asyncio.CancelledError):
                await blocked
        else:
            conn.close()
            with pytest.raises(ConnectionClosed):
                await blocked
        assert conn.is_closed
        while True:  # the peer reads what was sent, then learns the connection is gone
            try:
                frame = await asyncio.wait_for(peer.recv(), 10)
            except PeerGone:
                break
            frame.release()
        for _ in range(100):  # the thread gives up within offload.STOP_CHECK_S
            if not send_threads.writing:
                break
            await asyncio.sleep(0.02)
        assert send_threads.writing == 0, "a sender thread still writes to an abandoned connection"
    finally:
        conn.close()
        await listener.close()


class StepGate:
    """A Gate the test opens by hand: ``final`` bytes of the body are final."""

    def __init__(self):
        self.final, self.error = 0, None
        self.changed = threading.Condition()

    def open_to(self, final=None, error=None):
        with self.changed:
            self.final, self.error = final if final is not None else self.final, error
            self.changed.notify_all()

    def wait(self, nbytes, timeout):
        with self.changed:
            self.changed.wait_for(lambda: self.final >= nbytes or self.error is not None, timeout)
            if self.error is not None:
                raise self.error
            return self.final


def read_available(sock, seconds=0.3):
    """Everything ``sock`` receives within ``seconds`` (stops early once nothing comes for 0.1 s)."""
    got, end = bytearray(), time.monotonic() + seconds
    sock.settimeout(0.1)
    while time.monotonic() < end:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return bytes(got)


def test_a_gated_body_goes_out_only_as_far_as_the_gate_says_it_is_final():
    a, b = socket.socketpair()
    a.setblocking(False)
    head, body = b"HEAD", np.arange(300_000, dtype=np.uint8)
    gate, stop = StepGate(), threading.Event()
    writer = threading.Thread(target=offload.write_all, args=(a, [head, memoryview(body)], stop, gate, len(head)))
    writer.start()
    try:
        seen = read_available(b)
        assert seen == head, "only the bytes before the body go out while none of it is final"
        gate.open_to(100_001)
        seen += read_available(b)
        assert seen == head + body[:100_001].tobytes()
        gate.open_to(body.nbytes)
        writer.join(10)
        seen += read_available(b)
        assert seen == head + body.tobytes() and not writer.is_alive()
    finally:
        gate.open_to(body.nbytes)
        writer.join(10)
        b.close()


@pytest.mark.parametrize("failure", ["computation", "close"])
async def test_a_send_whose_body_is_never_finished_ends_the_connection(failure, send_threads):
    """send_computing with a gate that fails (or a connection closed while the thread waits
    for the gate) raises, and the peer learns the connection is gone, not a torn frame."""
    send_threads(1)
    listener, conn, peer = await clogged_pair()
    gate = StepGate()
    try:
        body = np.ones(1000, np.float32)
        assert conn.sends_computing(body.nbytes)
        sending = asyncio.ensure_future(conn.send_computing(MsgType.WEIGHTS, {}, [body], gate))
        gate.open_to(400)
        await asyncio.sleep(0.2)
        assert not sending.done()
        if failure == "computation":
            gate.open_to(error=RuntimeError("the update of these weights failed"))
            with pytest.raises(RuntimeError, match="update of these weights failed"):
                await asyncio.wait_for(sending, 10)
        else:
            conn.close()
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(sending, 10)
        assert conn.is_closed
        with pytest.raises(PeerGone):
            await asyncio.wait_for(peer.recv(), 10)
    finally:
        conn.close()
        await listener.close()


async def test_only_a_connection_whose_thread_writes_sends_a_body_being_computed(send_threads):
    """(Over TLS no thread writes: tests/server/test_security.py checks that for every frame.)"""
    send_threads(1)
    listener, conn, _ = await clogged_pair()
    try:
        assert conn.sends_computing(10)
        send_threads(0)
        assert not conn.sends_computing(10 << 20)
        send_threads(1)
        conn.close()
        assert not conn.sends_computing(10)
    finally:
        await listener.close()


async def test_no_byte_of_a_cancelled_thread_write_goes_out_after_the_send_returned(send_threads, monkeypatch):
    """A sender thread may be between its look for a stop and its next ``sendmsg`` when its
    send is cancelled. Once the cancelled send has returned, the frame's memory may change
    (a server's lease on the weights ends), so no byte of it may go out after that: here the
    thread is held right before its first ``sendmsg`` until the send has returned, and the
    peer then receives nothing of the frame, only the end of the connection."""
    from rudra_async.transports.stream import StreamConnection

    send_threads(MiB)
    entered, go_on = threading.Event(), threading.Event()

    class Held(socket.socket):
        def sendmsg(self, *args):
            entered.set()
            go_on.wait(10)
            return super().sendmsg(*args)

    thread_socket = StreamConnection._thread_socket

    def held(self, body_bytes):
        sock = thread_socket(self, body_bytes)
        if sock is None:
            return None
        out = Held(fileno=sock.detach())
        out.settimeout(0.0)
        return out

    monkeypatch.setattr(StreamConnection, "_thread_socket", held)
    server = socket.create_server(("127.0.0.1", 0))
    try:
        conn = await transports.transport_for("tcp://").connect(f"tcp://127.0.0.1:{server.getsockname()[1]}")
        peer, _ = server.accept()
        sending = asyncio.ensure_future(conn.send(MsgType.WEIGHTS, {}, [np.ones(MiB // 4, np.float32)]))
        assert await asyncio.to_thread(entered.wait, 10), "the frame should have gone to a sender thread"
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        go_on.set()  # the thread's sendmsg goes on now, after the send returned
        for _ in range(100):
            if not send_threads.writing:
                break
            await asyncio.sleep(0.02)
        assert send_threads.writing == 0
        assert await asyncio.to_thread(read_available, peer, 1.0) == b""
        peer.close()
    finally:
        go_on.set()
        server.close()

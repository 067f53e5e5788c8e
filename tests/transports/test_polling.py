"""Busy polling after a send (rudra_async.transports.polling): who polls, when it stops
paying, and that a frame arrives intact whether the poll caught it or not."""

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future as concurrent_future

import numpy as np
import pytest

from rudra_async import eventloop, transports
from rudra_async.eventloop import run_sync
from rudra_async.transports import polling
from rudra_async.transports.blocking import BlockingConnection
from rudra_async.wire import FrameReader, Limits, MsgType, encode_frame


@pytest.fixture
def window():
    """Set the process's window for one test; the default comes back after it."""
    before = polling.window()
    yield polling.set_window
    polling.set_window(before)


def frame_bytes(msg_type=MsgType.ACK, meta=None, arrays=()):
    return b"".join(bytes(p) for p in encode_frame(msg_type, meta or {"seq": 1}, arrays))


def test_credit_turns_polling_off_and_probes_turn_it_back_on(window):
    window(1e-3)
    a = polling.Adaptive()
    assert a.polls()
    for _ in range(polling.CREDIT_MAX):
        a.caught()
    assert a.credit == polling.CREDIT_MAX
    misses = 0
    while a.polls():
        a.missed()
        misses += 1
    assert misses == polling.CREDIT_MAX // polling.MISS_COST
    decisions = [a.polls() for _ in range(3 * polling.PROBE_EVERY)]
    assert decisions.count(True) == 3  # one probe in PROBE_EVERY waits
    a.caught()  # a probe caught something
    assert a.polls() and a.polls()
    # one window in two catching something is not enough to keep polling
    a = polling.Adaptive()
    polled = 0
    for i in range(40 * polling.PROBE_EVERY):
        if a.polls():
            polled += 1
            if i % 2:
                a.caught()
            else:
                a.missed()
    assert polled < 40 * polling.PROBE_EVERY / 4
    window(0)
    assert not polling.Adaptive().polls()


def test_the_window_is_checked():
    with pytest.raises(polling.ConfigError, match="between 0 and 1 s"):
        polling.set_window(-1)
    bad = subprocess.run(
        [sys.executable, "-c", "import rudra_async.transports.polling"],
        env={**os.environ, polling.ENV: "fast"},
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "RUDRA_ASYNC_BUSY_POLL_US must be a number of microseconds" in bad.stderr
    read = subprocess.run(
        [sys.executable, "-c", "from rudra_async.transports import polling; print(polling.window())"],
        env={**os.environ, polling.ENV: "50"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert float(read.stdout) == pytest.approx(50e-6)


def blocking_pair():
    ours, theirs = socket.socketpair()
    return BlockingConnection(ours, Limits(), "pair"), theirs


def test_a_blocking_connection_polls_the_first_read_after_a_send(window):
    window(1.0)  # long enough for the peer's thread on a loaded host
    conn, peer = blocking_pair()
    try:
        credit = conn._polling.credit
        grad = np.arange(1000, dtype=np.float32)

        def answer():
            reader = FrameReader(Limits())
            frames = []
            while not frames:
                n = peer.recv_into(reader.get_buffer())
                frames = reader.advance(n)
            # answer once the read is surely polling: a reply already there when it looks is
            # neither a catch nor a miss (below), which made this test flaky on a busy host
            time.sleep(0.2)
            peer.sendall(frame_bytes(MsgType.WEIGHTS, {"seq": 1}, [frames[0].arrays[0] * 2]))

        helper = threading.Thread(target=answer)
        helper.start()
        run_sync(conn.send(MsgType.PUSH, {"seq": 1}, [grad]))
        frame = run_sync(conn.recv())
        helper.join()
        np.testing.assert_array_equal(frame.arrays[0], grad * 2)
        assert conn._polling.credit == credit + 1  # the poll caught the reply

        # frames that come without a send are read as they come: no poll, no credit change
        peer.sendall(frame_bytes() + frame_bytes())
        run_sync(conn.recv())
        run_sync(conn.recv())
        assert conn._polling.credit == credit + 1
        # a reply already there when the read looks: no wait, so neither a catch nor a miss
        run_sync(conn.send(MsgType.PULL, {"seq": 2}))
        peer.sendall(frame_bytes())
        time.sleep(0.05)
        run_sync(conn.recv())
        assert conn._polling.credit == credit + 1
    finally:
        conn.close()
        peer.close()


def test_a_reply_later_than_the_window_is_read_by_the_blocking_read(window):
    window(1e-4)
    conn, peer = blocking_pair()
    try:
        credit = conn._polling.credit
        reply = frame_bytes(MsgType.WEIGHTS, {"seq": 1}, [np.ones(300_000, np.float32)])
        late = threading.Timer(0.3, lambda: peer.sendall(reply))
        late.start()
        run_sync(conn.send(MsgType.PULL, {"seq": 1}))
        frame = run_sync(conn.recv())
        late.join()
        assert frame.arrays[0].sum() == 300_000
        assert conn._polling.credit == credit - polling.MISS_COST

        conn.settimeout(5.0)  # a deadline (as during the hello): the read blocks at once
        late = threading.Timer(0.05, lambda: peer.sendall(reply))
        late.start()
        run_sync(conn.send(MsgType.PULL, {"seq": 2}))
        run_sync(conn.recv())
        late.join()
        assert conn._polling.credit == credit - polling.MISS_COST  # no window spent
    finally:
        conn.close()
        peer.close()


async def test_the_loop_polls_until_an_arrival_or_the_end_of_the_window(window):
    window(0.01)
    poller = polling.LoopPoller()
    credit = poller._adaptive.credit
    ticks = 0
    tick = poller._tick

    def counted():
        nonlocal ticks
        ticks += 1
        tick()

    poller._tick = counted  # type: ignore[method-assign]
    poller.sent()
    await asyncio.sleep(0.05)  # a loop left alone would sleep through this in one wait
    assert ticks > 20 and not poller._ticking
    assert poller._adaptive.credit == credit - polling.MISS_COST
    poller.sent()
    await asyncio.sleep(0)
    poller.arrived()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not poller._ticking and poller._adaptive.credit == credit - polling.MISS_COST + 1


class EchoThread:
    """An echo peer on its own event loop in a thread (so its loop, and its poller, are not
    ours); ``delay``: seconds before each reply."""

    def __init__(self, url):
        self.delay = 0.0
        self._address = concurrent_future()
        self._stop = None
        self._thread = threading.Thread(target=lambda: eventloop.run(self._main(url)), daemon=True)
        self._thread.start()
        self.address = self._address.result(timeout=30)

    async def _main(self, url):
        async def echo(conn):
            while True:
                frame = await conn.recv()
                if self.delay:
                    await asyncio.sleep(self.delay)
                await conn.send(frame.msg_type, {"n": frame.meta["n"]}, frame.arrays)
                frame.release()

        self._stop = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        listener = await transports.listen(url, echo)
        self._address.set_result(listener.address)
        await self._stop.wait()
        await listener.close()

    def close(self):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "shm://"])
async def test_a_quick_peer_keeps_the_loop_polling_and_a_slow_one_stops_it(url, window):
    """Over a real connection: replies within the window keep polling on; replies slower
    than it turn it off (but for probes); every frame arrives intact either way."""
    window(0.2)
    peer = EchoThread(url)
    conn = await transports.connect(peer.address, limits=Limits(), timeout=10)
    try:
        poller = polling.loop_poller()
        body = np.arange(100_000, dtype=np.float32)  # shm: through a segment

        async def round_trips(n):
            for i in range(n):
                await conn.send(MsgType.PUSH, {"n": i}, [body])
                frame = await conn.recv()
                assert frame.meta["n"] == i
                np.testing.assert_array_equal(frame.arrays[0], body)
                frame.release()

        await round_trips(20)
        # on a loaded host one stalled reply may miss its window
        assert poller._adaptive.credit >= polling.CREDIT_MAX - polling.MISS_COST
        window(1e-4)
        peer.delay = 0.01
        await round_trips(12)
        assert poller._adaptive.credit == 0
        assert sum(poller._adaptive.polls() for _ in range(2 * polling.PROBE_EVERY)) == 2
    finally:
        conn.close()
        peer.close()


def test_a_closed_loop_is_freed(window):
    """The poller of a loop that opened connections holds no reference to it."""
    import gc

    window(1e-3)

    async def open_and_close():
        async def serve(conn):
            await conn.recv()

        listener = await transports.listen("tcp://127.0.0.1:0", serve)
        conn = await transports.connect(listener.address, limits=Limits(), timeout=10)
        await conn.send(MsgType.PULL, {"seq": 1})
        conn.close()
        await listener.close()
        return weakref.ref(asyncio.get_running_loop())

    loop = eventloop.new_event_loop()
    ref = loop.run_until_complete(open_and_close())
    loop.close()
    del loop
    gc.collect()
    assert ref() is None

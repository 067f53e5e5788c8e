"""Large frames written by sender threads (rudra_async.transports.offload): the threshold,
and what a send that is cancelled or outlived by its connection leaves behind."""

import asyncio
import os
import subprocess
import sys

import numpy as np
import pytest

from rudra_async import transports
from rudra_async.errors import ConfigError, ConnectionClosed, PeerGone
from rudra_async.testing import _send_until_blocked
from rudra_async.transports import offload

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

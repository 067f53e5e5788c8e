"""The blocking client: the asyncio client's code on a blocking socket (tcp, shm) or on a
private event loop (other transports), with the same results and the same errors."""

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest
from helpers import free_port, initial_weights, server_thread, small_layout

from rudra_async.client import SyncClient
from rudra_async.errors import ConnectError, ConnectionClosed, PeerGone
from rudra_async.eventloop import run_sync
from rudra_async.transports.blocking import BlockingConnection


@pytest.mark.parametrize("scheme", ["tcp", "shm"])
def test_both_paths_train_alike(scheme):
    layout, grad = small_layout(), np.full(small_layout().size, 0.5, np.float32)
    listen = "tcp://127.0.0.1:0" if scheme == "tcp" else "shm://"
    with (
        server_thread(listen=[listen], lr=0.1, momentum=0.0, kernel="numpy") as ps,
        SyncClient(ps.addresses[0], layout, initial_weights(layout)) as client,
    ):
        assert isinstance(client._client.conn, BlockingConnection)  # no event loop in the learner
        w = client.pull()
        for _ in range(3):
            w = client.push_pull(grad, w.timestamp)
        ack = client.push(grad, w.timestamp)
        assert (w.timestamp, ack.status, ack.staleness) == (3, "applied", 0)
        np.testing.assert_allclose(client.pull().array, initial_weights(layout) - 0.4 * grad, rtol=1e-6)


def test_blocking_shm_moves_large_bodies_through_shared_memory_and_leaves_nothing():
    """Gradient and weights larger than what goes inline: the gradient through the client's
    own segment (reused), the weights read from the server's; both sides' results exact."""
    from rudra_async.layout import Layout
    from rudra_async.transports import shm

    n = 100_000  # 400 kB each way, far above shm.INLINE
    layout = Layout.from_shapes([("w", (n,))])
    start = np.linspace(-1, 1, n, dtype=np.float32)
    grad = np.linspace(0, 1, n, dtype=np.float32)
    before = set(os.listdir("/dev/shm"))
    with server_thread(listen=["shm://"], lr=0.5, momentum=0.0, kernel="numpy") as ps:
        with SyncClient(ps.addresses[0], layout, start) as client:
            conn = client._client.conn
            assert isinstance(conn, shm.BlockingShmConnection)
            w = client.pull()
            expected = start.copy()
            for _ in range(5):
                w = client.push_pull(grad, w.timestamp)
                expected -= np.float32(0.5) * grad
                np.testing.assert_array_equal(w.array, expected)  # this learner's own update, in its buffer
            assert len(conn._out.segments) == 1  # the gradient's segment, allocated once
        np.testing.assert_array_equal(ps.weights()["w"], expected)
    assert set(os.listdir("/dev/shm")) <= before  # every segment unlinked


def test_a_gradient_applied_on_the_update_thread_frees_its_segment_before_the_reply_is_whole():
    """A model large enough for background updates, whose reply goes out while its update is
    computed: the update thread stores the gradient's ticket before it publishes the last
    piece, so a learner pushing again at once (no compute between) reuses its one segment
    rather than making a second model-sized one, and every update is still exact."""
    from rudra_async.layout import Layout
    from rudra_async.server.store import BACKGROUND_MIN_VALUES

    n = BACKGROUND_MIN_VALUES
    layout = Layout.from_shapes([("w", (n,))])
    grad = np.full(n, 2.0**-4, np.float32)
    with server_thread(listen=["shm://"], lr=0.5, momentum=0.0, lr_policy="constant", kernel="numpy") as ps:
        assert not ps.core.store or not ps.core.store.updates_inline
        with SyncClient(ps.addresses[0], layout, np.zeros(n, np.float32)) as client:
            conn = client._client.conn
            w = client.pull()
            for step in range(1, 9):
                w = client.push_pull(grad, w.timestamp)
                assert w.array[0] == w.array[-1] == -step * 2.0**-5
            assert not ps.core.store.updates_inline
            assert len(conn._out.segments) == 1


def test_blocking_shm_refuses_tls_and_a_name_nobody_serves():
    from rudra_async.errors import ConfigError

    with pytest.raises(ConnectError, match=r"cannot connect to shm://nobody-here"):
        SyncClient("shm://nobody-here", small_layout())
    with pytest.raises(ConfigError, match="TLS is for tcp"):
        SyncClient("shm://x", small_layout(), tls=__import__("ssl").create_default_context())


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://"])
def test_a_lost_server_and_a_closed_client_raise_the_transport_errors(listen):
    layout = small_layout()
    with server_thread(listen=[listen], lr=0.1, kernel="numpy") as ps:
        client = SyncClient(ps.addresses[0], layout, initial_weights(layout))
        client.pull()
    with pytest.raises(PeerGone):  # the server closed every connection (over tcp it said why first)
        client.pull()
    client.close()
    with pytest.raises(ConnectionClosed):
        client.pull()


def test_a_refused_address_and_a_silent_server_are_clear_errors():
    with pytest.raises(ConnectError, match=r"cannot connect to tcp://127\.0\.0\.1:"):
        SyncClient(f"tcp://127.0.0.1:{free_port()}", small_layout())
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(ConnectError, match=r"sent no WELCOME within 0\.5 s \(is it a rudra-async server\?\)"):
            SyncClient(f"tcp://127.0.0.1:{port}", small_layout(), timeout=0.5)


def test_run_sync_refuses_a_coroutine_that_needs_an_event_loop():
    import asyncio

    async def sleeps():
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="needs an event loop"):
        run_sync(sleeps())


def test_concurrent_blocking_clients_in_threads():
    layout = small_layout()
    grad = np.full(layout.size, 1e-3, np.float32)
    with server_thread(lr=0.1, momentum=0.0, kernel="numpy") as ps:
        SyncClient(ps.addresses[0], layout, initial_weights(layout)).close()  # initializes the weights

        def learner():
            with SyncClient(ps.addresses[0], layout) as client:
                w = client.pull()
                for _ in range(50):
                    w = client.push_pull(grad, w.timestamp)

        threads = [threading.Thread(target=learner) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert ps.clock == 200


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://"])
async def test_close_gives_a_server_that_stopped_answering_a_deadline(monkeypatch, listen):
    """The server runs on this test's event loop, blocked while close() runs in a thread: its
    BYE goes unanswered, and close() still returns, after ``BYE_TIMEOUT_S``."""
    import asyncio
    import time

    from helpers import run_server

    from rudra_async import client as client_module

    monkeypatch.setattr(client_module, "BYE_TIMEOUT_S", 0.3)
    layout = small_layout()
    async with run_server(listen=[listen], kernel="numpy") as ps:
        client = await asyncio.to_thread(SyncClient, ps.addresses[0], layout, initial_weights(layout))
        closing = threading.Thread(target=client.close)
        started = time.monotonic()
        closing.start()
        closing.join(5)  # blocks the server's event loop meanwhile
        assert not closing.is_alive() and time.monotonic() - started < 3
        assert client._client.conn.is_closed


def test_close_twice_is_harmless_and_a_closed_client_says_so():
    """Over a private event loop (a shard group) as over a blocking socket."""
    import contextlib

    from rudra_async.layout import Shard

    layout = small_layout()
    with contextlib.ExitStack() as stack:
        shards = [stack.enter_context(server_thread(kernel="numpy", shard=Shard(i, 2))) for i in range(2)]
        single = stack.enter_context(server_thread(kernel="numpy"))
        for url in (",".join(ps.addresses[0] for ps in shards), single.addresses[0]):
            with SyncClient(url, layout, initial_weights(layout)) as client:
                client.pull()
                client.close()
                client.close()
            with pytest.raises(ConnectionClosed):
                client.pull()


def test_an_interrupted_private_loop_cancels_its_coroutine_and_runs_the_next():
    """Ctrl-C while a SyncClient's private loop waits cancels the request then and there (its
    cancellation closes the connection), instead of leaving it to resume under the next call."""
    from rudra_async.eventloop import PrivateLoop

    private, cancelled = PrivateLoop(), []

    async def waits():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    def interrupt():
        raise KeyboardInterrupt

    private.loop.call_later(0.01, interrupt)
    with pytest.raises(KeyboardInterrupt):
        private.run(waits())
    assert cancelled == [True]
    assert private.run(asyncio.sleep(0, "next")) == "next"
    private.close()


def test_a_second_ctrl_c_during_the_cancellation_still_ends_the_coroutine():
    """Interrupted again while its cancellation runs, the coroutine is cancelled again: it
    never goes on under a later call."""
    from rudra_async.eventloop import PrivateLoop

    private, events = PrivateLoop(), []

    async def waits():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            events.append("cancelled")
            await asyncio.sleep(0.5)  # its clean-up, cut short by the second Ctrl-C
            events.append("cleaned up")
            raise

    def interrupt():
        raise KeyboardInterrupt

    private.loop.call_later(0.01, interrupt)
    private.loop.call_later(0.05, interrupt)
    with pytest.raises(KeyboardInterrupt):
        private.run(waits())
    private.run(asyncio.sleep(0.6))  # time enough for a clean-up left pending to go on
    assert events == ["cancelled"]
    private.close()


def test_a_private_loop_run_inside_a_running_loop_fails_at_once():
    """A private loop cannot run inside another running loop: the caller gets a clear error
    at once (it used to spin, cancelling a task that could never run)."""
    from rudra_async.eventloop import PrivateLoop

    private = PrivateLoop()

    async def inside():
        with pytest.raises(RuntimeError, match="cannot run inside a running event loop"):
            private.run(asyncio.sleep(0))

    started = time.monotonic()
    asyncio.run(inside())
    assert time.monotonic() - started < 5
    assert private.run(asyncio.sleep(0, "usable")) == "usable"  # outside, it runs as ever
    private.close()


def test_a_reconnect_seeds_a_server_restarted_without_its_checkpoint_with_the_learners_weights():
    """A server restarted without a checkpoint takes its weights from the first hello: after
    a reconnect that is the weights the learner last had, not the run's first ones (a
    restarted shard of a group would otherwise go back to the start while the others go on)."""
    layout, port = small_layout(), free_port()
    w0 = initial_weights(layout)
    with server_thread(listen=[f"tcp://127.0.0.1:{port}"], lr=0.1, momentum=0.0, kernel="numpy"):
        client = SyncClient(f"tcp://127.0.0.1:{port}", layout, w0)
        w = client.pull()
        for _ in range(3):
            w = client.push_pull(np.ones(layout.size, np.float32), w.timestamp)
        trained = client.weights.copy()
    assert not np.array_equal(trained, w0)
    with server_thread(listen=[f"tcp://127.0.0.1:{port}"], lr=0.1, momentum=0.0, kernel="numpy") as second:
        again = client.reconnect(10)
        assert again.timestamp == 0 and np.array_equal(client.weights, trained)
        np.testing.assert_array_equal(second.core.store.weights, trained)
        client.close()

"""Updates computed on the background thread: readers wait for them, gradients are kept until
they are read, results equal the event-loop path bit for bit, a cancelled wait loses nothing."""

import asyncio
import threading
import time

import numpy as np
import pytest
from helpers import run_server

from rudra_async import errors as rudra_errors
from rudra_async.config import ServerConfig
from rudra_async.kernels import SGD, Group
from rudra_async.layout import Layout
from rudra_async.server import ParameterServer, store
from rudra_async.server.store import Background, WeightStore

N = 1000
LAYOUT = Layout.from_shapes([("a", (600,)), ("b", (400,))])
STEPS = [Group(0, 600, SGD(0.1, 0.9, 0.01, nesterov=True)), Group(600, N, SGD(0.05, 0.9, 0.0))]


class GatedBackground(Background):
    """Jobs wait for ``gate`` before they run; ``woken`` counts the wake calls."""

    def __init__(self):
        self.woken = 0
        super().__init__(self._count)
        self.gate = threading.Event()

    def _count(self):
        self.woken += 1

    def submit(self, fn, *args):
        def gated():
            assert self.gate.wait(10), "the test never opened the gate"
            return fn(*args)

        return super().submit(gated)


@pytest.fixture
def off_loop(monkeypatch):
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)


def open_gate_later(background, seconds=0.2):
    timer = threading.Timer(seconds, background.gate.set)
    timer.start()
    return timer


@pytest.mark.parametrize("reader", ["weights", "lease", "next update"])
def test_every_reader_waits_for_the_update_and_the_gradient_is_kept_until_it_is_read(off_loop, reader):
    background = GatedBackground()
    ws = WeightStore(LAYOUT, np.zeros(N, np.float32), "numpy", background=background)
    released = []
    ws.apply([np.ones(N, np.float32)], [1.0], STEPS, after=[lambda: released.append(1)])
    assert ws.clock == 1 and ws.in_flight is not None and not ws.in_flight.done()
    ws.reap()  # never waits
    assert released == [] and ws.in_flight is not None
    timer = open_gate_later(background)
    if reader == "weights":
        seen = ws.weights.copy()
    elif reader == "lease":
        with ws.lease() as (clock, held):
            assert clock == 1
            seen = held.copy()
    else:
        ws.apply([np.zeros(N, np.float32)], [1.0], SGD(0.0), after=[lambda: released.append(2)])
        seen = ws.weights.copy()
    timer.join()
    assert released[0] == 1, "the gradient was released before the update read it"
    np.testing.assert_allclose(seen[:600], -0.19, rtol=1e-6)  # Nesterov: 0.1 · (1 + 0.9 · 1)
    np.testing.assert_allclose(seen[600:], -0.05, rtol=1e-6)
    assert background.woken >= 1 and ws.in_flight is None
    ws.close()
    background.close()


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def test_background_updates_equal_the_inline_ones_bit_for_bit(off_loop, kernel):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(N).astype(np.float32)
    background = Background()
    inline = WeightStore(LAYOUT, w0, kernel)
    threaded = WeightStore(LAYOUT, w0, kernel, background=background)
    for step in range(20):
        grads = [rng.standard_normal(N).astype(np.float32) for _ in range(1 + step % 3)]
        scales = [1.0 / len(grads)] * len(grads)
        with threaded.lease() if step % 4 == 0 else _nothing():  # some updates go to a spare buffer
            threaded.apply(grads, scales, STEPS)
        inline.apply(grads, scales, STEPS)
    assert threaded.clock == inline.clock == 20
    np.testing.assert_array_equal(threaded.weights, inline.weights)
    np.testing.assert_array_equal(threaded.updater.momentum, inline.updater.momentum)
    assert threaded.update_seconds > 0
    threaded.close()
    background.close()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


async def test_a_cancelled_wait_does_not_cancel_a_queued_update(off_loop):
    ps = ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"]), initial={"w": np.zeros(N, np.float32)})
    await ps.start()
    try:
        blocker = threading.Event()
        ps.pipeline.background.submit(blocker.wait, 10)  # the update queues behind this job
        ws = ps.core.store
        ws.apply([np.ones(N, np.float32)], [1.0], SGD(0.5))
        waiter = asyncio.ensure_future(ps.pipeline.updates_computed())
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.05)  # the cancellation has gone as far as it goes
        blocker.set()
        np.testing.assert_array_equal(ws.weights, np.full(N, -0.5, np.float32))
    finally:
        await ps.close()


def test_small_models_stay_on_the_callers_thread():
    background = GatedBackground()  # a job here would hang until the gate's 10 s timeout
    ws = WeightStore(LAYOUT, np.zeros(N, np.float32), "numpy", background=background)
    ws.apply([np.ones(N, np.float32)], [1.0], SGD(0.1))
    assert ws.in_flight is None and background.woken == 0
    np.testing.assert_allclose(ws.weights, -0.1)
    background.close()


async def test_a_reader_waits_on_the_loop_for_updates_decided_while_it_waited(off_loop):
    """The pull's path: ``updates_computed`` then a lease with no await between. An update
    decided while the reader waited must be waited for too, or the lease would block the
    event loop on the update thread (measured: ~40% of a loaded server's loop time, before)."""
    ps = ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"]), initial={"w": np.zeros(N, np.float32)})
    await ps.start()
    try:
        first, second = threading.Event(), threading.Event()
        ws = ps.core.store
        ps.pipeline.background.submit(first.wait, 10)  # update 1 queues behind this job
        ws.apply([np.ones(N, np.float32)], [1.0], SGD(0.5))
        waiter = asyncio.ensure_future(ps.pipeline.updates_computed())
        await asyncio.sleep(0.02)
        timer = threading.Timer(0.05, first.set)
        timer.start()
        ps.pipeline.background.submit(second.wait, 10)  # update 2 will queue behind this one
        ws.apply([np.ones(N, np.float32)], [1.0], SGD(0.5))  # decided as soon as update 1 is computed
        timer.join()
        await asyncio.sleep(0.05)  # the waiter has seen update 1 computed
        assert not waiter.done(), "the reader must also wait for the update decided while it waited"
        second.set()
        await asyncio.wait_for(waiter, 5)
        assert ws.in_flight is None or ws.in_flight.done()  # so a lease now returns at once
        with ws.lease() as (clock, weights):
            assert clock == 2
            np.testing.assert_array_equal(weights, np.full(N, -1.0, np.float32))
    finally:
        await ps.close()


@pytest.mark.parametrize("arrival", ["together", "during the update"])
async def test_a_push_that_arrives_during_an_update_is_checked_and_never_blocks_the_event_loop(off_loop, arrival):
    """The first push's update is computed (slowly, here) while the second push is checked
    and waits to be decided; the loop must go on serving meanwhile, not wait in the store.
    ``together``: both gradients were checked before the first update started;
    ``during the update``: the second arrives once the first update is running."""
    from rudra_async.client import Client

    hold, running = threading.Event(), threading.Event()
    ps = ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"]), initial={"w": np.zeros(N, np.float32)})
    await ps.start()
    updater = ps.core.store.updater
    slow_apply = updater.apply

    def held_apply(*args, **kwargs):
        running.set()
        assert hold.wait(10)
        slow_apply(*args, **kwargs)

    updater.apply = held_apply
    measured = []
    measure = ps.core.measure
    ps.core.measure = lambda grad: measured.append(1) or measure(grad)
    blocker = threading.Event()
    gaps, ticking = [], True

    async def tick():
        last = asyncio.get_running_loop().time()
        while ticking:
            await asyncio.sleep(0.01)
            now = asyncio.get_running_loop().time()
            gaps.append(now - last)
            last = now

    layout = Layout.from_shapes([("w", (N,))])
    a, b = await Client.connect(ps.addresses[0], layout), await Client.connect(ps.addresses[0], layout)
    ticker = asyncio.ensure_future(tick())
    g = np.ones(N, np.float32)
    try:
        if arrival == "together":
            ps.pipeline.background.check(blocker.wait, 10)  # both checks queue behind this job
            pushes = [asyncio.ensure_future(c.push(g, 0)) for c in (a, b)]
            await asyncio.sleep(0.1)
            blocker.set()  # check 1, check 2, update 1 (held) ... then update 2 is decided
        else:
            pushes = [asyncio.ensure_future(a.push(g, 0))]
            assert await asyncio.to_thread(running.wait, 5), "update 1 never started"
            pushes.append(asyncio.ensure_future(b.push(g, 0)))
        await asyncio.sleep(0.1)
        gaps.clear()
        await asyncio.sleep(0.6)  # update 1 is held all this time
        assert gaps and max(gaps) < 0.3, f"the event loop stalled for {max(gaps, default=0):.2f} s"
        assert len(measured) == 2, "the second gradient is checked while the first update is computed"
        hold.set()
        acks = await asyncio.wait_for(asyncio.gather(*pushes), 10)
        assert sorted(ack.status for ack in acks) == ["applied", "applied"]
        assert ps.clock == 2
    finally:
        hold.set()
        blocker.set()
        ticking = False
        await ticker
        await a.close()
        await b.close()
        await ps.close()


def test_a_lease_taken_while_the_update_is_computed_sees_each_piece_once_it_is_final(off_loop, monkeypatch):
    """lease_computing does not wait for the update in flight: its progress grows piece by
    piece, every byte it calls final holds the update's value already, and the finished
    buffer equals the update computed inline."""
    monkeypatch.setattr(store, "PIECE_VALUES", 250)
    background, steps = Background(), threading.Semaphore(0)
    ws = WeightStore(LAYOUT, np.zeros(N, np.float32), "numpy", background=background)
    inline = WeightStore(LAYOUT, np.zeros(N, np.float32), "numpy")
    whole = ws.updater.apply

    def one_piece_per_permit(*args, **kwargs):
        assert steps.acquire(timeout=10)
        whole(*args, **kwargs)

    ws.updater.apply = one_piece_per_permit
    g = np.random.default_rng(4).standard_normal(N).astype(np.float32)
    ws.apply([g], [1.0], STEPS)
    inline.apply([g], [1.0], STEPS)
    expected = inline.weights
    with ws.lease_computing() as (clock, weights, progress):
        assert clock == 1 and progress is not None
        assert progress.wait(1, 0.05) == 0, "nothing is final before the first piece is computed"
        for piece in range(1, 5):
            steps.release()
            final = progress.wait(1000 * piece, 10)
            assert final == 1000 * piece  # 250 values of 4 bytes per piece
            np.testing.assert_array_equal(weights[: final // 4], expected[: final // 4])
    assert ws.in_flight is not None
    ws.finish()
    with ws.lease_computing() as (_, weights, progress):
        assert progress is None  # nothing in flight: every byte is final
        np.testing.assert_array_equal(weights, expected)
    ws.close()
    background.close()


@pytest.mark.parametrize("kernel", ["numpy", "torch"])
def test_an_update_into_a_spare_buffer_is_copied_ahead_and_gives_the_same_bits(off_loop, monkeypatch, kernel):
    """While the published weights are leased, the update goes into a spare buffer: the
    check thread copies the weights there span by span and the update thread steps each
    span in place. The leased buffer never changes, and every update (spare or in place)
    equals the same updates computed inline, bit for bit."""
    monkeypatch.setattr(store, "PIECE_VALUES", 250)  # numpy: 4 spans; torch: one (its grain is 2^20)
    background = Background()
    copies = []
    check = background.check
    background.check = lambda fn, *args: copies.append(fn) or check(fn, *args)
    rng = np.random.default_rng(5)
    w0 = rng.standard_normal(N).astype(np.float32)
    ws = WeightStore(LAYOUT, w0, kernel, background=background)
    inline = WeightStore(LAYOUT, w0, kernel)
    for step in range(3):
        g = rng.standard_normal(N).astype(np.float32)
        inline.apply([g], [1.0], STEPS)
        if step == 1:  # in place: nothing leased
            ws.apply([g], [1.0], STEPS)
            continue
        with ws.lease() as (_, held):
            before = held.copy()
            ws.apply([g], [1.0], STEPS)
            ws.finish()
            np.testing.assert_array_equal(held, before)
        np.testing.assert_array_equal(ws.weights, inline.weights)
    np.testing.assert_array_equal(ws.weights, inline.weights)
    np.testing.assert_array_equal(ws.updater.momentum, inline.updater.momentum)
    assert copies.count(np.copyto) == 2 * (4 if kernel == "numpy" else 1)
    ws.close()
    background.close()


def test_the_progress_of_a_failed_update_raises_for_its_readers(off_loop):
    background = Background()
    ws = WeightStore(LAYOUT, np.zeros(N, np.float32), "numpy", background=background)

    def broken(*args, **kwargs):
        raise MemoryError("no room")

    ws.updater.apply = broken
    ws.apply([np.ones(N, np.float32)], [1.0], STEPS)
    with ws.lease_computing() as (_, _, progress), pytest.raises(RuntimeError, match=r"update .* failed.*no room"):
        progress.wait(4 * N, 10)
    with pytest.raises(rudra_errors.UpdateFailed, match="no room") as failed:
        ws.finish()
    assert isinstance(failed.value.__cause__, MemoryError) and ws.failure is failed.value

    def lease():
        with ws.lease():
            pass

    for later in (ws.finish, lease, lambda: ws.apply([np.ones(N, np.float32)], [1.0], STEPS)):
        with pytest.raises(rudra_errors.UpdateFailed):  # the weights are undefined: nothing reads or updates them
            later()
    assert ws.clock == 1
    ws.close()
    background.close()


async def test_replies_written_while_their_updates_are_computed_are_exact_and_never_torn(
    off_loop, send_threads, monkeypatch
):
    """Two learners push_pull over tcp, one of them pausing after each reply; a reply is
    written by a sender thread while its update is computed piece by piece (slowly)
    whenever the other learner has no request in progress, and the other's update then
    goes into a spare buffer. Each reply must equal, bit for bit, the weights of the clock
    it is stamped with, replayed inline from the updates in the order the server decided them."""
    from rudra_async.client import Client

    send_threads(1)
    monkeypatch.setattr(store, "PIECE_VALUES", 100)
    partial_waits = []
    wait = store.Progress.wait

    def spying_wait(self, nbytes, timeout):
        final = wait(self, nbytes, timeout)
        partial_waits.append(final < self.nbytes)
        return final

    monkeypatch.setattr(store.Progress, "wait", spying_wait)
    cfg = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "kernel": "numpy", "lr_policy": "constant"}
    w0 = np.random.default_rng(5).standard_normal(N).astype(np.float32)
    layout = Layout.from_shapes([("w", (N,))])
    decided = []  # the gradients, in the order the server applied them
    async with run_server(**cfg) as ps:
        a = await Client.connect(ps.addresses[0], layout, w0)
        b = await Client.connect(ps.addresses[0], layout)
        ws = ps.core.store
        apply, piece = ws.apply, ws.updater.apply
        ws.apply = lambda grads, *args, **kwargs: decided.append(grads[0].copy()) or apply(grads, *args, **kwargs)

        def slow_piece(*args, **kwargs):
            time.sleep(0.002)
            piece(*args, **kwargs)

        ws.updater.apply = slow_piece
        spares = []  # updates that found the weights leased
        spare = ws._spare
        ws._spare = lambda: spares.append(1) or spare()
        replies = []

        async def learner(client, seed, pause):
            rng = np.random.default_rng(seed)
            w = await client.pull()
            for step in range(8):
                w = await client.push_pull(rng.standard_normal(N).astype(np.float32), w.timestamp, step)
                replies.append((w.timestamp, w.array.copy()))
                await asyncio.sleep(pause)  # computing: no request in progress

        await asyncio.gather(learner(a, 1, 0.0), learner(b, 2, 0.03))
        await a.close()
        await b.close()
    assert any(partial_waits), "no reply was written while its update was being computed"
    assert spares, "no update went into a spare buffer: nothing could have torn a reply"
    assert all(name.startswith("rudra-send") for name in send_threads.calls)
    reference = WeightStore(layout, w0, "numpy")
    at_clock = {0: w0}
    for g in decided:
        reference.apply([g], [1.0], SGD(0.1, 0.9, 0.01))
        at_clock[reference.clock] = reference.weights.copy()
    assert len(decided) == 16 and len(replies) == 16
    for clock, weights in replies:
        np.testing.assert_array_equal(weights, at_clock[clock], err_msg=f"reply stamped {clock}")


@pytest.mark.parametrize("scheme", ["shm://", "memory://"])
async def test_a_reply_that_waited_for_its_update_goes_out_whole_even_before_the_update_is_reaped(off_loop, scheme):
    """A learner that cannot take a body still being computed (an asyncio client over shm,
    whose HELLO does not ask for progress words; any memory:// learner) gets its WEIGHTS
    only once the update is computed. If the update is computed but not yet reaped on the
    loop when the reply is sent, the reply must still go out as a finished body (it once
    went out "being computed": a progress word over shm, NotImplementedError over memory)."""
    from rudra_async.client import Client

    n = 100_000  # over shm, a body that goes by reference
    layout = Layout.from_shapes([("w", (n,))])
    async with run_server(listen=[scheme + ("" if scheme == "shm://" else "reap")], lr=0.5, momentum=0.0) as ps:
        loop = asyncio.get_running_loop()
        reap = ps.pipeline.reap
        ps.pipeline.background.wake = lambda: loop.call_soon_threadsafe(loop.call_later, 0.3, reap)  # a busy loop
        a = await Client.connect(ps.addresses[0], layout, np.zeros(n, np.float32))
        b = await Client.connect(ps.addresses[0], layout)
        await a.push(np.ones(n, np.float32), 0)
        await asyncio.sleep(0.1)
        assert ps.core.store.in_flight.done() and ps.core.store._progress is not None  # computed, not reaped
        w = await asyncio.wait_for(b.pull(), 5)
        assert w.timestamp == 1
        np.testing.assert_array_equal(w.array, np.full(n, -0.5, np.float32))
        await a.close()
        await b.close()


async def test_a_reply_cut_off_by_the_deadline_never_reaches_the_learner_with_a_later_update_in_it(send_threads):
    """tcp, a WEIGHTS reply written by the loop to a learner that stops reading: the
    ``reply_not_read`` deadline closes the connection and the lease on the weights ends, so
    the next update writes that buffer in place. Whatever of the frame the transport still
    held must be dropped, not flushed: a learner reading on must never receive a whole
    frame stamped with one clock and holding another's values."""
    import socket

    from rudra_async.client import Client
    from rudra_async.wire import MsgType

    send_threads(0)  # the loop writes every frame
    n = 1_500_000  # 6 MB, updated on the loop (below BACKGROUND_MIN_VALUES)
    layout = Layout.from_shapes([("w", (n,))])
    async with run_server(lr=1.0, momentum=0.0, kernel="numpy", idle_timeout=0.5) as ps:
        b = await Client.connect(ps.addresses[0], layout, np.zeros(n, np.float32))
        a = await Client.connect(ps.addresses[0], layout)
        a.conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 18)
        a.conn._transport.pause_reading()  # A stops reading: most of its reply stays with the server
        await a.conn.send(MsgType.PULL, {"newer_than": -1})
        for _ in range(12):  # B keeps the server busy past A's deadline (0.5 s) without updating
            await b.pull()
            await asyncio.sleep(0.1)
        for _ in range(3):  # in place, into the buffer A's reply was sent from
            await b.push(np.ones(n, np.float32), ps.clock)
        a.conn._transport.resume_reading()
        try:
            frame = await asyncio.wait_for(a.conn.recv(), 10)
        except (ConnectionError, asyncio.TimeoutError, rudra_errors.RudraError):
            frame = None  # cut off: what a closed learner should see
        if frame is not None:
            values = np.unique(np.frombuffer(frame.body, np.float32))
            assert frame.meta["timestamp"] == 0 and list(values) == [0.0], f"torn reply: {values[:5]}"
        await b.close()
        a.conn.close()


@pytest.mark.parametrize("thread", ["update thread", "event loop"])
async def test_an_update_that_fails_stops_the_server_and_writes_no_checkpoint_of_its_weights(
    thread, tmp_path, monkeypatch, caplog
):
    """An update that raises (a kernel's error, memory exhausted), on the update thread or
    inline on the event loop (a small model), leaves the weights undefined: the server stops by itself (serve() raises UpdateFailed, learners
    are cut off, nothing reads or updates the weights again), and the final checkpoint is not
    written over the last good one."""
    from rudra_async.client import Client

    if thread == "update thread":
        monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    path = tmp_path / "run.ckpt"
    with pytest.raises(rudra_errors.UpdateFailed, match="out of memory"):  # from serve(), awaited by run_server
        async with run_server(momentum=0.0, checkpoint=str(path), checkpoint_every=2) as ps:
            client = await Client.connect(ps.addresses[0], LAYOUT, np.zeros(N, np.float32), timeout=5)
            w = await client.pull()
            for _ in range(2):
                w = await client.push_pull(np.ones(N, np.float32), w.timestamp)
            await ps.checkpointer.settled()
            good = path.read_bytes()

            def out_of_memory(*args, **kwargs):
                raise MemoryError("the kernel ran out of memory")

            assert ps.core.store.updates_inline is (thread == "event loop")
            monkeypatch.setattr(ps.core.store.updater, "apply", out_of_memory)
            with pytest.raises((rudra_errors.PeerGone, rudra_errors.ConnectionClosed)):
                for _ in range(3):
                    w = await client.push_pull(np.ones(N, np.float32), w.timestamp)
            for _ in range(100):
                if ps.closing:
                    break
                await asyncio.sleep(0.05)
            assert ps.closing
            assert isinstance(ps.failure, rudra_errors.UpdateFailed)
            with pytest.raises(rudra_errors.UpdateFailed):
                ps.weights()
            await client.close()
    assert path.read_bytes() == good
    assert "the update failed; stopping the server" in caplog.text
    assert "the final checkpoint is not written" in caplog.text


async def test_an_update_that_fails_in_the_watchdog_stops_the_server(monkeypatch, caplog):
    """Evicting a hung learner can complete a hardsync round, whose update then runs from the
    watchdog: if it fails, the server stops all the same (the watchdog goes on enforcing
    deadlines meanwhile)."""
    from rudra_async.client import Client

    with pytest.raises(rudra_errors.UpdateFailed, match="out of memory"):
        async with run_server(protocol="hardsync", learner_timeout=0.5, momentum=0.0) as ps:
            a = await Client.connect(ps.addresses[0], LAYOUT, np.zeros(N, np.float32), timeout=5)
            b = await Client.connect(ps.addresses[0], LAYOUT, timeout=5)
            w = await a.pull()
            await b.pull()

            def out_of_memory(*args, **kwargs):
                raise MemoryError("the kernel ran out of memory")

            monkeypatch.setattr(ps.core.store.updater, "apply", out_of_memory)
            pushed = asyncio.ensure_future(a.push_pull(np.ones(N, np.float32), w.timestamp))  # b never pushes
            for _ in range(100):
                if ps.closing:
                    break
                await asyncio.sleep(0.05)
            assert ps.closing and isinstance(ps.failure, rudra_errors.UpdateFailed)
            assert not ps._watchdog.done()
            pushed.cancel()
            await asyncio.gather(pushed, return_exceptions=True)
            await a.close()
            await b.close()
    assert "the update failed; stopping the server" in caplog.text


async def test_closing_while_a_failing_update_is_computed_raises_update_failed(off_loop, tmp_path, monkeypatch):
    """A close (SIGTERM) that comes while the update in flight fails writes no checkpoint and
    leaves the server with UpdateFailed, which leaving ``async with`` raises (the command
    line exits with it), not the kernel's own exception."""
    from rudra_async.client import Client

    path = tmp_path / "run.ckpt"
    cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], momentum=0.0, checkpoint=str(path))
    with pytest.raises(rudra_errors.UpdateFailed, match="out of memory"):
        async with ParameterServer(cfg) as ps:
            client = await Client.connect(ps.addresses[0], LAYOUT, np.zeros(N, np.float32), timeout=5)
            w = await client.pull()

            def slowly_out_of_memory(*args, **kwargs):
                time.sleep(0.3)
                raise MemoryError("the kernel ran out of memory")

            monkeypatch.setattr(ps.core.store.updater, "apply", slowly_out_of_memory)
            monkeypatch.setattr(ps.core.store.updater, "partial", False)
            await client.push(np.ones(N, np.float32), w.timestamp)
            assert ps.core.store.in_flight is not None
            await client.close()
    assert not path.exists()


@pytest.mark.parametrize("kernel", ["numpy", pytest.param("torch", marks=pytest.mark.torch)])
def test_an_update_on_several_part_threads_equals_one_thread_bit_for_bit(monkeypatch, kernel):
    """--update-threads: the pieces of each update (and the max |g| of a gradient) are
    computed side by side on the part threads, in place or into a spare buffer, with one to
    three gradients combined, float16 among them: the same bits as one thread."""
    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    monkeypatch.setattr(store, "PIECE_VALUES", 1 << 20)  # torch's grain: every piece a multiple of it
    n = 3 * (1 << 20) + 777
    layout = Layout.from_shapes([("a", (n - 1000,)), ("b", (1000,))])
    steps = [Group(0, n - 1000, SGD(0.1, 0.9, 0.01, nesterov=True)), Group(n - 1000, n, SGD(0.05, 0.9, 0.0))]
    rng = np.random.default_rng(1)
    w0 = rng.standard_normal(n).astype(np.float32)
    one, two = Background(threads=1), Background(threads=2)
    stores = [WeightStore(layout, w0, kernel, background=b) for b in (one, two)]
    parts = []
    two_spread = two.spread
    monkeypatch.setattr(
        two, "spread", lambda fn, *args: parts.append(threading.current_thread().name) or two_spread(fn, *args)
    )
    for step in range(6):
        grads = [rng.standard_normal(n).astype(np.float32 if i != 1 else np.float16) for i in range(1 + step % 3)]
        scales = [1.0 / len(grads)] * len(grads)
        for s in stores:
            with s.lease() if step % 2 == 0 else _nothing():  # half the updates go to a spare buffer
                s.apply(grads, scales, steps)
    assert parts and all(name.startswith("rudra-update") for name in parts)  # the update thread spread them
    np.testing.assert_array_equal(stores[1].weights, stores[0].weights)
    np.testing.assert_array_equal(stores[1].updater.momentum, stores[0].updater.momentum)
    g = rng.standard_normal(n).astype(np.float32)
    g[n - 5] = 1e6
    assert stores[1].max_abs(g) == stores[0].max_abs(g) == 1e6
    g[7] = np.nan
    assert np.isnan(stores[1].max_abs(g))
    for s in stores:
        s.close()
    one.close()
    two.close()


def test_a_piece_that_fails_on_a_part_thread_fails_the_update_once_no_piece_is_being_written(monkeypatch):
    """With part threads, a piece whose kernel raises fails the whole update (UpdateFailed,
    its Progress failed) only once every other piece has stopped writing into the buffer."""
    from rudra_async.kernels import numpy_kernel

    monkeypatch.setattr(store, "BACKGROUND_MIN_VALUES", 1)
    monkeypatch.setattr(store, "PIECE_VALUES", 1000)
    apply, running, lock = numpy_kernel.NumpyUpdater.apply, [0], threading.Lock()

    def slow(self, w, w_out, grads, scales, steps, span=None):
        with lock:
            running[0] += 1
        try:
            if span is not None and span[0] == 3000:
                raise RuntimeError("a kernel that fails")
            time.sleep(0.01)
            return apply(self, w, w_out, grads, scales, steps, span)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(numpy_kernel.NumpyUpdater, "apply", slow)
    n = 10_000
    layout = Layout.from_shapes([("w", (n,))])
    background = Background(threads=2)
    failures = []
    s = WeightStore(layout, np.zeros(n, np.float32), "numpy", background=background, on_failure=failures.append)
    s.apply([np.ones(n, np.float32)], [1.0], [Group(0, n, SGD(0.1, 0.0, 0.0))])
    with s.lease_computing() as (_, _, progress):
        assert progress is not None
        with pytest.raises(rudra_errors.UpdateFailed, match="a kernel that fails"):
            s.finish()
        assert running[0] == 0  # no piece is still being written
        with pytest.raises(RuntimeError):
            progress.wait(4 * n, 1)
    assert len(failures) == 1
    s.close()
    background.close()


def test_a_consumed_hook_that_fails_is_logged_and_the_update_still_holds(caplog):
    """``consumed`` (a transport told early that a gradient was read, from the update thread)
    is an optimisation: its failure is a warning, never the update's."""
    n = store.BACKGROUND_MIN_VALUES
    background = Background(threads=1)
    ws = WeightStore(Layout.from_shapes([("w", (n,))]), np.zeros(n, np.float32), "numpy", background=background)
    told = []

    def fails():
        raise RuntimeError("the connection closed meanwhile")

    try:
        with caplog.at_level("WARNING", "rudra_async.server.store"):
            ws.apply([np.ones(n, np.float32)], [1.0], SGD(0.5), consumed=[fails, lambda: told.append(1)])
            ws.finish()
        assert told == [1] and ws.failure is None
        np.testing.assert_array_equal(ws.weights, np.full(n, -0.5, np.float32))
        assert "telling a transport that a gradient was read failed" in caplog.text
    finally:
        ws.close()
        background.close()

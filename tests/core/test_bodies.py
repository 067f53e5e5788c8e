"""The server-wide budget of large bodies (rudra_async.bodies): a reader waits for a buffer
rather than allocating another, loses no byte while it waits, and held gradients do not count."""

import numpy as np
import pytest

from rudra_async.bodies import BodyBudget
from rudra_async.wire import FrameReader, encode_frame

MIB = 1 << 20


def test_a_budget_counts_leases_serves_waiters_in_order_and_reuses_buffers():
    budget = BodyBudget(limit=2, threshold=MIB)
    assert budget.counts(MIB) and not budget.counts(MIB - 1)
    a, b = budget.take(MIB), budget.take(MIB)
    assert a is not None and b is not None and budget.take(MIB) is None
    got = []
    budget.wait(MIB, got.append)
    budget.wait(MIB, got.append)
    first = a.buffer
    a.give_back()
    a.give_back()  # idempotent
    assert len(got) == 1 and got[0].buffer is first  # the warm buffer, to the first waiter
    b.set_aside()  # a held body stops counting: the second waiter is served, b stays readable
    assert len(got) == 2 and budget.in_use == 2
    b.give_back()  # set aside, then given back: counted once only
    assert budget.in_use == 2
    for lease in got:
        lease.give_back()
    assert budget.in_use == 0 and budget.waiting == 0
    with pytest.raises(ValueError):
        BodyBudget(limit=0)


def test_a_reader_waits_for_a_buffer_keeps_the_bytes_read_meanwhile_and_resumes_exactly():
    rng = np.random.default_rng(0)
    bodies = [rng.standard_normal(MIB // 2).astype(np.float32) for _ in range(3)]  # 2 MiB each
    small = np.arange(10, dtype=np.float32)
    stream = b"".join(
        bytes(p)
        for arrays in ([bodies[0]], [small], [bodies[1]], [bodies[2]])
        for p in encode_frame(1, {"k": 1}, arrays)
    )
    budget = BodyBudget(limit=1, threshold=MIB)
    reader = FrameReader(budget=budget)
    frames, pos, resumed, waits = [], 0, [], []
    while pos < len(stream):
        if reader.waiting:
            assert reader.waiting == bodies[1].nbytes
            budget.wait(reader.waiting, resumed.append)
            if len(frames) == 2:  # the first large one is still held: its release serves the wait
                assert budget.in_use == 1 and not resumed
                frames[0].release()
                waits.append(pos)
            assert len(resumed) == 1  # the third was set aside meanwhile: served at once
            frames += reader.resume(resumed.pop())
            continue
        buf = reader.get_buffer()
        k = min(len(buf), len(stream) - pos, 3000)  # small reads: the wait starts mid-stage
        buf[:k] = stream[pos : pos + k]
        pos += k
        frames += reader.advance(k)
        if len(frames) == 3:
            frames[2].set_aside()  # held by a protocol: the third body needs no wait
    assert len(frames) == 4 and len(waits) == 1
    np.testing.assert_array_equal(frames[1].arrays[0], small)
    for frame, body in zip(frames[2:], bodies[1:]):
        np.testing.assert_array_equal(frame.arrays[0], body)
    assert budget.in_use == 1  # the fourth; the third was set aside


def test_a_reader_closed_while_receiving_gives_its_buffer_back():
    budget = BodyBudget(limit=1, threshold=MIB)
    reader = FrameReader(budget=budget)
    head = b"".join(bytes(p) for p in encode_frame(1, {}, [np.zeros(MIB, np.uint8)]))[:4096]
    buf = reader.get_buffer()
    buf[: len(head)] = head
    assert reader.advance(len(head)) == [] and budget.in_use == 1
    reader.close()
    assert budget.in_use == 0

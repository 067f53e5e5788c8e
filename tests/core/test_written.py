"""Reading a pushed gradient while its learner writes it (rudra_async.server.pipeline)."""

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rudra_async.errors import PeerGone
from rudra_async.server import pipeline as written
from rudra_async.wire import Frame


def frame_being_written(grad: np.ndarray) -> tuple[Frame, list[int]]:
    """A PUSH frame over ``grad`` whose ``written`` reports the list's one value (bytes
    written so far; -1: the learner went away)."""
    progress = [0]

    def bytes_written() -> int:
        if progress[0] < 0:
            raise PeerGone("the learner went away while writing its gradient")
        return progress[0]

    return Frame(3, {}, grad.data.cast("B"), written=bytes_written), progress


@pytest.fixture
def checks():
    pool = ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


async def test_a_push_counts_as_written_once_its_last_byte_is_before_its_check_ends(monkeypatch, checks):
    monkeypatch.setattr(written, "WRITTEN_PIECE_VALUES", 100)
    grad = np.arange(400, dtype=np.float32) - 300
    frame, progress = frame_being_written(grad)
    release = threading.Event()

    def slow_max_abs(piece: np.ndarray) -> float:
        assert release.wait(10)
        return float(np.abs(piece).max())

    when_written: list[bool] = []
    measuring = asyncio.create_task(
        written.max_abs_as_written(
            frame, grad, lambda piece: checks.submit(slow_max_abs, piece), lambda: when_written.append(release.is_set())
        )
    )
    for n in (100, 250, 400):
        await asyncio.sleep(0.01)
        assert not when_written
        progress[0] = 4 * n
    for _ in range(200):
        if when_written:
            break
        await asyncio.sleep(0.005)
    assert when_written == [False], "told when written, while its pieces are still being checked"
    assert frame.written is None
    release.set()
    assert await asyncio.wait_for(measuring, 10) == 300.0


async def test_the_pieces_of_a_push_whose_learner_goes_away_are_not_checked(monkeypatch, checks):
    monkeypatch.setattr(written, "WRITTEN_PIECE_VALUES", 100)
    grad = np.ones(1000, dtype=np.float32)
    frame, progress = frame_being_written(grad)
    release = threading.Event()
    checked: list[int] = []

    def slow_max_abs(piece: np.ndarray) -> float:
        assert release.wait(10)
        checked.append(piece.size)
        return 1.0

    told: list[None] = []
    measuring = asyncio.create_task(
        written.max_abs_as_written(
            frame, grad, lambda piece: checks.submit(slow_max_abs, piece), lambda: told.append(None)
        )
    )
    for n in (100, 200, 300):  # three pieces handed over: the first blocks the check thread
        progress[0] = 4 * n
        await asyncio.sleep(0.01)
    progress[0] = -1
    with pytest.raises(PeerGone):
        await asyncio.wait_for(measuring, 10)
    release.set()
    checks.shutdown(wait=True)
    assert checked == [100] and not told, "only the piece already being checked was measured"

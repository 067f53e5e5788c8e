"""Reading a pushed gradient while its learner still writes it (``Frame.written``: shm's
pushes written after their reference). The server polls how much is written from the event
loop and hands each written piece to the check thread, so the check of a large gradient
overlaps the learner's copy instead of following it; the thread itself never waits for a
learner (a stalled one stalls only its own session, which its deadline then closes; a
protocol that waits for members evicts it meanwhile, see ``ServerCore.evict_hung``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ..wire import Frame

#: how often the loop looks at how much of a gradient is written
POLL_S = 0.001
#: values per piece handed to the check thread (8 MiB of float32: the learner's own pieces)
PIECE_VALUES = 1 << 21


async def until_written(frame: Frame) -> None:
    """Return once the whole body of ``frame`` is written (PeerGone if it never will be);
    ``frame.written`` is then None, as for a frame that came whole."""
    written = frame.written
    while written is not None and written() < frame.body.nbytes:
        await asyncio.sleep(POLL_S)
    frame.written = None


async def max_abs_as_written(
    frame: Frame, grad: np.ndarray, check: Callable[[np.ndarray], Future[float]], on_written: Callable[[], None]
) -> float:
    """max |g| of ``grad`` (the body of ``frame``, as values), each piece measured by
    ``check`` (on another thread) once it is written; NaN if any piece holds a NaN. Once
    all of it is written, ``frame.written`` becomes None and ``on_written()`` is called,
    before the last pieces are measured. If the learner never finishes (PeerGone), the
    pieces not yet measured are cancelled and the error is raised."""
    written = frame.written
    assert written is not None, "a frame whose body is being written"
    done, parts = 0, []
    try:
        while done < grad.size:
            final = written() // grad.itemsize
            if final >= min(done + PIECE_VALUES, grad.size):
                parts.append(asyncio.wrap_future(check(grad[done:final])))
                done = final
            else:
                await asyncio.sleep(POLL_S)
        frame.written = None
        on_written()
    except BaseException:
        for part in parts:
            part.cancel()  # a piece not started is never measured; a running one's result is dropped
        raise
    found = await asyncio.gather(*parts)
    return math.nan if any(math.isnan(x) for x in found) else max(found, default=0.0)

"""Event-loop selection: uvloop when it imports, the standard loop otherwise.

Works on every Python the project supports (3.10+): no ``asyncio.Runner`` (3.11) and no
``loop_factory`` argument of ``asyncio.run`` (3.12).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: event loops that run a parameter server now (each with how many), so that blocking code
#: called on such a loop's thread can be told it would stall the server, not hang
_SERVING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


def serving(loop: asyncio.AbstractEventLoop, up: bool) -> None:
    """Record that a server starts (``up``) or stops running on ``loop``."""
    count = _SERVING.get(loop, 0) + (1 if up else -1)
    if count > 0:
        _SERVING[loop] = count
    else:
        _SERVING.pop(loop, None)


def serving_here() -> bool:
    """Whether this thread runs an event loop that runs a parameter server now (blocking
    here would stall that server: a notebook's cell, a coroutine of the embedding program)."""
    loop = asyncio._get_running_loop()  # the fast check asyncio itself makes
    return loop is not None and loop in _SERVING


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh uvloop loop if uvloop is installed, else a standard one."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when available: a new loop, closed when ``main`` returns."""
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


async def outlast(job: asyncio.Future[Any]) -> None:
    """Return once ``job`` is done, even if this task is cancelled meanwhile, once or more:
    for code that must not go on while ``job`` still uses something (a thread reading leased
    memory, a process being started), typically in a ``finally``. Neither ``job``'s outcome
    nor those cancellations are raised here."""
    while not job.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([job])


def run_sync(main: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (it awaits only blocking I/O, such as a
    :class:`~rudra_async.transports.blocking.BlockingConnection`) to its end, with no event loop."""
    try:
        main.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    main.close()
    raise RuntimeError("the coroutine suspended: it needs an event loop (use run or PrivateLoop)")


class PrivateLoop:
    """An event loop owned by blocking code (e.g. a training loop): :meth:`run` drives it
    until one coroutine is done. Cheap per call: no task repr, no signal handlers."""

    def __init__(self) -> None:
        self.loop = new_event_loop()

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """Drive ``main`` to its end. Interrupted (Ctrl-C while the loop waits), ``main`` is
        cancelled and its cancellation run before the interruption is raised: it never
        resumes under a later call."""
        if asyncio._get_running_loop() is not None:  # the fast check asyncio itself makes
            main.close()
            raise RuntimeError("a private loop cannot run inside a running event loop: use the async Client there")
        task = self.loop.create_task(main)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            task.cancel()
            while not task.done():
                try:
                    self.loop.run_until_complete(task)
                except KeyboardInterrupt:  # a second Ctrl-C during the cancellation: cancel again
                    task.cancel()
                except BaseException:  # its cancellation ended it, or the loop cannot run here
                    break
            raise

    def close(self) -> None:
        """Cancel what is left on the loop and close it. Idempotent."""
        if not self.loop.is_closed():
            try:
                _cancel_all(self.loop)
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                self.loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the loop's remaining tasks and let them finish (as ``asyncio.run`` does)."""
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

"""Event-loop selection: uvloop when it imports, the standard loop otherwise."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def new_runner() -> asyncio.Runner:
    return asyncio.Runner(loop_factory=loop_factory())


def run(main: Awaitable[T]) -> T:
    """``asyncio.run`` on uvloop when available."""
    with new_runner() as runner:
        return runner.run(main)  # type: ignore[arg-type]

"""When a server writes its checkpoints: every N updates, one at a time, and at close."""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import CheckpointError, ConfigError, RudraError

log = logging.getLogger(__name__)


def check_writable(path: str) -> None:
    """Fail at start, not hours into a run, when checkpoints cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"checkpoint directory {directory} is not writable")
    if os.path.isdir(path):
        raise ConfigError(f"checkpoint path {path} is a directory; give a file name")


class Checkpointer:
    """Schedules a server's checkpoints to ``path``; ``write(path)`` writes one, returns its clock.

    Every ``every`` updates a checkpoint starts in the background. At most one is written at
    a time; one falling due meanwhile is written right after, with the newest state. A
    failing periodic checkpoint is logged and counted and training goes on; the final one
    (:meth:`final`, at close) raises.
    """

    def __init__(self, path: str | None, every: int | None, write: Callable[[str], Awaitable[int]]) -> None:
        if path:
            check_writable(path)
        self.path, self.every, self._write = path, every if path else None, write
        #: ``written_at``: when the newest checkpoint file was written (Unix time), for its age
        self.stats: dict[str, Any] = {"path": path, "written": 0, "failed": 0, "clock": None, "written_at": None}
        self._newest: tuple[str, int] | None = None  # (path, clock) of the newest file known
        self._task: asyncio.Future[None] | None = None
        self._due = False
        self._closing = False
        self._last_period = 0  # clock // every when the last periodic checkpoint fell due

    def on_disk(self, path: str, clock: int, written: bool = True) -> None:
        """Record a checkpoint of ``clock`` at ``path`` (just written, or resumed from)."""
        self._newest = (path, clock)
        self.stats["written_at"] = time.time() if written else os.path.getmtime(path)
        if self.every:
            self._last_period = max(self._last_period, clock // self.every)
        if written:
            self.stats.update(written=self.stats["written"] + 1, clock=clock)

    def after_update(self, clock: int) -> None:
        """Called after every decision that applied updates (the clock may have moved by several)."""
        if not self.every or self._closing or clock // self.every <= self._last_period:
            return
        self._last_period = clock // self.every
        if self._task is not None and not self._task.done():
            self._due = True
            return
        self._task = asyncio.ensure_future(self._periodic())

    async def _periodic(self) -> None:
        assert self.path is not None  # periodic checkpoints need a path (``every`` is None without one)
        self._due = True
        while self._due and not self._closing:
            self._due = False
            try:
                await self._write(self.path)
            except Exception as exc:  # a failed periodic checkpoint must not stop training
                self.stats["failed"] += 1
                log.error("checkpoint failed: %s (training goes on)", exc, exc_info=not isinstance(exc, RudraError))

    async def settled(self) -> None:
        """Return once no periodic checkpoint is being written."""
        if self._task is not None:
            await self._task

    async def final(self, clock: int | None) -> None:
        """At close: let a periodic checkpoint in flight finish, then write the state at
        ``clock`` (None: nothing to write) unless the newest file already holds it. If it
        cannot be written (a full disk), the model is written to a fallback file
        (:func:`fallback_paths`) before the error, which says where, is raised."""
        self._closing = True
        await self.settled()
        if self.path and clock is not None and self._newest != (self.path, clock):
            try:
                await self._write(self.path)
            except CheckpointError as exc:
                self.stats["failed"] += 1
                rescue = await self._rescue(self.path)
                if rescue is None:
                    raise
                raise CheckpointError(f"{exc}; the model was written to {rescue} instead") from None

    async def _rescue(self, path: str) -> str | None:
        """Write the final checkpoint to the first fallback that takes it; its path, or None."""
        for candidate in fallback_paths(path):
            try:
                await self._write(candidate)
            except CheckpointError as exc:
                log.error("the fallback checkpoint %s failed too: %s", candidate, exc)
                continue
            log.error("the final checkpoint could not be written to %s; it is in %s", path, candidate)
            return candidate
        return None


def fallback_paths(path: str) -> list[str]:
    """Where a final checkpoint goes when ``path`` cannot take it: the temporary directory
    ($TMPDIR, else /tmp), then the home directory, as ``rudra-async-rescue-PID-NAME``."""
    name = f"rudra-async-rescue-{os.getpid()}-{os.path.basename(path)}"
    directories = dict.fromkeys([tempfile.gettempdir(), os.path.expanduser("~")])
    return [os.path.join(d, name) for d in directories if os.path.dirname(os.path.abspath(path)) != d]

"""Watching a running server: Prometheus metrics, a status page and status JSON.

:class:`Monitor` reads a :class:`~rudra_async.server.ParameterServer` when asked; it keeps
no count of its own. Every figure comes from ``server.stats()`` (the same statistics a run
reports at its end) at the moment of the request, plus a sampler that records the clock
and λ once a second for rates and the page's charts.

- :meth:`Monitor.metrics`: the Prometheus text exposition (``prometheus-client``);
- :meth:`Monitor.status`: one JSON-able snapshot (``/status.json``; ``rudra-async status``);
- :meth:`Monitor.page`: the status page, one self-contained HTML file (no external assets)
  that polls ``status.json`` relative to its own URL, so it works under any prefix.

``rudra-async server --metrics ADDRESS`` (``ServerConfig.metrics``) serves the three over
HTTP (``/metrics``, ``/``, ``/status.json``); an application with its own web server
serves them on its own routes (``examples/embed_aiohttp.py``)::

    async with Monitor(server) as monitor:      # starts the sampler
        body = monitor.metrics()                # bytes, of type monitor.content_type

Needs the ``monitor`` extra (``prometheus-client``) for :meth:`Monitor.metrics`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..server.core import make_loss_curve

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..server import ParameterServer
    from .http import HttpServer

__all__ = ["Monitor"]

#: rates are taken over this many seconds of samples
RATE_WINDOW_S = 10.0
#: learners that left stay in the metrics and the table while they are among the newest this many
MAX_GONE = 32


@dataclass
class Sample:
    """The state the sampler records once per interval."""

    at: float  # the server's now()
    clock: int
    learners: int
    per_learner: dict[int, int] = field(default_factory=dict)  # learner id -> gradients applied


@functools.cache
def _page() -> str:
    """The status page's HTML, read once from the package."""
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


class Monitor:
    """Reads ``server`` for metrics and status (see the module docstring). ``interval``:
    seconds between samples; ``history``: samples kept for the page's charts."""

    def __init__(self, server: ParameterServer, *, interval: float = 1.0, history: int = 600) -> None:
        self.server = server
        self.interval = interval
        self.history: collections.deque[Sample] = collections.deque(maxlen=history)
        self.started_at = time.time()
        self._sampler: asyncio.Task[None] | None = None
        self._http: HttpServer | None = None
        self._registry: CollectorRegistry | None = None

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start sampling (idempotent)."""
        if self._sampler is None:
            self._sample()
            self._sampler = asyncio.ensure_future(self._sample_forever())

    async def serve(self, address: str, token: bytes | None = None) -> str:
        """Start sampling and serve ``/metrics``, ``/`` and ``/status.json`` over HTTP at
        ``address`` (``HOST:PORT`` or ``PORT``), to requests carrying ``token`` (as
        ``Authorization: Bearer TOKEN``) when given; returns the base URL (the real port)."""
        from ..config import parse_http_address
        from .http import HttpServer

        self.registry  # noqa: B018 (fail now, not at the first scrape, without prometheus-client)
        await self.start()
        try:
            self._http = HttpServer(self.route, token)
            await self._http.start(*parse_http_address(address))
        except BaseException:
            await self.close()  # the sampler too
            raise
        return self._http.url

    @property
    def url(self) -> str | None:
        """The base URL of the HTTP server, once serving."""
        return self._http.url if self._http is not None else None

    async def close(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> Monitor:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what is served -----------------------------------------------------------------------
    @property
    def content_type(self) -> str:
        """The content type of :meth:`metrics`."""
        from prometheus_client import CONTENT_TYPE_LATEST

        return str(CONTENT_TYPE_LATEST)

    @property
    def registry(self) -> CollectorRegistry:
        """This server's own registry: its collector and the process's (RSS, CPU, files)."""
        if self._registry is None:
            try:
                from prometheus_client import CollectorRegistry, ProcessCollector
            except ImportError:
                from ..errors import ConfigError

                raise ConfigError("metrics need prometheus-client: pip install 'rudra-async[monitor]'") from None
            from .collector import ServerCollector

            registry = CollectorRegistry(auto_describe=False)
            registry.register(ServerCollector(self))
            ProcessCollector(registry=registry)
            self._registry = registry
        return self._registry

    def metrics(self) -> bytes:
        """The Prometheus text exposition of this server's metrics, read now."""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))

    def status(self) -> dict[str, Any]:
        """One snapshot: ``server.stats()`` (its loss curve drawn from at most 2,000 of the
        reported losses, evenly spaced, so that a poll stays cheap in a long run) and, added, ``server``
        (what it is), ``time``, ``uptime_s``, ``clock``, ``updates_per_s``,
        ``learners_connected`` (λ), ``learners_blocked``, ``rss_bytes``, per learner
        ``rate`` (gradients/s) and ``blocked``, the checkpoint's ``age_s``, and ``history``
        (``t`` in seconds before now, ``clock``, ``updates_per_s``, ``learners``)."""
        ps = self.server
        stats = ps.stats(loss_curve=False)
        now = ps.now()
        blocked = ps.blocked
        rates = self._learner_rates(now)
        learners = {}
        for key, info in self._shown(stats["learners"]).items():
            learners[key] = {**info, "rate": rates.get(int(key), 0.0), "blocked": int(key) in blocked}
        wall = time.time()
        ckpt = dict(stats["checkpoint"])
        ckpt["age_s"] = wall - ckpt["written_at"] if ckpt.get("written_at") else None
        history = list(self.history)
        return {
            **stats,
            "server": {
                "version": __version__,
                "addresses": ps.addresses,
                "metrics": self.url,
                "pid": os.getpid(),
                "started_at": self.started_at,
            },
            "time": wall,
            "uptime_s": wall - self.started_at,
            "clock": ps.clock,
            "updates_per_s": self.updates_per_s(now),
            "learners_connected": self._connected(),
            "learners_blocked": len(blocked),
            "learners_total": len(stats["learners"]),
            "learners": learners,
            "rss_bytes": self.rss_bytes(),
            "checkpoint": ckpt,
            "loss_curve": make_loss_curve(ps.core.losses[:: max(1, len(ps.core.losses) // 2000)]),
            "history": {
                "t": [round(s.at - now, 3) for s in history],
                "clock": [s.clock for s in history],
                "updates_per_s": [self._rate_at(i) for i in range(len(history))],
                "learners": [s.learners for s in history],
            },
        }

    def page(self) -> str:
        """The status page (HTML with inline CSS and JavaScript, nothing fetched but status.json)."""
        return _page()

    def route(self, path: str) -> tuple[int, str, bytes]:
        """(HTTP status, content type, body) for a GET of ``path`` (the built-in HTTP server's table)."""
        if path == "/metrics":
            return 200, self.content_type, self.metrics()
        if path == "/status.json":
            return 200, "application/json", json.dumps(self.status()).encode()
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self.page().encode()
        return 404, "text/plain; charset=utf-8", b"not found: try /, /metrics or /status.json\n"

    # -- rates --------------------------------------------------------------------------------
    def updates_per_s(self, now: float | None = None) -> float:
        """Updates per second over the last :data:`RATE_WINDOW_S` seconds (up to now)."""
        now = self.server.now() if now is None else now
        old = self._window_start(now)
        if old is None or now - old.at <= 0:
            return 0.0
        last = self.server.core.last_update_at
        if not self._connected() and (last is None or now - last > self.interval):
            return 0.0  # the run is over or paused: no trailing average of updates that stopped
        return max(0, self.server.clock - old.clock) / (now - old.at)

    def rss_bytes(self) -> float | None:
        """The process's resident memory (what prometheus-client's process collector reports;
        Linux, else None)."""
        try:
            with open("/proc/self/statm") as fh:
                return float(int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError):
            return None

    def _connected(self) -> int:
        """λ: the learners connected now."""
        return sum(1 for info in self.server.core.learners.values() if info.connected)

    def _window_start(self, now: float) -> Sample | None:
        """The oldest sample within the rate window (the newest one if none is)."""
        for sample in self.history:
            if now - sample.at <= RATE_WINDOW_S + self.interval / 2:
                return sample
        return self.history[-1] if self.history else None

    def _learner_rates(self, now: float) -> dict[int, float]:
        old = self._window_start(now)
        if old is None or now - old.at <= 0:
            return {}
        learners = self.server.core.learners
        return {i: max(0, info.applied - old.per_learner.get(i, 0)) / (now - old.at) for i, info in learners.items()}

    def _rate_at(self, index: int) -> float:
        """Updates/s over the rate window ending at sample ``index`` of the history."""
        history = self.history
        end = history[index]
        start = end
        for j in range(index, -1, -1):
            if end.at - history[j].at > RATE_WINDOW_S + self.interval / 2:
                break
            start = history[j]
        dt = end.at - start.at
        return max(0, end.clock - start.clock) / dt if dt > 0 else 0.0

    def _shown(self, learners: dict[str, Any]) -> dict[str, Any]:
        """Every connected learner and the newest :data:`MAX_GONE` that left."""
        gone = [k for k, v in learners.items() if not v["connected"]]
        hidden = set(gone[:-MAX_GONE]) if len(gone) > MAX_GONE else set()
        return {k: v for k, v in learners.items() if k not in hidden}

    def _sample(self) -> None:
        core = self.server.core
        self.history.append(
            Sample(
                self.server.now(),
                self.server.clock,
                self._connected(),
                {i: info.applied for i, info in core.learners.items()},
            )
        )

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self._sample()

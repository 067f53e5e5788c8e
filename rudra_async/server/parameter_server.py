"""The parameter server's asyncio shell: listeners, one session per connection, waiting,
checkpoint scheduling. The state and the rules are the I/O-free :class:`~.core.ServerCore`.

Embed it::

    async with ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"])) as ps:
        print(ps.addresses)
        await ps.serve()          # until ps.close() (or cancellation)

Every request gets exactly one reply. Bad input is answered with an ERROR frame carrying a
stable code; it never changes the weights and never affects other connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from .. import checkpoint, eventloop, security, transports
from ..bodies import BodyBudget
from ..config import ServerConfig
from ..errors import ConfigError, PeerGone, RudraError, UpdateFailed
from ..eventloop import outlast
from ..logs import rate_limited
from ..transports.base import Connection, Listener, SharedMemory
from ..transports.stream import close_lingering
from ..wire import Limits, MsgType
from .checkpointer import Checkpointer
from .core import ServerCore, learner_extra
from .pipeline import UpdatePipeline
from .session import Budget, Session
from .shell import SessionShell
from .traffic import Traffic

if TYPE_CHECKING:
    from ..monitor import Monitor

log = rate_limited(logging.getLogger(__name__))  # peers provoke its messages
#: how much longer than --handshake-timeout the TLS layer's own handshake timeout is (a backstop)
TLS_BACKSTOP_S = 1.0
#: file descriptors kept free for everything but connections (checkpoints, logs, the loop)
FD_RESERVE = 64


def shared_memory_of(listen: list[str]) -> SharedMemory | None:
    """Memory that one of the listening transports sends without copying, if any."""
    for url in listen:
        shared = transports.transport_for(url).shared_memory()
        if shared is not None:
            return shared
    return None


class ParameterServer:
    """A server for the weights of one model (or one shard of it); see the module docstring.
    ``initial`` (tensor name → array) seeds the weights instead of the first learner's hello."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        initial: dict[str, np.ndarray] | None = None,
        secret: bytes | str | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        """``secret``: the shared secret learners must prove they know (default: the
        contents of ``config.secret_file``, else the ``RUDRA_ASYNC_SECRET`` variable, else none).
        ``now``: seconds, never going back; the one time source of every deadline and timeout
        of the server (sessions, the watchdog, the core's learner times, the monitor's rates),
        for tests to drive."""
        self.now = now
        cfg = self.config = (config or ServerConfig()).validate()
        self.secret = security.resolve_secret(secret, cfg.secret_file)
        self.tls: ssl.SSLContext | None = (
            security.server_tls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
        )
        self._check_exposure()
        self.limits = Limits(max_body=cfg.max_frame)
        self.max_connections = cfg.max_connections
        #: where checkpoints go: ``--checkpoint`` with ``{shard}`` made this shard's index
        self.checkpoint_path = checkpoint.shard_path(cfg.checkpoint, cfg.shard, required=False)
        self.checkpointer = Checkpointer(self.checkpoint_path, cfg.checkpoint_every, self.checkpoint)
        #: the way of every pushed gradient to the weights: threads, measuring, reaping
        self.pipeline = UpdatePipeline(cfg)
        self.core = ServerCore(
            cfg,
            initial=initial,
            shared_memory=shared_memory_of(cfg.listen),
            on_change=self._notify,
            on_update=self.checkpointer.after_update,
            on_failure=self._failed,
            now=now,
            background=self.pipeline.background,
        )
        self.pipeline.bind(self.core)
        self._checkpointing = asyncio.Lock()  # checkpoints are written one at a time, in order
        resume = checkpoint.shard_path(cfg.resume, cfg.shard, required=False)
        if resume is not None:
            self.core.restore(checkpoint.load(resume), resume)
            self.checkpointer.on_disk(resume, self.core.clock, written=False)
        self._listeners: list[Listener] = []
        self._closed: asyncio.Event | None = None
        self._initialized: asyncio.Event | None = None
        self._changed = asyncio.Event()
        self._blocked: set[int] = set()
        self._shutdown: asyncio.Future[None] | None = None
        self.closing_reason = ""  # why the server is shutting down (told to learners)
        #: what every connection bringing initial weights (a HELLO before the model exists) may hold at once
        self.initial_bytes = Budget(2 * cfg.max_model_bytes)
        #: the large gradients all stream connections receive at once (rudra_async.bodies),
        #: --gradient-buffers of them whatever the number of learners
        self.bodies = BodyBudget(cfg.gradient_buffers)
        self._sessions: dict[Connection, Session] = {}  # in order of arrival
        self._unregistered: dict[Session, Connection] = {}  # sessions before hello, oldest first
        self._watchdog: asyncio.Task[None] | None = None
        self.traffic = Traffic()
        self.monitor: Monitor | None = None  # serving --metrics, once started
        #: why the server stopped by itself: an update failed (serve() raises it)
        self.failure: UpdateFailed | None = None

    def _check_exposure(self) -> None:
        """Refuse to serve other hosts without a secret (unless ``insecure``); warn about
        traffic that other hosts can reach and read."""
        cfg = self.config
        for url in cfg.listen:  # an address without a known scheme is that error, not an exposure
            transports.transport_for(url)
        exposed = [url for url in cfg.listen if not transports.is_loopback(url)]
        if exposed and self.secret is None:
            if not cfg.insecure:
                raise ConfigError(
                    f"refusing to listen on {exposed[0]} without a secret: anyone who reaches it could read and "
                    "overwrite the model; give --secret-file (or RUDRA_ASYNC_SECRET), or --insecure"
                )
            log.warning("listening on %s with no secret (--insecure): anyone who reaches it owns the model", exposed[0])
        plain = [url for url in exposed if not (self.tls is not None and transports.transport_for(url).supports_tls)]
        if plain and self.secret is not None:
            scheme = urlsplit(plain[0]).scheme
            why = "its transport has no TLS" if self.tls is not None else "give --tls-cert for TLS"
            log.warning("traffic on %s is not encrypted (%s://: %s)", plain[0], scheme, why)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind every listen address; raises ConnectError at once if one cannot be bound."""
        self.pipeline.start()
        self._closed = asyncio.Event()
        self._initialized = asyncio.Event()
        if self.core.store is not None:
            self._initialized.set()
        self._fit_connection_limit()
        try:
            for url in self.config.listen:
                self._listeners.append(await self._listen(url))
            if self.config.metrics:
                from ..monitor import Monitor

                self.monitor = Monitor(self)
                token = self.config.metrics_token_file
                await self.monitor.serve(self.config.metrics, security.load_token(token) if token else None)
        except BaseException:
            await self.close()
            raise
        self._watchdog = asyncio.ensure_future(self._watch())
        eventloop.serving(asyncio.get_running_loop(), True)
        log.info("parameter server listening on %s (%s)", ", ".join(self.addresses), self.core.protocol.describe())

    async def serve(self) -> None:
        """Run until :meth:`close` is called (starts the server if needed), or until an update
        fails: then it raises :class:`UpdateFailed` (the owner still closes the server)."""
        if self._closed is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()
        if self.failure is not None:
            raise self.failure

    def request_close(self, reason: str = "") -> None:
        """Make :meth:`serve` return (e.g. from a signal handler); the owner then awaits
        :meth:`close`. ``reason`` goes to the learners with the shutdown's notice."""
        self.closing_reason = self.closing_reason or reason
        if self._closed is not None:
            self._closed.set()
        self._notify()

    def close_on_signals(self) -> None:
        """SIGINT and SIGTERM end :meth:`serve` (the owner then closes, writing the final checkpoint)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_close, f"it got {sig.name}")

    async def close(self) -> None:
        """Stop listening, drop every connection, write the final checkpoint if one is
        configured (a failure to write it is raised). Idempotent; concurrent calls share one shutdown."""
        self.request_close()
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._shutdown)

    async def _shut_down(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            eventloop.serving(asyncio.get_running_loop(), False)
        if self.monitor is not None:
            await self.monitor.close()
        for conn, session in list(self._sessions.items()):  # before the connections close: why they do
            notice = session.shutdown_notice(self.closing_reason or "its owner closed it")
            if notice is not None:  # best effort; no hang_up: a lingering close would outlive the server's loop
                conn.tell(MsgType.ERROR, notice)
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        close_lingering()  # the last replies of refused connections still draining
        store = self.core.store
        try:
            if self.failure is None:
                with contextlib.suppress(UpdateFailed):  # the update in flight failed meanwhile: _failed
                    await self.checkpointer.final(self.core.clock if store is not None else None)
            if self.failure is not None and self.checkpoint_path:
                log.error("the final checkpoint is not written: the weights are undefined (%s)", self.failure)
        finally:
            self.pipeline.close()
            self.bodies.clear()

    async def __aenter__(self) -> ParameterServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
        if self.failure is not None and exc[0] is None:  # found while closing: the owner must know
            raise self.failure

    # -- what an embedding application reads ---------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [listener.address for listener in self._listeners]

    @property
    def clock(self) -> int:
        return self.core.clock

    @property
    def stopped(self) -> bool:
        return self.core.stopped

    @property
    def closing(self) -> bool:
        return self._closed is not None and self._closed.is_set()

    @property
    def blocked(self) -> frozenset[int]:
        """Learners whose reply waits on the protocol now (a hardsync round, a staleness bound)."""
        return frozenset(self._blocked)

    def stop_at(self, updates: int) -> None:
        """End the run once the clock reaches ``updates`` (replies then carry ``stop``)."""
        self.core.stop_at(updates)

    async def wait_initialized(self) -> None:
        """Return once the server has weights (from ``initial``, a checkpoint or the first hello)."""
        assert self._initialized is not None, "start() first"
        await self._initialized.wait()

    def weights(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, by tensor name."""
        return self.core.weights()

    def stats(self, loss_curve: bool = True) -> dict[str, Any]:
        """Statistics for reports and embedding apps (plain JSON-able values); see
        :meth:`ServerCore.stats <rudra_async.server.core.ServerCore.stats>`."""
        return {
            **self.core.stats(loss_curve),
            "checkpoint": dict(self.checkpointer.stats),
            "traffic": self.traffic.totals(),
        }

    # -- checkpoints --------------------------------------------------------------------------
    async def checkpoint(self, path: str | None = None) -> int:
        """Write a checkpoint now, to ``path`` or the configured one; returns its clock.

        The published weights are leased while the file is written in a thread (updates go on
        into a spare buffer), so only the momentum is copied. Checkpoints are written one at
        a time, in the order they were asked for, so a later one (the final one at close)
        never lands before an earlier one. Cancelled, this returns only once the thread has
        stopped reading the weights (the file is then written, or not, as the thread ends)."""
        target = path or self.checkpoint_path
        if not target:
            raise ConfigError("no checkpoint path: pass one or configure --checkpoint")
        async with self._checkpointing:
            store = self.core.store
            if store is None or self.pipeline.closed:
                raise RudraError("the server has no weights to checkpoint", code="no_weights")
            await self.pipeline.updates_computed()
            keep = self.config.checkpoint_keep if target == self.checkpoint_path else 1
            with store.lease() as (clock, weights):
                saving = asyncio.ensure_future(
                    asyncio.to_thread(checkpoint.save, target, self.core.snapshot(clock, weights), keep)
                )
                try:
                    await asyncio.shield(saving)
                finally:
                    await outlast(saving)  # the lease ends only once the thread no longer reads the weights
                    if not saving.cancelled():
                        saving.exception()  # seen: a cancelled checkpoint() does not raise the thread's error
        self.checkpointer.on_disk(target, clock)
        log.info("checkpoint of update %d written to %s", clock, target)
        return clock

    def _failed(self, failure: UpdateFailed) -> None:
        """An update failed (the store says so once, whoever met it): the weights are
        undefined, so the server stops."""
        self.failure = failure
        log.critical("the update failed; stopping the server", exc_info=failure)
        self.request_close()

    # -- waiting ------------------------------------------------------------------------------
    def _notify(self) -> None:
        """The core's state changed: every waiting request re-checks its condition."""
        if self._initialized is not None and self.core.store is not None:
            self._initialized.set()
        self._changed.set()
        self._changed = asyncio.Event()
        self._blocked.clear()  # those still blocked re-enter

    async def wait_until(self, ready: Callable[[], bool], conn: Connection, learner: int, parked: bool = False) -> None:
        """Wait until ``ready()`` (re-checked on every state change), the run stops or closes.
        Raises PeerGone if the connection is lost meanwhile; ``learner`` is in :attr:`blocked`
        while it waits. ``parked``: the wait of a bare PULL, which does not count as a request
        in progress (:attr:`LearnerInfo.parked`)."""
        if ready() or self.stopped or self.closing:
            return
        lost = asyncio.ensure_future(conn.wait_lost())
        if parked:
            self.core.parked(learner, +1)
        try:
            while not (ready() or self.stopped or self.closing):
                self._blocked.add(learner)
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({changed, lost}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if lost.done():
                    raise PeerGone("connection lost while waiting")
        finally:
            self._blocked.discard(learner)
            lost.cancel()
            if parked:
                self.core.parked(learner, -1)

    # -- connections --------------------------------------------------------------------------
    async def _listen(self, url: str) -> Listener:
        handle = functools.partial(self._handle, url.partition(":")[0])
        return await transports.listen(
            url,
            handle,
            limits=self.limits,
            on_accept=self._accept,
            tls=self.tls if url.startswith("tcp://") else None,  # the other transports have no TLS
            # the session's handshake deadline, from the same arrival, closes it first (and counts it)
            tls_timeout=self.config.handshake_timeout + TLS_BACKSTOP_S,
        )

    def _fit_connection_limit(self) -> None:
        """Raise the open-file limit as far as allowed, and keep ``max_connections`` below it,
        so that running out of descriptors never locks learners out silently."""
        try:
            import resource
        except ImportError:  # not on POSIX
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.config.max_connections + FD_RESERVE
        if soft != resource.RLIM_INFINITY and soft < want:
            new = want if hard == resource.RLIM_INFINITY else min(want, hard)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
                soft = new
            except (ValueError, OSError):
                pass
        if soft != resource.RLIM_INFINITY and soft < want:
            self.max_connections = max(1, soft - FD_RESERVE)
            log.warning(
                "only %d file descriptors: at most %d connections (not --max-connections %d)",
                soft,
                self.max_connections,
                self.config.max_connections,
            )

    def refused(self, code: str, message: str) -> None:
        """Count a refusal under ``code`` and log it (rate-limited: see ``logs.RateLimit``): a
        warning, but for ``stopped``, the answer every learner gets once the run is over
        (information: nothing went wrong)."""
        self.core.reject(code)
        level = logging.INFO if code == "stopped" else logging.WARNING
        log.log(level, "refused [%s] %s", code, message, extra={"code": code})

    def _accept(self, conn: Connection) -> None:
        """A new connection, before any of its bytes is parsed: its limits (the session's
        ``admit``), its handshake deadline, and the connection limits."""
        if self.closing:
            conn.close()
            return
        if len(self._sessions) >= self.max_connections:
            message = f"already {len(self._sessions)} connections (--max-connections)"
            self.refused("too_many_connections", f"{conn.peer}: {message}")
            _turn_away(conn, "too_many_connections", message)
            return
        if len(self._unregistered) >= self.config.max_unauthenticated:
            # the least advanced handshake goes (a peer that has sent nothing before one that is
            # authenticating, before one that is authenticated), the oldest of its kind
            victim = min(self._unregistered, key=lambda s: s.progress)
            victim_conn = self._unregistered[victim]
            message = (
                f"the least advanced of {len(self._unregistered)} connections without hello (--max-unauthenticated)"
            )
            self.refused("evicted", f"{victim_conn.peer}: {message}")
            self._forget(victim_conn)
            _turn_away(victim_conn, "evicted", message)
        session = Session(self, conn)
        conn.admit = session.admit
        conn.bodies = self.bodies
        self._sessions[conn] = session
        self._unregistered[session] = conn

    def registered(self, session: Session) -> None:
        """The session said hello: it no longer counts against ``max_unauthenticated``."""
        self._unregistered.pop(session, None)

    def _forget(self, conn: Connection) -> None:
        session = self._sessions.pop(conn, None)
        if session is not None:
            self._unregistered.pop(session, None)

    async def _handle(self, scheme: str, conn: Connection) -> None:
        session = self._sessions.get(conn)
        if session is None:  # refused on arrival
            return
        try:
            with self.traffic.track(scheme, conn):
                await SessionShell(self, session, conn).run()
        except UpdateFailed:  # the server stops: _failed
            pass
        finally:
            self._forget(conn)

    async def _watch(self) -> None:
        """Enforce the deadlines: close connections past theirs, evict hung learners; warn
        once about each learner idle for ``slow_after`` seconds (slow, stuck, or gone without
        a word)."""
        cfg = self.config
        timeouts = [t for t in (cfg.handshake_timeout, cfg.idle_timeout, cfg.learner_timeout, cfg.slow_after) if t]
        tick = min(1.0, max(0.02, min(timeouts) / 8))
        while True:
            await asyncio.sleep(tick)
            now = self.now()
            for conn, session in list(self._sessions.items()):
                if session.deadline is not None and now > session.deadline:
                    session.expire()
                    conn.close()
            if cfg.learner_timeout:
                with contextlib.suppress(UpdateFailed):  # an eviction may complete a round (the server stops: _failed)
                    self.core.evict_hung(now, cfg.learner_timeout)
            for info in self.core.newly_slow(cfg.slow_after):
                log.warning(
                    "learner %d (%s) is slow: nothing from it for %g s",
                    info.learner_id,
                    info.name,
                    cfg.slow_after,
                    extra=learner_extra(info),
                )


def _turn_away(conn: Connection, code: str, message: str) -> None:
    """Close a connection the server has no room for, telling the peer why (a fatal ERROR
    without ``seq``, where the transport can send it at once; a learner then tries again
    within ``--reconnect``)."""
    conn.hang_up(MsgType.ERROR, {"code": code, "message": message, "fatal": True})

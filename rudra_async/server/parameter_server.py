"""The parameter server: transport → sync protocol → LR policy → update kernel, on one loop.

Embed it::

    async with ParameterServer(ServerConfig(listen=["tcp://127.0.0.1:0"])) as ps:
        print(ps.addresses)
        await ps.serve()          # until ps.close() (or cancellation)

Every request gets exactly one reply. Bad input is answered with an ERROR frame carrying a
stable code; it never changes the weights and never affects other connections.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import __version__, checkpoint, kernels, registry, transports
from .checkpointer import Checkpointer
from ..config import ServerConfig
from ..errors import CheckpointError, ConfigError, FrameTooLarge, PeerGone, RequestError, RudraError, WireError
from ..layout import Layout, Shard
from ..lr import LRPolicy, Schedule
from .stats import StalenessHistogram
from .store import WeightStore
from ..sync import Decision, Gradient, SyncProtocol
from ..transports.base import Connection, Listener
from ..wire import Frame, Limits, MsgType

log = logging.getLogger(__name__)


@dataclass
class LearnerInfo:
    learner_id: int
    name: str
    peer: str
    applied: int = 0
    dropped: int = 0
    connected: bool = True


@dataclass(eq=False)
class _Pending:
    """What the server keeps of a gradient until its update: the frame holding its bytes."""

    frame: Frame
    grad: np.ndarray
    samples: int
    outcome: str = "pending"  # → "applied" | "dropped"
    staleness: int | None = None


def _int_field(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"field {key!r} must be an integer, got {value!r}", code="bad_request")
    return value


def loss_curve(losses: list[tuple[int, float]], points: int = 50) -> list[list[float]]:
    """The reported training losses averaged into ``points`` buckets: [[update, loss], ...]."""
    if not losses:
        return []
    size = max(1, len(losses) // points)
    curve = []
    for i in range(0, len(losses), size):
        chunk = losses[i : i + size]
        curve.append([chunk[-1][0], sum(l for _, l in chunk) / len(chunk)])
    return curve


def make_protocol(cfg: ServerConfig) -> SyncProtocol:
    return registry.create("protocol", cfg.protocol, cfg.protocol_kwargs(), SyncProtocol)


def make_lr_policy(cfg: ServerConfig) -> LRPolicy:
    return registry.create("lr policy", cfg.lr_policy, cfg.lr_policy_kwargs(), LRPolicy)


class ParameterServer:
    def __init__(self, config: ServerConfig | None = None, *, initial: dict[str, np.ndarray] | None = None) -> None:
        self.config = (config or ServerConfig()).validate()
        cfg = self.config
        self.limits = Limits(max_body=cfg.max_frame)
        self.kernel = kernels.resolve(cfg.kernel, cfg.device)
        self.protocol = make_protocol(cfg)
        self.lr_policy = make_lr_policy(cfg)
        self.schedule = Schedule(cfg.lr, cfg.lr_decay_at, cfg.lr_decay, cfg.lr_decay_unit, cfg.warmup, cfg.lr_scale_ref_batch)
        self.shard: Shard = cfg.shard
        self.layout: Layout | None = None  # the whole model's; the store holds this server's shard of it
        self.store: WeightStore | None = None
        if initial is not None:
            layout = Layout.from_shapes((k, np.shape(a)) for k, a in initial.items())
            flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in initial.values()])
            lo, hi = self.shard.range(layout.size)
            self._create_store(layout, flat[lo:hi])
        self.learners: dict[int, LearnerInfo] = {}
        self.waiting: set[int] = set()  # learners whose request waits on the protocol
        self.losses: list[tuple[int, float]] = []  # (clock, training loss) as learners report it
        self.staleness = StalenessHistogram()
        self.rejected: dict[str, int] = {}
        self.samples_seen = 0
        self.update_seconds = 0.0  # time spent in the update kernel
        self.first_update_at: float | None = None
        self.last_update_at: float | None = None
        self.checkpointer = Checkpointer(cfg.checkpoint, cfg.checkpoint_every, self.checkpoint)
        self._store_closed = False
        self._shutdown: asyncio.Future[None] | None = None
        if cfg.resume is not None:
            if initial is not None:
                raise ConfigError("give the server initial weights or a checkpoint to resume from, not both")
            self._restore(cfg.resume)
        self._next_id = 0
        self._listeners: list[Listener] = []
        self._closed: asyncio.Event | None = None
        self._initialized: asyncio.Event | None = None
        self._changed = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind every listen address; raises ConnectError at once if one cannot be bound."""
        self._closed = asyncio.Event()
        self._initialized = asyncio.Event()
        if self.store is not None:
            self._initialized.set()
        try:
            for url in self.config.listen:
                self._listeners.append(await transports.listen(url, self._handle, limits=self.limits))
        except BaseException:
            await self.close()
            raise
        log.info("parameter server listening on %s (%s)", ", ".join(self.addresses), self.protocol.describe())

    async def serve(self) -> None:
        """Run until :meth:`close` is called (starts the server if needed)."""
        if self._closed is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()

    def request_close(self) -> None:
        """Make :meth:`serve` return (e.g. from a signal handler); the owner then awaits :meth:`close`."""
        if self._closed is not None:
            self._closed.set()
        self._notify()

    def close_on_signals(self) -> None:
        """SIGINT and SIGTERM end :meth:`serve` (the owner then closes, writing the final checkpoint)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_close)

    async def close(self) -> None:
        """Stop listening, drop every connection, write the final checkpoint if one is
        configured (a failure to write it is raised). Idempotent; concurrent calls share one shutdown."""
        self.request_close()
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._shutdown)

    async def _shut_down(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        try:
            await self.checkpointer.final(self.clock if self.store is not None else None)
        finally:
            self._store_closed = True
            if self.store is not None:
                self.store.close()

    async def __aenter__(self) -> "ParameterServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def addresses(self) -> list[str]:
        return [listener.address for listener in self._listeners]

    @property
    def clock(self) -> int:
        return self.store.clock if self.store is not None else 0

    @property
    def stopped(self) -> bool:
        limit = self.config.max_updates
        return limit is not None and self.clock >= limit

    @property
    def closing(self) -> bool:
        return self._closed is not None and self._closed.is_set()

    def stop_at(self, updates: int) -> None:
        """End the run once the clock reaches ``updates`` (replies then carry ``stop``)."""
        if updates < 1:
            raise ConfigError(f"max updates must be >= 1, got {updates}")
        self.config.max_updates = updates
        self._notify()

    async def wait_initialized(self) -> None:
        assert self._initialized is not None, "start() first"
        await self._initialized.wait()

    def weights(self) -> dict[str, np.ndarray]:
        """A copy of the current weights, by tensor name."""
        if self.store is None:
            raise RudraError("the server has no weights yet (no learner said hello)", code="no_weights")
        flat = self.store.weights
        return {t.name: flat[t.offset : t.offset + t.size].reshape(t.shape).copy() for t in self.store.layout.tensors}

    def stats(self) -> dict[str, Any]:
        """Statistics for reports and embedding apps (plain JSON-able values)."""
        return {
            **self.protocol.describe(),
            "lr_policy": self.config.lr_policy,
            "kernel": self.kernel,
            "shard": str(self.shard),
            "updates": self.clock,
            "gradients": self.staleness.total,
            "dropped": sum(l.dropped for l in self.learners.values()),
            "samples": self.samples_seen,
            "update_seconds": self.update_seconds,
            **self.staleness.summary(),
            "learners": {
                str(i): {"name": l.name, "gradients": l.applied, "dropped": l.dropped, "connected": l.connected}
                for i, l in self.learners.items()
            },
            "rejected": dict(self.rejected),
            "checkpoint": dict(self.checkpointer.stats),
            "loss_curve": loss_curve(self.losses),
        }

    # -- checkpoints --------------------------------------------------------------------------
    async def checkpoint(self, path: str | None = None) -> int:
        """Write a checkpoint now, to ``path`` or the configured one; returns its clock.

        The published weights are leased while the file is written in a thread (updates go on
        into a spare buffer), so only the momentum is copied."""
        store = self.store
        target = path or self.config.checkpoint
        if store is None or self._store_closed:
            raise RudraError("the server has no weights to checkpoint", code="no_weights")
        if not target:
            raise ConfigError("no checkpoint path: pass one or configure --checkpoint")
        with store.lease() as (clock, weights):
            assert self.layout is not None
            state = checkpoint.Checkpoint(
                self.layout, clock, weights, store.updater.momentum, self.samples_seen, self._checkpoint_info(),
                shard=self.shard, state={"staleness": self.staleness.to_dict(), "lr_policy": self.lr_policy.state()})
            await asyncio.to_thread(checkpoint.save, target, state)
        self.checkpointer.on_disk(target, clock)
        log.info("checkpoint of update %d written to %s", clock, target)
        return clock

    def _checkpoint_info(self) -> dict[str, Any]:
        cfg = self.config
        return {"server": f"rudra-async {__version__}", "protocol": self.protocol.describe(), "kernel": self.kernel,
                "lr": cfg.lr, "lr_policy": cfg.lr_policy, "momentum": cfg.momentum, "weight_decay": cfg.weight_decay,
                "nesterov": cfg.nesterov}

    def _restore(self, path: str) -> None:
        state = checkpoint.load(path)
        if state.shard != self.shard:
            raise ConfigError(f"{path} holds shard {state.shard}, but this server is shard {self.shard}")
        self._create_store(state.layout, state.weights)
        self.store.clock = state.clock
        self.protocol.start_at(state.clock)
        self.store.updater.load_momentum(state.momentum)
        self.samples_seen = state.samples
        try:
            self.staleness.load(state.state.get("staleness", {}))
            self.lr_policy.load_state(state.state.get("lr_policy", {}))
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{path} has a bad 'state' entry: {exc}") from None
        self.checkpointer.on_disk(path, state.clock, written=False)
        log.info("resumed from %s: update %d, %d parameters", path, state.clock, state.layout.size)

    def _create_store(self, layout: Layout, shard_weights: np.ndarray) -> None:
        """Hold this server's shard of a model with the given (whole) layout."""
        self.layout = layout
        self.store = WeightStore(self.shard.layout(layout), shard_weights, self.kernel, *self._shared_memory())

    # -- waiting ------------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self.waiting.clear()  # every waiter re-checks; those still blocked re-enter

    async def _until(self, ready: Callable[[], bool], conn: Connection, learner: int) -> None:
        """Wait until ``ready()`` (re-checked on every state change), the run stops or closes.
        Raises PeerGone if the connection is lost meanwhile. ``waiting`` holds the learners
        blocked here (the simulator's scheduler reads it)."""
        if ready() or self.stopped or self.closing:
            return
        lost = asyncio.ensure_future(conn.wait_lost())
        try:
            while not (ready() or self.stopped or self.closing):
                self.waiting.add(learner)
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({changed, lost}, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if lost.done():
                    raise PeerGone("connection lost while waiting")
        finally:
            self.waiting.discard(learner)
            lost.cancel()

    # -- the update path ----------------------------------------------------------------------
    def _decide(self, decision: Decision) -> None:
        """Carry out a protocol decision: apply its batches in order, count its drops. Once the
        run has stopped, batches still released (gradients a protocol held) are not applied:
        their pushes are answered ``dropped`` and counted under ``rejected["stopped"]``."""
        for batch in decision.updates:
            if self.stopped:
                for g in batch:
                    self._drop(g)
                    self._reject("stopped")
            else:
                self._apply_batch(batch)
        for g in decision.dropped:
            self._drop(g)
            self.learners[g.learner].dropped += 1
        if decision.updates or decision.dropped:
            self._notify()
        if decision.updates:
            self.checkpointer.after_update(self.clock)

    @staticmethod
    def _drop(g: Gradient) -> None:
        pending: _Pending = g.payload
        pending.outcome = "dropped"
        pending.frame.release()

    def _apply_batch(self, batch: list[Gradient]) -> None:
        store = self.store
        assert store is not None
        cfg = self.config
        clock, c = store.clock, len(batch)
        sigmas = [clock - g.stamp for g in batch]
        for s in sigmas:
            self.lr_policy.observe(s)
        pendings: list[_Pending] = [g.payload for g in batch]
        samples = sum(p.samples for p in pendings)
        epoch = self.samples_seen / cfg.samples_per_epoch if cfg.samples_per_epoch else None
        base = self.schedule.rate(clock, epoch, samples or None)
        scales = [self.lr_policy.factor(s) / c for s in sigmas]
        t0 = time.perf_counter()
        store.apply([p.grad for p in pendings], scales, base, cfg.momentum, cfg.weight_decay, cfg.nesterov)
        self.update_seconds += time.perf_counter() - t0
        self.samples_seen += samples
        now = time.monotonic()
        self.first_update_at = self.first_update_at or now
        self.last_update_at = now
        for g, p, s in zip(batch, pendings, sigmas):
            self.staleness.add(s)
            self.learners[g.learner].applied += 1
            p.outcome, p.staleness = "applied", s
            p.frame.release()

    # -- connections --------------------------------------------------------------------------
    def _allocate(self, msg_type: int, meta: dict[str, Any], nbytes: int) -> None:
        """Once the layout is known, refuse bodies far larger than any valid request (memory safety).

        Up to twice the model size is still read, so a float64 gradient gets a precise
        ``bad_dtype`` answer instead of a dropped connection.
        """
        if self.store is not None and nbytes > 2 * self.store.layout.nbytes + 65536:
            raise FrameTooLarge(f"body of {nbytes} bytes is far larger than the model ({self.store.layout.nbytes} bytes)")
        return None  # the reader's reusable pool takes it

    async def _handle(self, conn: Connection) -> None:
        conn.allocator = self._allocate
        session = _Session(self, conn)
        try:
            await session.run()
        finally:
            learner = session.learner
            if learner is not None:
                learner.connected = False
                self._decide(self.protocol.leave(learner.learner_id))
                self._notify()
                log.info("learner %d (%s) left", learner.learner_id, learner.name)

    def _shared_memory(self) -> tuple[Any, Any]:
        """(allocate, free) of memory a listening transport sends without copying, if any."""
        for url in self.config.listen:
            shared = transports.transport_for(url).shared_memory()
            if shared is not None:
                return shared.allocate, shared.free
        return None, None

    def _reject(self, code: str) -> None:
        self.rejected[code] = self.rejected.get(code, 0) + 1

    def _register(self, meta: dict[str, Any], frame: Frame, peer: str) -> LearnerInfo:
        layout = Layout.from_wire(meta.get("layout"))
        shard = Shard.from_wire(meta.get("shard"))
        if shard != self.shard:
            raise RequestError(f"this server is shard {self.shard}; the learner asked for shard {shard}",
                               code="shard_mismatch")
        if self.store is None:
            arrays = frame.arrays
            try:
                lo, hi = self.shard.range(layout.size)
            except ConfigError as exc:
                raise RequestError(str(exc), code="bad_layout") from None
            if len(arrays) != 1 or arrays[0].dtype != np.float32 or arrays[0].size != hi - lo:
                raise RequestError(
                    "the server has no weights yet: the first hello must carry the initial weights "
                    f"(of shard {self.shard}) as one float32 segment of {hi - lo} values",
                    code="no_weights",
                )
            self._create_store(layout, arrays[0].reshape(-1))
            assert self._initialized is not None
            self._initialized.set()
            log.info("weights initialized by %s: %d parameters in %d tensors", peer, layout.size, len(layout.tensors))
        elif self.layout is None or layout.to_wire() != self.layout.to_wire():
            raise RequestError("the learner's parameter layout differs from the server's", code="layout_mismatch")
        info = LearnerInfo(self._next_id, str(meta.get("name", "")), peer)
        self._next_id += 1
        self.learners[info.learner_id] = info
        self._decide(self.protocol.join(info.learner_id))
        self._notify()
        log.info("learner %d (%s) joined from %s", info.learner_id, info.name, peer)
        return info

    def _accept_push(self, learner: LearnerInfo, meta: dict[str, Any], frame: Frame) -> tuple[_Pending, Decision]:
        """Validate a push and hand it to the protocol. The frame is kept until its update."""
        store = self.store
        assert store is not None
        stamp = _int_field(meta, "timestamp")
        samples = _int_field(meta, "samples", 0)
        if not 0 <= stamp <= store.clock:
            raise RequestError(f"timestamp {stamp} is outside [0, {store.clock}]", code="bad_timestamp")
        if samples < 0:
            raise RequestError(f"samples must be >= 0, got {samples}", code="bad_request")
        if self.stopped:
            raise RequestError(f"the run is over ({self.config.max_updates} updates)", code="stopped")
        specs = frame.specs
        if len(specs) != 1 or specs[0].shape != (store.layout.size,):
            shapes = [list(s.shape) for s in specs]
            raise RequestError(f"gradient must be one segment of shape [{store.layout.size}], got {shapes}", code="bad_shape")
        if specs[0].dtype not in (np.float32, np.float16):
            raise RequestError(f"gradient dtype must be <f4 or <f2, got {specs[0].dtype.str}", code="bad_dtype")
        grad = frame.arrays[0]
        if not np.isfinite(grad).all():
            raise RequestError("gradient contains NaN or infinity", code="bad_gradient")
        loss = meta.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool) and len(self.losses) < 1_000_000:
            self.losses.append((store.clock, float(loss)))
        pending = _Pending(frame, grad, samples)
        decision = self.protocol.push(Gradient(learner.learner_id, stamp, pending))
        self._decide(decision)
        return pending, decision


class _Session:
    """One connection's request loop. Knows the learner once it said hello."""

    def __init__(self, server: ParameterServer, conn: Connection) -> None:
        self.server = server
        self.conn = conn
        self.learner: LearnerInfo | None = None

    async def run(self) -> None:
        conn = self.conn
        while True:
            try:
                frame = await conn.recv()
            except WireError as exc:  # fatal: the stream lost sync
                self._log_bad(exc.code, str(exc))
                await self._send_error(exc.code, str(exc), fatal=True, seq=None)
                return
            keep = False
            try:
                done, keep = await self._dispatch(frame)
            except RequestError as exc:
                self._log_bad(exc.code, str(exc))
                await self._send_error(exc.code, str(exc), fatal=False, seq=frame.meta.get("seq"))
                done = False
            finally:
                if not keep:
                    frame.release()
            if done:
                return

    def _log_bad(self, code: str, message: str) -> None:
        self.server._reject(code)
        who = f"learner {self.learner.learner_id}" if self.learner else "unregistered peer"
        log.warning("rejected input from %s (%s): [%s] %s", self.conn.peer, who, code, message)

    async def _send_error(self, code: str, message: str, *, fatal: bool, seq: Any) -> None:
        meta = {"code": code, "message": message, "fatal": fatal}
        if seq is not None:
            meta["seq"] = seq
        try:
            await self.conn.send(MsgType.ERROR, meta)
        except RudraError:
            pass

    async def _reply(self, msg_type: MsgType, meta: dict[str, Any], request: dict[str, Any], arrays=()) -> None:
        if "seq" in request:
            meta["seq"] = request["seq"]
        await self.conn.send(msg_type, meta, arrays)

    async def _dispatch(self, frame: Frame) -> tuple[bool, bool]:
        """Handle one request. Returns (end the connection, the frame now belongs to the protocol)."""
        if frame.error is not None:
            raise RequestError(str(frame.error), code=frame.error.code)
        meta = frame.meta
        server = self.server
        kind = frame.msg_type
        if kind == MsgType.HELLO:
            if self.learner is not None:
                raise RequestError("hello twice on one connection", code="bad_request")
            self.learner = server._register(meta, frame, self.conn.peer)
            store, layout = server.store, server.layout
            assert store is not None and layout is not None
            welcome = {
                "learner_id": self.learner.learner_id,
                "layout": layout.to_wire(),
                "shard": server.shard.to_wire(),
                "range": list(server.shard.range(layout.size)),
                **server.protocol.describe(),
                "clock": store.clock,
                "server": f"rudra-async {__version__}",
                "pid": os.getpid(),
            }
            await self._reply(MsgType.WELCOME, welcome, meta)
            return False, False
        if kind == MsgType.BYE:
            await self._reply(MsgType.BYE, {}, meta)
            return True, False
        if kind not in (MsgType.PUSH, MsgType.PULL):
            raise RequestError(f"unknown message type {kind}", code="unknown_type")
        if self.learner is None:
            raise RequestError("say hello before push or pull", code="not_registered")
        learner_id = self.learner.learner_id
        if kind == MsgType.PUSH:
            if meta.get("learner_id", learner_id) != learner_id:
                raise RequestError(f"learner id {meta.get('learner_id')!r} is not this connection's", code="bad_request")
            pending, decision = server._accept_push(self.learner, meta, frame)
            if decision.wait_applied:
                await server._until(lambda: pending.outcome != "pending", self.conn, learner_id)
            if not meta.get("pull"):
                ack = {"timestamp": server.clock, "status": pending.outcome, "staleness": pending.staleness,
                       "stop": server.stopped}
                await self._reply(MsgType.ACK, ack, meta)
                return False, True
            floor = -1
        else:
            floor = _int_field(meta, "newer_than", -1)
        await server._until(lambda: server.clock > max(floor, server.protocol.pull_floor(learner_id)), self.conn,
                            learner_id)
        await self._send_weights(meta)
        return False, kind == MsgType.PUSH

    async def _send_weights(self, request: dict[str, Any]) -> None:
        server = self.server
        store = server.store
        assert store is not None and self.learner is not None
        with store.lease() as (clock, weights):
            await self._reply(MsgType.WEIGHTS, {"timestamp": clock, "stop": server.stopped}, request, [weights])
        server._decide(server.protocol.pulled(self.learner.learner_id, clock))

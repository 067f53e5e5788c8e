"""The parameter server: transport → request handling → update kernel, on one event loop.

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
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import __version__, transports
from .config import ServerConfig
from .errors import FrameTooLarge, RequestError, RudraError, WireError
from .layout import Layout
from .stats import StalenessHistogram
from .store import WeightStore
from .transports.base import Connection, Listener
from .wire import Frame, Limits, MsgType

log = logging.getLogger(__name__)


@dataclass
class LearnerInfo:
    learner_id: int
    name: str
    peer: str
    joined_at: float = field(default_factory=time.monotonic)
    gradients: int = 0
    connected: bool = True


def _int_field(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(f"field {key!r} must be an integer, got {value!r}", code="bad_request")
    return value


class ParameterServer:
    def __init__(self, config: ServerConfig | None = None, *, initial: dict[str, np.ndarray] | None = None) -> None:
        self.config = (config or ServerConfig()).validate()
        self.limits = Limits(max_body=self.config.max_frame)
        self.store: WeightStore | None = None
        if initial is not None:
            layout = Layout.from_shapes((k, np.shape(a)) for k, a in initial.items())
            flat = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in initial.values()])
            self.store = WeightStore(layout, flat)
        self.learners: dict[int, LearnerInfo] = {}
        self.staleness = StalenessHistogram()
        self.rejected: dict[str, int] = {}
        self._next_id = 0
        self._listeners: list[Listener] = []
        self._closed: asyncio.Event | None = None
        self._initialized: asyncio.Event | None = None
        self.update_seconds = 0.0  # time spent in the update kernel
        self.first_update_at: float | None = None
        self.last_update_at: float | None = None

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
        log.info("parameter server listening on %s (protocol %s)", ", ".join(self.addresses), self.config.protocol)

    async def serve(self) -> None:
        """Run until :meth:`close` is called (starts the server if needed)."""
        if self._closed is None:
            await self.start()
        assert self._closed is not None
        await self._closed.wait()

    async def close(self) -> None:
        """Stop listening and drop every connection. Idempotent."""
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        if self._closed is not None:
            self._closed.set()

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
        """Statistics for reports: clock, staleness, per-learner gradients, rejections."""
        return {
            "protocol": self.config.protocol,
            "updates": self.clock,
            "gradients": self.staleness.total,
            "update_seconds": self.update_seconds,
            **self.staleness.summary(),
            "learners": {str(i): {"name": l.name, "gradients": l.gradients} for i, l in self.learners.items()},
            "rejected": dict(self.rejected),
        }

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
            if session.learner is not None:
                session.learner.connected = False
                log.info("learner %d (%s) left", session.learner.learner_id, session.learner.name)

    def _reject(self, code: str) -> None:
        self.rejected[code] = self.rejected.get(code, 0) + 1

    def _register(self, meta: dict[str, Any], frame: Frame, peer: str) -> LearnerInfo:
        layout = Layout.from_wire(meta.get("layout"))
        if self.store is None:
            arrays = frame.arrays
            if len(arrays) != 1 or arrays[0].dtype != np.float32 or arrays[0].size != layout.size:
                raise RequestError(
                    "the server has no weights yet: the first hello must carry the initial weights "
                    f"as one float32 segment of {layout.size} values",
                    code="no_weights",
                )
            self.store = WeightStore(layout, arrays[0].reshape(-1))
            assert self._initialized is not None
            self._initialized.set()
            log.info("weights initialized by %s: %d parameters in %d tensors", peer, layout.size, len(layout.tensors))
        elif layout.to_wire() != self.store.layout.to_wire():
            raise RequestError("the learner's parameter layout differs from the server's", code="layout_mismatch")
        info = LearnerInfo(self._next_id, str(meta.get("name", "")), peer)
        self._next_id += 1
        self.learners[info.learner_id] = info
        log.info("learner %d (%s) joined from %s", info.learner_id, info.name, peer)
        return info

    def _apply_push(self, learner: LearnerInfo, meta: dict[str, Any], frame: Frame) -> int:
        """Validate a push and fold it in (async protocol). Returns its staleness."""
        store = self.store
        assert store is not None
        stamp = _int_field(meta, "timestamp")
        if not 0 <= stamp <= store.clock:
            raise RequestError(f"timestamp {stamp} is outside [0, {store.clock}]", code="bad_timestamp")
        if self.stopped:
            raise RequestError(f"the run is over ({self.config.max_updates} updates)", code="stopped")
        specs = frame.specs
        if len(specs) != 1 or specs[0].shape != (store.layout.size,):
            shapes = [list(s.shape) for s in specs]
            raise RequestError(f"gradient must be one segment of shape [{store.layout.size}], got {shapes}", code="bad_shape")
        if specs[0].dtype != np.float32:
            raise RequestError(f"gradient dtype must be <f4, got {specs[0].dtype.str}", code="bad_dtype")
        grad = frame.arrays[0]
        if not np.isfinite(grad).all():
            raise RequestError("gradient contains NaN or infinity", code="bad_gradient")
        sigma = store.clock - stamp
        cfg = self.config
        t0 = time.perf_counter()
        store.apply([grad], [1.0], cfg.lr, cfg.momentum, cfg.weight_decay, cfg.nesterov)
        self.update_seconds += time.perf_counter() - t0
        now = time.monotonic()
        self.first_update_at = self.first_update_at or now
        self.last_update_at = now
        self.staleness.add(sigma)
        learner.gradients += 1
        return sigma


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
            try:
                done = await self._dispatch(frame)
            except RequestError as exc:
                self._log_bad(exc.code, str(exc))
                await self._send_error(exc.code, str(exc), fatal=False, seq=frame.meta.get("seq"))
                done = False
            finally:
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

    async def _dispatch(self, frame: Frame) -> bool:
        """Handle one request; True when the connection should end."""
        if frame.error is not None:
            raise RequestError(str(frame.error), code=frame.error.code)
        meta = frame.meta
        server = self.server
        kind = frame.msg_type
        if kind == MsgType.HELLO:
            if self.learner is not None:
                raise RequestError("hello twice on one connection", code="bad_request")
            self.learner = server._register(meta, frame, self.conn.peer)
            store = server.store
            assert store is not None
            await self._reply(
                MsgType.WELCOME,
                {
                    "learner_id": self.learner.learner_id,
                    "layout": store.layout.to_wire(),
                    "protocol": server.config.protocol,
                    "clock": store.clock,
                    "server": f"rudra-async {__version__}",
                    "pid": os.getpid(),
                },
                meta,
            )
            return False
        if kind == MsgType.BYE:
            await self._reply(MsgType.BYE, {}, meta)
            return True
        if kind not in (MsgType.PUSH, MsgType.PULL):
            raise RequestError(f"unknown message type {kind}", code="unknown_type")
        if self.learner is None:
            raise RequestError("say hello before push or pull", code="not_registered")
        if kind == MsgType.PUSH:
            learner_id = meta.get("learner_id", self.learner.learner_id)
            if learner_id != self.learner.learner_id:
                raise RequestError(f"learner id {learner_id!r} is not this connection's", code="bad_request")
            sigma = server._apply_push(self.learner, meta, frame)
            frame.release()  # the gradient is folded in; its buffer can take the next frame
            if not meta.get("pull"):
                await self._reply(MsgType.ACK, {"timestamp": server.clock, "staleness": sigma, "stop": server.stopped}, meta)
                return False
        else:
            newer_than = _int_field(meta, "newer_than", -1)
            if not server.stopped:
                assert server.store is not None
                await server.store.wait_newer(newer_than)
        await self._send_weights(meta)
        return False

    async def _send_weights(self, request: dict[str, Any]) -> None:
        store = self.server.store
        assert store is not None
        with store.lease() as (clock, weights):
            await self._reply(MsgType.WEIGHTS, {"timestamp": clock, "stop": self.server.stopped}, request, [weights])

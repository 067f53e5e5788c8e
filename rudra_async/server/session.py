"""One connection's conversation with the server, as an explicit state machine.

::

    AWAITING_HELLO --HELLO--> READY --BYE--> CLOSED
          |                     |
          +------BYE------------+--> CLOSED   (or the connection is lost, or a fatal framing error)

Each state accepts a fixed set of message types; every request gets exactly one reply (an
ERROR with a stable code for anything refused). A handshake step such as authentication
is one more state in front of AWAITING_HELLO.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import RequestError, RudraError, WireError
from ..logs import rate_limited
from ..transports.base import Connection
from ..wire import Frame, MsgType
from .core import LearnerInfo, int_field

if TYPE_CHECKING:
    from .parameter_server import ParameterServer

log = rate_limited(logging.getLogger(__name__))  # peers provoke its messages


class State(enum.Enum):
    AWAITING_HELLO = "awaiting hello"
    READY = "ready"
    CLOSED = "closed"


class Session:
    """Serves one connection until BYE, loss of the connection, or a fatal framing error."""

    def __init__(self, server: ParameterServer, conn: Connection) -> None:
        self.server = server
        self.core = server.core
        self.conn = conn
        self.state = State.AWAITING_HELLO
        self.learner: LearnerInfo | None = None
        self.said_bye = False
        self._handlers: dict[State, dict[int, Callable[[Frame], Awaitable[None]]]] = {
            State.AWAITING_HELLO: {MsgType.HELLO: self._hello, MsgType.BYE: self._bye},
            State.READY: {MsgType.PUSH: self._push, MsgType.PULL: self._pull, MsgType.BYE: self._bye},
        }

    async def run(self) -> None:
        try:
            while self.state is not State.CLOSED:
                try:
                    frame = await self.conn.recv()
                except WireError as exc:  # fatal: the byte stream lost sync
                    await self._refuse(exc.code, str(exc), fatal=True, seq=None)
                    return
                try:
                    await self._dispatch(frame)
                except RequestError as exc:
                    await self._refuse(exc.code, str(exc), fatal=False, seq=frame.meta.get("seq"))
                finally:
                    frame.release()  # a no-op for a frame the core took
        finally:
            self.state = State.CLOSED
            if self.learner is not None:
                self.core.leave(self.learner, clean=self.said_bye)

    async def _dispatch(self, frame: Frame) -> None:
        if frame.error is not None:
            raise RequestError(str(frame.error), code=frame.error.code)
        handler = self._handlers[self.state].get(frame.msg_type)
        if handler is not None:
            await handler(frame)
            return
        if frame.msg_type not in (MsgType.HELLO, MsgType.PUSH, MsgType.PULL):
            raise RequestError(f"unknown message type {frame.msg_type}", code="unknown_type")
        if self.state is State.AWAITING_HELLO:
            raise RequestError("say hello before push or pull", code="not_registered")
        raise RequestError("hello twice on one connection", code="bad_request")

    # -- handlers, one per (state, message type) --------------------------------------------
    async def _hello(self, frame: Frame) -> None:
        self.learner = self.core.register(frame.meta, frame.arrays, self.conn.peer)
        self.state = State.READY
        await self._reply(MsgType.WELCOME, self.core.welcome(self.learner), frame.meta)

    async def _bye(self, frame: Frame) -> None:
        self.said_bye = True
        await self._reply(MsgType.BYE, {}, frame.meta)
        self.state = State.CLOSED

    async def _push(self, frame: Frame) -> None:
        learner = self._learner()
        pending = self.core.push(learner, frame.meta, frame)  # the core takes the frame
        if pending.wait_applied:
            await self.server.wait_until(lambda: pending.settled, self.conn, learner.learner_id)
        if frame.meta.get("pull"):
            await self._send_weights(frame.meta, newer_than=-1)
        else:
            ack = {
                "timestamp": self.core.clock,
                "status": pending.outcome,
                "staleness": pending.staleness,
                "stop": self.core.stopped,
            }
            await self._reply(MsgType.ACK, ack, frame.meta)

    async def _pull(self, frame: Frame) -> None:
        await self._send_weights(frame.meta, newer_than=int_field(frame.meta, "newer_than", -1))

    # -- replies ------------------------------------------------------------------------------
    def _learner(self) -> LearnerInfo:
        assert self.learner is not None, "READY implies a registered learner"
        return self.learner

    async def _send_weights(self, request: dict[str, Any], newer_than: int) -> None:
        """WEIGHTS once the protocol lets this learner have newer weights than ``newer_than``."""
        learner, core = self._learner(), self.core
        await self.server.wait_until(
            lambda: core.pull_ready(learner.learner_id, newer_than), self.conn, learner.learner_id
        )
        store = core.store
        assert store is not None, "READY implies weights"
        with store.lease() as (clock, weights):
            await self._reply(MsgType.WEIGHTS, {"timestamp": clock, "stop": core.stopped}, request, [weights])
        core.pulled(learner, clock)

    async def _reply(
        self, msg_type: MsgType, meta: dict[str, Any], request: dict[str, Any], arrays: Sequence[np.ndarray] = ()
    ) -> None:
        if "seq" in request:
            meta["seq"] = request["seq"]
        await self.conn.send(msg_type, meta, arrays)

    async def _refuse(self, code: str, message: str, *, fatal: bool, seq: Any) -> None:
        """Count, log and answer a refused request; a fatal refusal ends the session."""
        self.core.reject(code)
        who = f"learner {self.learner.learner_id}" if self.learner else "unregistered peer"
        log.warning("rejected input from %s (%s): [%s] %s", self.conn.peer, who, code, message, extra={"code": code})
        meta: dict[str, Any] = {"code": code, "message": message, "fatal": fatal}
        if seq is not None:
            meta["seq"] = seq
        if fatal:
            self.state = State.CLOSED
        try:
            await self.conn.send(MsgType.ERROR, meta)
        except RudraError:
            pass

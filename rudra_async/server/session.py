"""One connection's conversation with the server, as an explicit state machine.

::

    AUTHENTICATING --AUTH--> CHALLENGED --PROOF--> AWAITING_HELLO --HELLO--> READY --BYE--> CLOSED
          |                       |                      |                      |
          +-- anything else, a wrong proof: fatal -------+------BYE-------------+--> CLOSED

A server without a secret starts connections in AWAITING_HELLO. Each state accepts a fixed
set of message types, one handler per (state, type); every request gets exactly one reply
(an ERROR with a stable code for anything refused). The session also owns the
connection's limits, which depend on its state and are in force from the first byte
(:meth:`Session.admit`, installed when the connection is accepted), and its deadline
(handshake, idle, a reply not read), which the server's watchdog enforces.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from .. import schema, security
from ..errors import FrameTooLarge, RequestError, RudraError, WireError
from ..transports.base import Connection
from ..wire import Frame, Header, MsgType
from .core import LearnerInfo

if TYPE_CHECKING:
    from ..transports.offload import Gate
    from .parameter_server import ParameterServer

log = logging.getLogger(__name__)

#: largest metadata of a handshake frame (AUTH, PROOF); they carry no body
HANDSHAKE_META = 1024
#: largest metadata and body of any frame but HELLO before the hello
PRE_HELLO_FRAME = 64 * 1024
#: slack over twice the model's size for a body once the layout is known
BODY_SLACK = 65536
#: the largest model (values) whose push+pull :meth:`Session.express` answers: its reply
#: carries a copy of the weights (256 KiB here, a few µs)
EXPRESS_MAX_VALUES = 1 << 16
AUTH_REQUIRED = "this server requires authentication (a shared secret) before any other message"


#: characters of an ERROR reply's message at most (docs/wire.md)
MESSAGE_MAX = 1000
#: bytes of a WELCOME besides the layout and groups it echoes: its other fields (a few
#: hundred bytes, a plugin protocol's description included) and the request's ``seq``
WELCOME_RESERVE = schema.MAX_SEQ_BYTES + 4096


class State(enum.Enum):
    AUTHENTICATING = "authenticating"
    CHALLENGED = "challenged"
    AWAITING_HELLO = "awaiting hello"
    READY = "ready"
    CLOSED = "closed"


Handler = Callable[["Session", Frame], Awaitable[None]]


class Session:
    """Serves one connection until BYE, loss of the connection, a fatal error or its deadline."""

    def __init__(self, server: ParameterServer, conn: Connection) -> None:
        self.server = server
        self.core = server.core
        self.conn = conn
        self.secret = server.secret
        self.state = State.AUTHENTICATING if self.secret is not None else State.AWAITING_HELLO
        self.learner: LearnerInfo | None = None
        self._client_nonce = b""
        self._server_nonce = b""
        #: when the watchdog closes this connection (None: no deadline now), and why
        self.deadline: float | None = self.server.now() + server.config.handshake_timeout
        self.deadline_code = "handshake_timeout"
        self.said_bye = False
        self._heard = False  # a frame of this peer was read
        self._initial_bytes = 0  # of the server's budget for initial weights, held by this connection's HELLO

    @property
    def progress(self) -> tuple[int, float]:
        """How far the handshake got, for choosing whom to close when too many connections have
        not said hello: (0: nothing read, 1: authenticating, 2: ready for hello; the deadline,
        so that among equals the oldest is least)."""
        stage = 2 if self.state is State.AWAITING_HELLO and self._heard else 1 if self._heard else 0
        return stage, self.deadline or 0.0

    # -- limits, in force from the first byte ----------------------------------------------
    def admit(self, header: Header) -> None:
        """Refuse (fatally, before anything of it is allocated) a frame larger than this
        state allows: the handshake frames are tiny and carry no body; before HELLO every
        other frame is small; the HELLO may bring the initial weights (``--max-model-bytes``)
        to a server without weights; once the model exists, no body may be far larger than it."""
        state = self.state
        if state in (State.AUTHENTICATING, State.CHALLENGED):
            if header.meta_len > HANDSHAKE_META or header.body_len:
                raise FrameTooLarge(
                    f"a frame of {header.meta_len}+{header.body_len} bytes before authentication",
                    msg_type=header.msg_type,
                )
            return
        store = self.core.store
        if state is State.AWAITING_HELLO and header.msg_type != MsgType.HELLO:
            if header.meta_len > PRE_HELLO_FRAME or header.body_len > PRE_HELLO_FRAME:
                raise FrameTooLarge(
                    f"a frame of {header.meta_len}+{header.body_len} bytes before hello", msg_type=header.msg_type
                )
            return
        if store is None:
            limit = self.server.config.max_model_bytes
            if header.body_len > limit:
                raise FrameTooLarge(
                    f"body of {header.body_len} bytes: the initial weights may have at most {limit} (--max-model-bytes)",
                    msg_type=header.msg_type,
                )
            self._release_initial()
            if not self.server.initial_bytes.take(header.body_len):
                raise FrameTooLarge(
                    f"body of {header.body_len} bytes: other connections are bringing initial weights of "
                    f"{self.server.initial_bytes.taken} bytes, and all of them may hold at most "
                    f"{self.server.initial_bytes.limit} (twice --max-model-bytes) until the model exists; try again",
                    msg_type=header.msg_type,
                )
            self._initial_bytes = header.body_len
        elif header.body_len > self._body_limit(header.msg_type, store.layout.nbytes):
            raise FrameTooLarge(
                f"body of {header.body_len} bytes is far larger than the model ({store.layout.nbytes} bytes)",
                msg_type=header.msg_type,
            )

    def _release_initial(self) -> None:
        """Give back the memory budget this connection's initial weights held (read or dropped)."""
        self.server.initial_bytes.give_back(self._initial_bytes)
        self._initial_bytes = 0

    def _body_limit(self, msg_type: int, model_bytes: int) -> int:
        """The largest body a frame of ``msg_type`` may have once the model exists: twice the
        model's float32 size (a float64 gradient is still read, to be answered ``bad_dtype``),
        or for STATE the frozen parameters' and buffers' size, plus :data:`BODY_SLACK`."""
        state = self.core.state
        if msg_type == MsgType.STATE and state is not None:
            return state.layout.nbytes + BODY_SLACK
        return 2 * model_bytes + BODY_SLACK

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while self.state is not State.CLOSED:
                self._await_request()
                self.conn.express = self.express if self.state is State.READY else None
                try:
                    frame = await self.conn.recv()
                except WireError as exc:  # fatal: the byte stream lost sync
                    code = self._fatal_code(exc)
                    message = AUTH_REQUIRED if code == "auth_required" else str(exc)
                    await self._refuse(code, message, fatal=True, request={})
                    return
                finally:
                    self.conn.express = None
                self._heard = True
                self._release_initial()  # read: the frame owns its bytes now (or the model exists)
                if self.state is State.READY:  # the handshake's deadline stays, from accept to hello
                    self.deadline = None
                learner = self.learner
                if learner is not None:
                    self.core.active(learner)
                try:
                    await self._dispatch(frame)
                except RequestError as exc:  # during the handshake every refusal is fatal
                    fatal = exc.code in FATAL or self.state in (State.AUTHENTICATING, State.CHALLENGED)
                    await self._refuse(exc.code, str(exc), fatal=fatal, request=frame.meta)
                finally:
                    frame.release()  # a no-op for a frame the core took
                    if learner is not None:
                        self.core.idle(learner)
        finally:
            self._release_initial()
            if self.state is State.CHALLENGED:  # a peer that took a challenge and never proved anything
                self.server.refused("auth_abandoned", f"{self.conn.peer}: left the handshake after its CHALLENGE")
            self.state = State.CLOSED
            if self.learner is not None:  # the server closing ends it as orderly as a bye
                self.core.leave(self.learner, clean=self.said_bye or self.server.closing)

    def express(self, frame: Frame) -> bool:
        """Answer a push+pull from the transport's callback, while this session waits for a
        request (the connection's ``express`` hook): True when answered. Only where the
        reply can be given at once — a protocol that ``answers_at_once``, a model of at
        most :data:`EXPRESS_MAX_VALUES` values updated on this thread, a transport that can
        send now — and with the same reply, core calls and deadline as :meth:`_push`; the
        reply carries a copy of the weights (the transport may send it later). Anything
        else, a refused push included, is declined (False) and goes the usual way. An
        unexpected error closes the connection (the frame is taken: True)."""
        core, store, learner = self.core, self.core.store, self.learner
        if not (
            frame.msg_type == MsgType.PUSH
            and frame.meta.get("pull") is True
            and frame.error is None
            and schema.seq_fits(frame.meta)
            and frame.written is None
            and learner is not None
            and core.protocol.answers_at_once
            and store is not None
            and store.layout.size <= EXPRESS_MAX_VALUES
            and store.updates_inline
            and self.conn.nowait_room(store.layout.nbytes)
            and core.pull_ready(learner.learner_id)
        ):
            return False
        core.active(learner)
        try:
            try:
                pending = core.push(learner, frame.meta, frame)
            except RequestError:
                return False  # refused before anything changed: the session refuses it the usual way
            if pending.wait_applied or not pending.settled:
                raise RudraError(
                    f"protocol {core.protocol.name!r} declares answers_at_once but held a gradient or made "
                    "its pusher wait (a subclass that waits must set answers_at_once = False)"
                )
            clock = store.clock
            reply = _answering(self._weights_meta(clock), frame.meta)
            try:
                self.conn.send_nowait(MsgType.WEIGHTS, reply, [store.weights.copy()])
            except FrameTooLarge as exc:  # nothing of it went out: say so instead
                self.conn.send_nowait(MsgType.ERROR, self._unencodable(MsgType.WEIGHTS, exc))
            else:
                core.pulled(learner, clock)
        except Exception:  # from a transport callback: end this session as a failed handler would
            log.exception("answering a push+pull of learner %d failed; closing %s", learner.learner_id, self.conn.peer)
            self.conn.close()
            return True
        finally:
            core.idle(learner)
        self._await_request()
        return True

    def notify_shutdown(self, reason: str) -> None:
        """The server is shutting down: tell a registered learner so (a fatal ERROR
        ``shutting_down``, without ``seq``, the reply its next request reads) before its
        connection closes, where the transport can send it now; best effort."""
        if self.state is State.READY:  # no hang_up: a lingering close would outlive the server's loop
            message = f"the server is shutting down: {reason}"
            self.conn.tell(MsgType.ERROR, {"code": "shutting_down", "message": message, "fatal": True})

    def _await_request(self) -> None:
        """Set the deadline for the next request: the handshake's (fixed at accept) until
        hello, then the idle timeout."""
        if self.state is State.READY:
            idle = self.server.config.idle_timeout
            self.deadline = self.server.now() + idle if idle else None
            self.deadline_code = "idle_timeout"

    def _fatal_code(self, exc: WireError) -> str:
        """A frame too large for an unauthenticated peer that is a learner's request means the
        peer does not authenticate: say so rather than ``frame_too_large``."""
        requests = (MsgType.HELLO, MsgType.PUSH, MsgType.PULL, MsgType.STATE, MsgType.BYE)
        if self.state is State.AUTHENTICATING and isinstance(exc, FrameTooLarge) and exc.msg_type in requests:
            return "auth_required"
        return exc.code

    def expire(self) -> None:
        """The deadline passed: count, log and close (the loop then ends with the connection)."""
        self.server.refused(self.deadline_code, f"{self.conn.peer}: {self._expired_because()}")
        self.deadline = None
        self.conn.close()

    def _expired_because(self) -> str:
        cfg = self.server.config
        if self.deadline_code == "handshake_timeout":
            return f"no hello within {cfg.handshake_timeout:g} s"
        if self.deadline_code == "reply_not_read":
            return f"a reply not read within {cfg.idle_timeout:g} s"
        if self.deadline_code == "push_not_written":
            return f"a gradient not written within {cfg.idle_timeout:g} s"
        return f"no request for {cfg.idle_timeout:g} s"

    async def _dispatch(self, frame: Frame) -> None:
        if frame.error is not None:
            if self.state in (State.AUTHENTICATING, State.CHALLENGED):
                raise RequestError("authenticate first", code="auth_required")
            raise RequestError(str(frame.error), code=frame.error.code)
        schema.check_seq(frame.meta)  # any request: its reply must be able to echo it
        handler = HANDLERS[self.state].get(frame.msg_type)
        if handler is not None:
            await handler(self, frame)
            return
        if self.state is State.AUTHENTICATING:
            raise RequestError(AUTH_REQUIRED, code="auth_required")
        if self.state is State.CHALLENGED:
            raise RequestError("expected the proof (PROOF)", code="auth_failed")
        if frame.msg_type == MsgType.AUTH:
            if self.secret is None:
                raise RequestError("this server has no secret: it cannot authenticate", code="auth_unavailable")
            raise RequestError("already authenticated", code="bad_request")
        if frame.msg_type not in (MsgType.HELLO, MsgType.PUSH, MsgType.PULL, MsgType.STATE):
            raise RequestError(f"unknown message type {frame.msg_type}", code="unknown_type")
        if self.state is State.AWAITING_HELLO:
            raise RequestError("say hello before push or pull", code="not_registered")
        raise RequestError("hello twice on one connection", code="bad_request")

    # -- handlers, one per (state, message type) --------------------------------------------
    async def _auth(self, frame: Frame) -> None:
        """The server's nonce, and nothing derived from the secret: the learner proves first
        (a proof from the server to any peer would let it test guesses of the secret offline)."""
        fields = self._fields(frame)
        self._client_nonce, self._server_nonce = fields["nonce"], security.new_nonce()
        self.state = State.CHALLENGED
        await self._reply(MsgType.CHALLENGE, {"nonce": self._server_nonce}, frame.meta)

    async def _proof(self, frame: Frame) -> None:
        fields = self._fields(frame)
        assert self.secret is not None
        expected = security.client_proof(self.secret, self._client_nonce, self._server_nonce)
        if not security.verify(expected, fields["proof"]):
            raise RequestError("wrong proof: the learner does not know the server's secret", code="auth_failed")
        self.state = State.AWAITING_HELLO
        proof = security.server_proof(self.secret, self._client_nonce, self._server_nonce)
        await self._reply(MsgType.AUTHENTICATED, {"proof": proof}, frame.meta)

    async def _hello(self, frame: Frame) -> None:
        first = self.core.store is None  # the initial weights come with this HELLO
        if first:
            self._check_welcome_fits(frame.meta)
        self.learner = self.core.register(frame.meta, frame.arrays if first else [], self.conn.peer)
        self.state = State.READY
        self.server.registered(self)
        await self._reply(MsgType.WELCOME, self.core.welcome(self.learner), frame.meta)

    def _check_welcome_fits(self, meta: dict[str, Any]) -> None:
        """Refuse (``bad_layout``) a first HELLO whose layout and groups, which every WELCOME
        echoes, leave less than :data:`WELCOME_RESERVE` of the metadata limit: the server
        would take its weights and then never welcome a learner. Nothing is initialised
        before; a field of the wrong type is ``bad_request`` first, as in ``core.register``."""
        fields = schema.check(MsgType.HELLO, meta)
        groups = [[g[0], float(g[1]), float(g[2])] for g in fields.get("groups") or ()]  # as ParamGroup has them
        size = len(msgpack.packb([fields["layout"], groups], use_bin_type=True))
        room = self.server.limits.max_meta - WELCOME_RESERVE
        if size > room:
            raise RequestError(
                f"the layout and groups take {size} bytes in a WELCOME, whose metadata has room for {room}",
                code="bad_layout",
            )

    def _push_written(self, learner: LearnerInfo) -> None:
        """The gradient of the push in hand is all written: its deadline ends, and the core
        counts the push as in progress (before the gradient's check ends)."""
        self._deadline_in(0, "push_not_written")
        self.core.written(learner)

    async def _bye(self, frame: Frame) -> None:
        self._fields(frame)
        self.said_bye = True
        await self._reply(MsgType.BYE, {}, frame.meta)
        self.state = State.CLOSED

    async def _push(self, frame: Frame) -> None:
        learner = self._learner()
        if frame.written is not None:  # the learner still writes the gradient: for at most the idle timeout
            self._deadline_in(self.server.config.idle_timeout, "push_not_written")
            self.core.writing(learner)
        try:
            size = await self.server.measure(learner, frame, functools.partial(self._push_written, learner))
        finally:  # written, or never will be
            self.core.not_written(learner)
            self._deadline_in(0, "push_not_written")
        if size is not None:  # a large model: an update may be in flight; deciding one must not wait for it on the loop
            await self.server.updates_computed()
        pending = self.core.push(learner, frame.meta, frame, size)  # the core checks the fields and takes the frame
        if pending.wait_applied:
            await self.server.wait_until(lambda: pending.settled, self.conn, learner.learner_id)
        if frame.meta.get("pull") is True:
            await self._send_weights(frame.meta, newer_than=-1)
        elif pending.outcome == "refused":
            raise RequestError(pending.refusal, code=pending.refusal_code)
        else:
            ack = {
                "timestamp": self.core.clock,
                "status": pending.outcome,
                "staleness": pending.staleness,
                "stop": self.core.stopped,
            }
            await self._reply(MsgType.ACK, ack, frame.meta)

    async def _pull(self, frame: Frame) -> None:
        await self._send_weights(frame.meta, newer_than=self._fields(frame)["newer_than"], parked=True)

    async def _state(self, frame: Frame) -> None:
        values = self.core.receive_state(self._learner(), frame.meta, frame.arrays)
        await self._reply(MsgType.STATE, {"tensors": len(values)}, frame.meta, values)

    # -- replies ------------------------------------------------------------------------------
    def _fields(self, frame: Frame) -> dict[str, Any]:
        """The request's fields, checked against its schema (``bad_request`` naming a field)."""
        return schema.check(MsgType(frame.msg_type), frame.meta)

    def _learner(self) -> LearnerInfo:
        assert self.learner is not None, "READY implies a registered learner"
        return self.learner

    async def _send_weights(self, request: dict[str, Any], newer_than: int, parked: bool = False) -> None:
        """WEIGHTS once the protocol lets this learner have newer weights than ``newer_than``
        (``parked``: a bare PULL, whose wait does not keep its learner from being evicted)."""
        learner, core = self._learner(), self.core
        await self.server.wait_until(
            lambda: core.pull_ready(learner.learner_id, newer_than), self.conn, learner.learner_id, parked=parked
        )
        store = core.store
        assert store is not None, "READY implies weights"
        # A reply sent while its update is computed leases the weights at once. While another
        # learner's request is in progress, whose update would then need a spare buffer and a
        # copy of the weights, the reply waits for the update instead.
        computing = self.conn.sends_computing(4 * store.layout.size) and core.alone(learner)
        if not computing:
            await self.server.updates_computed()
        with store.lease_computing() as (clock, weights, progress):
            # after the wait the update is computed (if not yet reaped, its progress is complete)
            gate = progress if computing else None
            sent = await self._reply(MsgType.WEIGHTS, self._weights_meta(clock), request, [weights], gate)
        if sent:  # counted once sent (deciding on it may apply an update: not while one is computed)
            core.pulled(learner, clock)

    def _weights_meta(self, clock: int) -> dict[str, Any]:
        """The metadata of a WEIGHTS reply carrying the weights of ``clock``."""
        return {"timestamp": clock, "stop": self.core.stopped, "learners": self.core.learner_count()}

    async def _reply(
        self,
        msg_type: MsgType,
        meta: dict[str, Any],
        request: dict[str, Any],
        arrays: Sequence[np.ndarray] = (),
        gate: Gate | None = None,
    ) -> bool:
        """Send the reply to ``request`` (see :meth:`_send`)."""
        return await self._send(msg_type, _answering(meta, request), arrays, gate)

    async def _send(
        self, msg_type: MsgType, meta: dict[str, Any], arrays: Sequence[np.ndarray] = (), gate: Gate | None = None
    ) -> bool:
        """Send with a deadline: a peer that does not read its reply is closed after the idle
        timeout. With a ``gate``, the body is still being computed (``Connection.send_computing``).
        True once sent; False for a frame that cannot be encoded (FrameTooLarge: nothing of it
        went out), answered instead with an ERROR ``reply_too_large`` without ``seq``, so
        the request still gets its one reply."""
        if self.state is State.READY:
            self._deadline_in(self.server.config.idle_timeout, "reply_not_read")
        try:
            try:
                if gate is None:
                    await self.conn.send(msg_type, meta, arrays)
                else:
                    await self.conn.send_computing(msg_type, meta, arrays, gate)
            except FrameTooLarge as exc:
                await self.conn.send(MsgType.ERROR, self._unencodable(msg_type, exc))
                return False
            return True
        finally:
            self._deadline_in(0, "reply_not_read")

    def _unencodable(self, msg_type: MsgType, exc: FrameTooLarge) -> dict[str, Any]:
        """Count and log a reply that could not be encoded; the ERROR (without ``seq``) to send
        instead. (A request within docs/wire.md's limits never gets one: a safeguard.)"""
        message = f"the {msg_type.name} reply could not be sent: {exc}"
        self.server.refused("reply_too_large", f"to {self.conn.peer} ({self._who()}): {message}")
        return {"code": "reply_too_large", "message": message, "fatal": False}

    def _who(self) -> str:
        return f"learner {self.learner.learner_id}" if self.learner else "unregistered peer"

    def _deadline_in(self, seconds: float, code: str) -> None:
        """Close the connection (counted as ``code``) unless the deadline is cleared within
        ``seconds``; 0 clears a deadline of ``code``, if that is the one set."""
        if seconds:
            self.deadline, self.deadline_code = self.server.now() + seconds, code
        elif self.deadline_code == code:
            self.deadline = None

    async def _refuse(self, code: str, message: str, *, fatal: bool, request: dict[str, Any]) -> None:
        """Count, log and answer a refused request; a fatal refusal ends the session. The
        ERROR echoes the ``seq`` of ``request`` (whatever its value, nil included) where it
        has one that fits (:func:`schema.seq_fits`); ``{}`` for a frame whose metadata is unknown."""
        if len(message) > MESSAGE_MAX:  # it fits in an ERROR frame and a log line, whatever it quotes
            message = message[: MESSAGE_MAX - 3] + "..."
        self.server.refused(code, f"input from {self.conn.peer} ({self._who()}): {message}")
        meta: dict[str, Any] = {"code": code, "message": message, "fatal": fatal}
        if schema.seq_fits(request):
            _answering(meta, request)
        if fatal:
            self.state = State.CLOSED
        try:
            await self._send(MsgType.ERROR, meta)
        except RudraError:
            pass


def _answering(meta: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """``meta`` of a reply to ``request``: with the request's ``seq``, if it had one."""
    if "seq" in request:
        meta["seq"] = request["seq"]
    return meta


#: refusals after which the connection is closed (the handshake's)
FATAL = frozenset({"auth_required", "auth_failed"})

#: the handlers, one per (state, message type)
HANDLERS: dict[State, dict[int, Handler]] = {
    State.AUTHENTICATING: {MsgType.AUTH: Session._auth},
    State.CHALLENGED: {MsgType.PROOF: Session._proof},
    State.AWAITING_HELLO: {MsgType.HELLO: Session._hello, MsgType.BYE: Session._bye},
    State.READY: {
        MsgType.PUSH: Session._push,
        MsgType.PULL: Session._pull,
        MsgType.STATE: Session._state,
        MsgType.BYE: Session._bye,
    },
    State.CLOSED: {},
}

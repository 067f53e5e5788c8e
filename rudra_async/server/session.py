"""One connection's conversation with the server: an explicit state machine without I/O.

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

**Sans I/O.** The session never awaits and touches no socket, thread or event loop (in the
style of h11). :meth:`Session.receive` turns one request into a *conversation*: a generator
of :data:`Action` s — :class:`Send` a frame, :class:`Measure` a pushed gradient,
:class:`AwaitUpdates` (every decided update computed), :class:`WaitUntil` the protocol lets
the reply go. Whoever drives it carries each action out and sends its result back into the
generator, or throws its error in (a lost connection, a frame too large to encode); the
generator's ``finally`` blocks run however it ends. The server's asyncio shell
(:mod:`.shell`) is one driver; the transport's callback for a small push+pull is another
(:meth:`Session.express`: the same route, carried out at once); a test with scripted frames
and a fake clock is a third. Time comes only from the host's ``now``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgpack
import numpy as np

from .. import proofs, schema
from ..config import ServerConfig
from ..errors import FrameTooLarge, RequestError, RudraError, WireError
from ..wire import Frame, Header, Limits, MsgType
from .core import CheckedPush, LearnerInfo, ServerCore
from .store import off_loop

if TYPE_CHECKING:
    from ..transports.offload import Gate

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


# -- the actions a conversation asks its driver to carry out ---------------------------------
@dataclass(frozen=True, eq=False)
class Send:
    """Send one frame. With a ``gate`` its body is still being computed (the driver writes
    each byte once the gate says it is final: ``Connection.send_computing``). Result: None.
    Thrown in: :class:`FrameTooLarge` (nothing of it went out), or the connection's loss."""

    msg_type: MsgType
    meta: dict[str, Any]
    arrays: Sequence[np.ndarray] = ()
    gate: Gate | None = None


@dataclass(frozen=True, eq=False)
class Measure:
    """Wait until the push's gradient is all written (calling ``on_written`` as soon as it
    is), and check and measure a large one off the event loop. Result: a
    :class:`CheckedPush`, or None for a small one (the core checks and measures it inline). Thrown in: the connection's loss.
    (A small gradient that came whole is not sent here: the core measures it at once.)"""

    learner: LearnerInfo
    frame: Frame
    on_written: Callable[[], None]


@dataclass(frozen=True, eq=False)
class AwaitUpdates:
    """Wait until every decided update is computed. Result: None. Thrown in: UpdateFailed."""


@dataclass(frozen=True, eq=False)
class WaitUntil:
    """Wait until ``ready()``, which is False now (re-checked whenever the server's state
    changes), the run stops or the server closes. ``parked``: a bare PULL's wait, which is no request in progress.
    Result: None. Thrown in: the connection's loss."""

    ready: Callable[[], bool]
    learner_id: int
    parked: bool = False


Action = Send | Measure | AwaitUpdates | WaitUntil
#: one request's handling: yields actions, receives their results
Conversation = Generator[Action, Any, None]


def advance(conversation: Conversation, result: Any = None, error: BaseException | None = None) -> Action | None:
    """The next action of ``conversation``, given the last one's ``result`` (or its ``error``,
    thrown in); None once the conversation has ended (its own error is raised)."""
    try:
        return conversation.send(result) if error is None else conversation.throw(error)
    except StopIteration:
        return None


# -- what the session needs of its server and its connection (no I/O) ------------------------
class Host(Protocol):
    """The server a session belongs to (:class:`~.parameter_server.ParameterServer` is one)."""

    core: ServerCore
    config: ServerConfig
    secret: bytes | None
    initial_bytes: Budget
    limits: Limits
    now: Callable[[], float]

    def refused(self, code: str, message: str) -> None: ...

    def registered(self, session: Session) -> None: ...


class Link(Protocol):
    """What the session asks of its connection: who the peer is and what it can send now
    (``Connection`` is one)."""

    @property
    def peer(self) -> str: ...

    def sends_computing(self, body_bytes: int) -> bool: ...

    def nowait_room(self, body_bytes: int) -> bool: ...


class Budget:
    """A number of bytes that several holders share: :meth:`take` what fits, :meth:`give_back`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.taken = 0

    def take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit (True), else take nothing (False)."""
        if self.taken + nbytes > self.limit:
            return False
        self.taken += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        self.taken -= nbytes


Handler = Callable[["Session", Frame], Conversation]


class Session:
    """One connection's state until BYE, loss of the connection, a fatal error or its deadline."""

    def __init__(self, host: Host, link: Link) -> None:
        self.host = host
        self.core = host.core
        self.link = link
        self.secret = host.secret
        self.state = State.AUTHENTICATING if self.secret is not None else State.AWAITING_HELLO
        self.learner: LearnerInfo | None = None
        self._client_nonce = b""
        self._server_nonce = b""
        #: when the watchdog closes this connection (None: no deadline now), and why
        self.deadline: float | None = host.now() + host.config.handshake_timeout
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
            budget = self.host.initial_bytes
            limit = self.host.config.max_model_bytes
            if header.body_len > limit:
                raise FrameTooLarge(
                    f"body of {header.body_len} bytes: the initial weights may have at most {limit} (--max-model-bytes)",
                    msg_type=header.msg_type,
                )
            self._release_initial()
            if not budget.take(header.body_len):
                raise FrameTooLarge(
                    f"body of {header.body_len} bytes: other connections are bringing initial weights of "
                    f"{budget.taken} bytes, and all of them may hold at most "
                    f"{budget.limit} (twice --max-model-bytes) until the model exists; try again",
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
        self.host.initial_bytes.give_back(self._initial_bytes)
        self._initial_bytes = 0

    def _body_limit(self, msg_type: int, model_bytes: int) -> int:
        """The largest body a frame of ``msg_type`` may have once the model exists: twice the
        model's float32 size (a float64 gradient is still read, to be answered ``bad_dtype``),
        or for STATE the frozen parameters' and buffers' size, plus :data:`BODY_SLACK`."""
        state = self.core.state
        if msg_type == MsgType.STATE and state is not None:
            return state.layout.nbytes + BODY_SLACK
        return 2 * model_bytes + BODY_SLACK

    # -- what the driver calls ------------------------------------------------------------
    def receive(self, frame: Frame) -> Conversation:
        """The whole handling of one request read from the connection: its reply (an ERROR
        for a refusal; a fatal one ends the session: :attr:`state` becomes CLOSED)."""
        learner = self._arrived()
        try:
            try:
                yield from self._dispatch(frame)
            except RequestError as exc:  # during the handshake every refusal is fatal
                fatal = exc.code in FATAL or self.state in (State.AUTHENTICATING, State.CHALLENGED)
                yield from self._refuse(exc.code, str(exc), fatal=fatal, request=frame.meta)
        finally:
            frame.release()  # a no-op for a frame the core took
            self._answered(learner)

    def express(self, frame: Frame) -> Conversation | None:
        """The conversation of a push+pull its driver can carry out at once, from the
        transport's callback while the session waits for a request, or None where it cannot
        (declined: the frame then comes the usual way, through :meth:`receive`). It is the
        route of :meth:`receive` — the same core calls, reply and deadline — taken where
        nothing on it waits: a protocol that ``answers_at_once``, a model of at most
        :data:`EXPRESS_MAX_VALUES` values updated on the caller's thread, a gradient that
        came whole, a transport that can send the weights now (it may send them later, so
        the driver sends copies). A refusal is raised (RequestError), not answered: nothing
        changed, and the usual way refuses it."""
        core, store, learner = self.core, self.core.store, self.learner
        if not (
            self.state is State.READY
            and frame.msg_type == MsgType.PUSH
            and frame.meta.get("pull") is True
            and frame.error is None
            and schema.seq_fits(frame.meta)
            and frame.written is None
            and learner is not None
            and core.protocol.answers_at_once
            and store is not None
            and store.layout.size <= EXPRESS_MAX_VALUES
            and store.updates_inline
            and self.link.nowait_room(store.layout.nbytes)
            and core.pull_ready(learner.learner_id)
        ):
            return None
        return self._expressed(frame)

    def _expressed(self, frame: Frame) -> Conversation:
        learner = self._arrived()
        try:
            yield from self._push(frame, at_once=True)
        finally:  # the frame is the core's now, or (refused) goes the usual way
            self._answered(learner)

    def lost_sync(self, exc: WireError) -> Conversation:
        """The byte stream lost sync (a frame that cannot be read): a fatal refusal."""
        code = self._fatal_code(exc)
        yield from self._refuse(code, AUTH_REQUIRED if code == "auth_required" else str(exc), fatal=True, request={})

    def end(self, closing: bool) -> None:
        """The connection is gone (``closing``: because the server closes, which ends a
        learner as orderly as a bye)."""
        self._release_initial()
        if self.state is State.CHALLENGED:  # a peer that took a challenge and never proved anything
            self.host.refused("auth_abandoned", f"{self.link.peer}: left the handshake after its CHALLENGE")
        self.state = State.CLOSED
        if self.learner is not None:
            self.core.leave(self.learner, clean=self.said_bye or closing)

    def shutdown_notice(self, reason: str) -> dict[str, Any] | None:
        """The ERROR (fatal ``shutting_down``, without ``seq``) to tell a registered learner
        before the server closes its connection (the reply its next request reads); None
        for a peer that has not said hello."""
        if self.state is not State.READY:
            return None
        return {"code": "shutting_down", "message": f"the server is shutting down: {reason}", "fatal": True}

    def expire(self) -> None:
        """The deadline passed: count and log it (the driver then closes the connection)."""
        self.host.refused(self.deadline_code, f"{self.link.peer}: {self._expired_because()}")
        self.deadline = None

    # -- the request's frame ----------------------------------------------------------------
    def _arrived(self) -> LearnerInfo | None:
        """A request was read: the handshake's deadline stays (from accept to hello), any
        other ends; the learner has a request in progress."""
        self._heard = True
        self._release_initial()  # read: the frame owns its bytes now (or the model exists)
        if self.state is State.READY:
            self.deadline = None
        if self.learner is not None:
            self.core.active(self.learner)
        return self.learner

    def _answered(self, learner: LearnerInfo | None) -> None:
        """The request was answered: its learner's request ends, the idle deadline starts."""
        if learner is not None:
            self.core.idle(learner)
        if self.state is State.READY:
            idle = self.host.config.idle_timeout
            self.deadline = self.host.now() + idle if idle else None
            self.deadline_code = "idle_timeout"

    def _fatal_code(self, exc: WireError) -> str:
        """A frame too large for an unauthenticated peer that is a learner's request means the
        peer does not authenticate: say so rather than ``frame_too_large``."""
        requests = (MsgType.HELLO, MsgType.PUSH, MsgType.PULL, MsgType.STATE, MsgType.BYE)
        if self.state is State.AUTHENTICATING and isinstance(exc, FrameTooLarge) and exc.msg_type in requests:
            return "auth_required"
        return exc.code

    def _expired_because(self) -> str:
        cfg = self.host.config
        if self.deadline_code == "handshake_timeout":
            return f"no hello within {cfg.handshake_timeout:g} s"
        if self.deadline_code == "reply_not_read":
            return f"a reply not read within {cfg.idle_timeout:g} s"
        if self.deadline_code == "push_not_written":
            return f"a gradient not written within {cfg.idle_timeout:g} s"
        return f"no request for {cfg.idle_timeout:g} s"

    def _dispatch(self, frame: Frame) -> Conversation:
        if frame.error is not None:
            if self.state in (State.AUTHENTICATING, State.CHALLENGED):
                raise RequestError("authenticate first", code="auth_required")
            raise RequestError(str(frame.error), code=frame.error.code)
        schema.check_seq(frame.meta)  # any request: its reply must be able to echo it
        handler = HANDLERS[self.state].get(frame.msg_type)
        if handler is not None:
            yield from handler(self, frame)
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
    def _auth(self, frame: Frame) -> Conversation:
        """The server's nonce, and nothing derived from the secret: the learner proves first
        (a proof from the server to any peer would let it test guesses of the secret offline)."""
        fields = self._fields(frame)
        self._client_nonce, self._server_nonce = fields["nonce"], proofs.new_nonce()
        self.state = State.CHALLENGED
        yield from self._reply(MsgType.CHALLENGE, {"nonce": self._server_nonce}, frame.meta)

    def _proof(self, frame: Frame) -> Conversation:
        fields = self._fields(frame)
        assert self.secret is not None
        expected = proofs.client_proof(self.secret, self._client_nonce, self._server_nonce)
        if not proofs.verify(expected, fields["proof"]):
            raise RequestError("wrong proof: the learner does not know the server's secret", code="auth_failed")
        self.state = State.AWAITING_HELLO
        proof = proofs.server_proof(self.secret, self._client_nonce, self._server_nonce)
        yield from self._reply(MsgType.AUTHENTICATED, {"proof": proof}, frame.meta)

    def _hello(self, frame: Frame) -> Conversation:
        first = self.core.store is None  # the initial weights come with this HELLO
        if first:
            self._check_welcome_fits(frame.meta)
        self.learner = self.core.register(frame.meta, frame.arrays if first else [], self.link.peer)
        self.state = State.READY
        self.host.registered(self)
        yield from self._reply(MsgType.WELCOME, self.core.welcome(self.learner), frame.meta)

    def _check_welcome_fits(self, meta: dict[str, Any]) -> None:
        """Refuse (``bad_layout``) a first HELLO whose layout and groups, which every WELCOME
        echoes, leave less than :data:`WELCOME_RESERVE` of the metadata limit: the server
        would take its weights and then never welcome a learner. Nothing is initialised
        before; a field of the wrong type is ``bad_request`` first, as in ``core.register``."""
        fields = schema.check(MsgType.HELLO, meta)
        groups = [[g[0], float(g[1]), float(g[2])] for g in fields.get("groups") or ()]  # as ParamGroup has them
        size = len(msgpack.packb([fields["layout"], groups], use_bin_type=True))
        room = self.host.limits.max_meta - WELCOME_RESERVE
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

    def _bye(self, frame: Frame) -> Conversation:
        self._fields(frame)
        self.said_bye = True
        yield from self._reply(MsgType.BYE, {}, frame.meta)
        self.state = State.CLOSED

    def _push(self, frame: Frame, at_once: bool = False) -> Conversation:
        """A gradient: measured (large ones off the loop, as they are written), decided by
        the core, then answered — ACK, or with ``pull`` the weights — once the protocol lets
        the reply go. ``at_once``: driven by :meth:`express`, where a protocol that made its
        pusher wait or held the gradient broke its ``answers_at_once`` promise."""
        learner = self._learner()
        checked: CheckedPush | None = None  # a small gradient that came whole: the core measures it
        if frame.written is not None:  # the learner still writes the gradient: for at most the idle timeout
            self._deadline_in(self.host.config.idle_timeout, "push_not_written")
            self.core.writing(learner)
        if frame.written is None and not off_loop(frame.body.nbytes // 4):
            self._push_written(learner)
        else:
            try:
                checked = yield Measure(learner, frame, lambda: self._push_written(learner))
            finally:  # written, or never will be
                self.core.not_written(learner)
                self._deadline_in(0, "push_not_written")
        if (
            checked is not None
        ):  # a large model: an update may be in flight; deciding one must not wait for it on the loop
            yield AwaitUpdates()
        pending = self.core.push(learner, frame.meta, frame, checked)  # the core checks the rest and takes the frame
        if at_once and (pending.wait_applied or not pending.settled):
            raise RudraError(
                f"protocol {self.core.protocol.name!r} declares answers_at_once but held a gradient or made "
                "its pusher wait (a subclass that waits must set answers_at_once = False)"
            )
        if pending.wait_applied and not pending.settled:
            yield WaitUntil(lambda: pending.settled, learner.learner_id)
        if frame.meta.get("pull") is True:
            yield from self._send_weights(frame.meta, newer_than=-1)
        elif pending.outcome == "refused":
            raise RequestError(pending.refusal, code=pending.refusal_code)
        else:
            ack = {
                "timestamp": self.core.clock,
                "status": pending.outcome,
                "staleness": pending.staleness,
                "stop": self.core.stopped,
            }
            yield from self._reply(MsgType.ACK, ack, frame.meta)

    def _pull(self, frame: Frame) -> Conversation:
        yield from self._send_weights(frame.meta, newer_than=self._fields(frame)["newer_than"], parked=True)

    def _state(self, frame: Frame) -> Conversation:
        values = self.core.receive_state(self._learner(), frame.meta, frame.arrays)
        yield from self._reply(MsgType.STATE, {"tensors": len(values)}, frame.meta, values)

    # -- replies ------------------------------------------------------------------------------
    def _fields(self, frame: Frame) -> dict[str, Any]:
        """The request's fields, checked against its schema (``bad_request`` naming a field)."""
        return schema.check(MsgType(frame.msg_type), frame.meta)

    def _learner(self) -> LearnerInfo:
        assert self.learner is not None, "READY implies a registered learner"
        return self.learner

    def _send_weights(self, request: dict[str, Any], newer_than: int, parked: bool = False) -> Conversation:
        """WEIGHTS once the protocol lets this learner have newer weights than ``newer_than``
        (``parked``: a bare PULL, whose wait does not keep its learner from being evicted)."""
        learner, core = self._learner(), self.core
        if not core.pull_ready(learner.learner_id, newer_than):
            yield WaitUntil(lambda: core.pull_ready(learner.learner_id, newer_than), learner.learner_id, parked)
        store = core.store
        assert store is not None, "READY implies weights"
        # A reply sent while its update is computed leases the weights at once. While another
        # learner's request is in progress, whose update would then need a spare buffer and a
        # copy of the weights, the reply waits for the update instead.
        computing = self.link.sends_computing(4 * store.layout.size) and core.alone(learner)
        if not computing:
            yield AwaitUpdates()
        with store.lease_computing() as (clock, weights, progress):
            # after the wait the update is computed (if not yet reaped, its progress is complete)
            gate = progress if computing else None
            sent = yield from self._reply(MsgType.WEIGHTS, self._weights_meta(clock), request, [weights], gate)
        if sent:  # counted once sent (deciding on it may apply an update: not while one is computed)
            core.pulled(learner, clock)

    def _weights_meta(self, clock: int) -> dict[str, Any]:
        """The metadata of a WEIGHTS reply carrying the weights of ``clock``."""
        return {"timestamp": clock, "stop": self.core.stopped, "learners": self.core.learner_count()}

    def _reply(
        self,
        msg_type: MsgType,
        meta: dict[str, Any],
        request: dict[str, Any],
        arrays: Sequence[np.ndarray] = (),
        gate: Gate | None = None,
    ) -> Generator[Action, Any, bool]:
        """Send the reply to ``request`` (see :meth:`_send`)."""
        return (yield from self._send(msg_type, _answering(meta, request), arrays, gate))

    def _send(
        self, msg_type: MsgType, meta: dict[str, Any], arrays: Sequence[np.ndarray] = (), gate: Gate | None = None
    ) -> Generator[Action, Any, bool]:
        """Send with a deadline: a peer that does not read its reply is closed after the idle
        timeout. True once sent; False for a frame that cannot be encoded (FrameTooLarge:
        nothing of it went out), answered instead with an ERROR ``reply_too_large`` without
        ``seq``, so the request still gets its one reply."""
        if self.state is State.READY:
            self._deadline_in(self.host.config.idle_timeout, "reply_not_read")
        try:
            try:
                yield Send(msg_type, meta, arrays, gate)
            except FrameTooLarge as exc:
                yield Send(MsgType.ERROR, self._unencodable(msg_type, exc))
                return False
            return True
        finally:
            self._deadline_in(0, "reply_not_read")

    def _unencodable(self, msg_type: MsgType, exc: FrameTooLarge) -> dict[str, Any]:
        """Count and log a reply that could not be encoded; the ERROR (without ``seq``) to send
        instead. (A request within docs/wire.md's limits never gets one: a safeguard.)"""
        message = f"the {msg_type.name} reply could not be sent: {exc}"
        self.host.refused("reply_too_large", f"to {self.link.peer} ({self._who()}): {message}")
        return {"code": "reply_too_large", "message": message, "fatal": False}

    def _who(self) -> str:
        return f"learner {self.learner.learner_id}" if self.learner else "unregistered peer"

    def _deadline_in(self, seconds: float, code: str) -> None:
        """Close the connection (counted as ``code``) unless the deadline is cleared within
        ``seconds``; 0 clears a deadline of ``code``, if that is the one set."""
        if seconds:
            self.deadline, self.deadline_code = self.host.now() + seconds, code
        elif self.deadline_code == code:
            self.deadline = None

    def _refuse(self, code: str, message: str, *, fatal: bool, request: dict[str, Any]) -> Conversation:
        """Count, log and answer a refused request; a fatal refusal ends the session. The
        ERROR echoes the ``seq`` of ``request`` (whatever its value, nil included) where it
        has one that fits (:func:`schema.seq_fits`); ``{}`` for a frame whose metadata is unknown."""
        if len(message) > MESSAGE_MAX:  # it fits in an ERROR frame and a log line, whatever it quotes
            message = message[: MESSAGE_MAX - 3] + "..."
        self.host.refused(code, f"input from {self.link.peer} ({self._who()}): {message}")
        meta: dict[str, Any] = {"code": code, "message": message, "fatal": fatal}
        if schema.seq_fits(request):
            _answering(meta, request)
        if fatal:
            self.state = State.CLOSED
        try:
            yield from self._send(MsgType.ERROR, meta)
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

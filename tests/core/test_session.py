"""The sans-I/O session, driven by scripted frames (real wire bytes, decoded) and a fake
clock, without a socket, thread or event loop: each request's conversation is run by a
small synchronous driver that records the frames it sends and stops where the
conversation waits for the protocol."""

from __future__ import annotations

import numpy as np
import pytest

from rudra_async import proofs
from rudra_async.config import ServerConfig
from rudra_async.errors import FrameTooLarge
from rudra_async.layout import Layout
from rudra_async.server.core import ServerCore
from rudra_async.server.session import (
    AwaitUpdates,
    Budget,
    Conversation,
    Measure,
    Send,
    Session,
    State,
    WaitUntil,
    advance,
)
from rudra_async.wire import Frame, FrameReader, Limits, MsgType, encode_frame

LAYOUT = Layout.from_shapes([("w", (3, 4)), ("b", (4,))])
SECRET = b"0123456789abcdef-a-test-secret"


class Host:
    """The server side a session needs: a real core, a fake clock, refusals counted."""

    def __init__(self, secret: bytes | None = None, **config: object) -> None:
        self.config = ServerConfig(kernel="numpy", momentum=0.0, lr=0.5, **config)  # type: ignore[arg-type]
        self.time = 100.0
        self.core = ServerCore(self.config, now=self.now)
        self.secret = secret
        self.initial_bytes = Budget(2 * self.config.max_model_bytes)
        self.limits = Limits()
        self.refusals: list[str] = []
        self.sessions: list[Session] = []

    def now(self) -> float:
        return self.time

    def refused(self, code: str, message: str) -> None:
        self.refusals.append(code)

    def registered(self, session: Session) -> None:
        self.sessions.append(session)


class Link:
    peer = "scripted peer"

    def __init__(self, room: bool = True) -> None:
        self.room = room

    def sends_computing(self, body_bytes: int) -> bool:
        return False

    def nowait_room(self, body_bytes: int) -> bool:
        return self.room


def frame(msg_type: MsgType, meta: dict, arrays: tuple[np.ndarray, ...] = ()) -> Frame:
    """The frame a server would read: encoded to bytes and decoded again."""
    data = b"".join(bytes(b) for b in encode_frame(msg_type, meta, arrays))
    reader, frames, at = FrameReader(), [], 0
    while not frames:
        buf = reader.get_buffer()
        n = min(len(buf), len(data) - at)
        buf[:n] = data[at : at + n]
        at += n
        frames = reader.advance(n)
    return frames[0]


class Driver:
    """Carries out a conversation's actions at once: records what it sends, measures
    nothing (a small model: the core measures), and stops at a wait that is not ready."""

    def __init__(self) -> None:
        self.sent: list[tuple[MsgType, dict]] = []
        self.actions: list[type] = []
        self.waiting: tuple[WaitUntil, Conversation] | None = None

    def run(self, conversation: Conversation, too_large: bool = False) -> None:
        result, error = None, None
        while (action := advance(conversation, result, error)) is not None:
            result, error = None, None
            self.actions.append(type(action))
            if isinstance(action, Send):
                if too_large and action.msg_type != MsgType.ERROR:
                    error = FrameTooLarge("scripted: too large to encode")
                else:
                    self.sent.append((action.msg_type, dict(action.meta)))
            elif isinstance(action, Measure):
                action.on_written()
            elif isinstance(action, WaitUntil) and not action.ready():
                self.waiting = (action, conversation)
                return

    def resume(self) -> None:
        """Go on with the conversation that waited (its condition is re-checked by it)."""
        assert self.waiting is not None
        wait, conversation = self.waiting
        assert wait.ready()
        self.waiting = None
        self.run(conversation)

    def last(self) -> tuple[MsgType, dict]:
        return self.sent[-1]


def hello(session: Session, driver: Driver, seq: int = 0) -> None:
    weights = np.arange(LAYOUT.size, dtype=np.float32)
    first = session.core.store is None
    driver.run(
        session.receive(frame(MsgType.HELLO, {"layout": LAYOUT.to_wire(), "seq": seq}, (weights,) if first else ()))
    )


def push(learner_id: int, stamp: int, pull: bool = False, seq: int = 1) -> Frame:
    grad = np.ones(LAYOUT.size, np.float32)
    meta = {"learner_id": learner_id, "timestamp": stamp, "step": 0, "samples": 4, "pull": pull, "seq": seq}
    return frame(MsgType.PUSH, meta, (grad,))


def test_the_handshake_with_a_secret_then_hello_then_a_push_answered_with_an_ack() -> None:
    host = Host(SECRET)
    session, driver = Session(host, Link()), Driver()
    assert session.state is State.AUTHENTICATING and session.deadline == 100.0 + host.config.handshake_timeout
    nonce = proofs.new_nonce()
    driver.run(session.receive(frame(MsgType.AUTH, {"nonce": nonce, "seq": 1})))
    kind, challenge = driver.last()
    assert kind == MsgType.CHALLENGE and challenge["seq"] == 1 and session.state is State.CHALLENGED
    proof = proofs.client_proof(SECRET, nonce, challenge["nonce"])
    driver.run(session.receive(frame(MsgType.PROOF, {"proof": proof, "seq": 2})))
    kind, answer = driver.last()
    assert kind == MsgType.AUTHENTICATED and session.state is State.AWAITING_HELLO
    assert proofs.verify(proofs.server_proof(SECRET, nonce, challenge["nonce"]), answer["proof"])
    host.time = 105.0
    hello(session, driver, seq=3)
    kind, welcome = driver.last()
    assert kind == MsgType.WELCOME and welcome["seq"] == 3 and session.state is State.READY
    assert host.sessions == [session] and session.deadline == 105.0 + host.config.idle_timeout  # idle from now
    driver.run(session.receive(push(welcome["learner_id"], 0, seq=4)))
    kind, ack = driver.last()
    assert kind == MsgType.ACK and ack == {"timestamp": 1, "status": "applied", "staleness": 0, "stop": False, "seq": 4}
    assert driver.actions[-1:] == [Send] and Measure not in driver.actions  # small and whole: the core measures
    assert host.core.clock == 1 and host.refusals == []


def test_a_wrong_proof_is_a_fatal_refusal_and_the_session_ends() -> None:
    host = Host(SECRET)
    session, driver = Session(host, Link()), Driver()
    driver.run(session.receive(frame(MsgType.AUTH, {"nonce": proofs.new_nonce(), "seq": 1})))
    driver.run(session.receive(frame(MsgType.PROOF, {"proof": bytes(32), "seq": 2})))
    kind, error = driver.last()
    assert kind == MsgType.ERROR and error["code"] == "auth_failed" and error["fatal"] and error["seq"] == 2
    assert session.state is State.CLOSED and host.refusals == ["auth_failed"]
    session.end(closing=False)


def test_push_before_hello_is_refused_without_ending_the_session() -> None:
    host = Host()
    session, driver = Session(host, Link()), Driver()
    driver.run(session.receive(push(0, 0)))
    kind, error = driver.last()
    assert (kind, error["code"], error["fatal"]) == (MsgType.ERROR, "not_registered", False)
    assert session.state is State.AWAITING_HELLO and host.refusals == ["not_registered"]


def test_a_hardsync_push_pull_waits_for_the_round_then_gets_the_new_weights() -> None:
    host = Host(protocol="hardsync")
    a, b = Session(host, Link()), Session(host, Link())
    da, db = Driver(), Driver()
    hello(a, da)
    hello(b, db)
    ids = [d.last()[1]["learner_id"] for d in (da, db)]
    for session, driver in ((a, da), (b, db)):
        driver.run(session.receive(frame(MsgType.PULL, {"newer_than": -1, "seq": 5})))
        assert driver.last()[0] == MsgType.WEIGHTS and driver.last()[1]["timestamp"] == 0
    da.run(a.receive(push(ids[0], 0, pull=True)))
    assert da.waiting is not None and host.core.clock == 0  # the round waits for b
    assert da.last()[0] == MsgType.WEIGHTS  # nothing new was sent
    db.run(b.receive(push(ids[1], 0, pull=True)))
    assert host.core.clock == 1 and db.last()[1]["timestamp"] == 1
    da.resume()
    kind, weights = da.last()
    assert kind == MsgType.WEIGHTS and weights["timestamp"] == 1 and weights["seq"] == 1


def test_deadlines_follow_the_fake_clock_and_expire_counts_the_reason() -> None:
    host = Host(idle_timeout=7.0)
    session, driver = Session(host, Link()), Driver()
    hello(session, driver)
    assert session.deadline == 107.0 and session.deadline_code == "idle_timeout"
    host.time = 110.0
    driver.run(session.receive(frame(MsgType.PULL, {"newer_than": -1, "seq": 1})))
    assert session.deadline == 117.0
    session.expire()
    assert host.refusals == ["idle_timeout"] and session.deadline is None


def test_a_reply_too_large_to_encode_is_answered_with_an_error_instead() -> None:
    host = Host()
    session, driver = Session(host, Link()), Driver()
    hello(session, driver)
    driver.run(session.receive(frame(MsgType.PULL, {"newer_than": -1, "seq": 9})), too_large=True)
    kind, error = driver.last()
    assert (kind, error["code"], "seq" in error) == (MsgType.ERROR, "reply_too_large", False)
    assert host.refusals == ["reply_too_large"]


def test_express_takes_the_same_route_and_declines_what_would_wait() -> None:
    host = Host(protocol="async")
    session, driver = Session(host, Link()), Driver()
    hello(session, driver)
    learner = driver.last()[1]["learner_id"]
    conversation = session.express(push(learner, 0, pull=True))
    assert conversation is not None
    driver.run(conversation)
    assert driver.last()[1]["timestamp"] == 1 and AwaitUpdates in driver.actions
    assert session.express(push(learner, 1, pull=False)) is None  # a bare push: the usual way
    assert Session(host, Link(room=False)).express(push(learner, 1, pull=True)) is None  # not registered
    hardsync = Host(protocol="hardsync")
    other, d2 = Session(hardsync, Link()), Driver()
    hello(other, d2)
    assert other.express(push(d2.last()[1]["learner_id"], 0, pull=True)) is None  # its rounds wait


def test_a_lost_connection_ends_a_waiting_conversation_and_the_learner_leaves() -> None:
    host = Host(protocol="hardsync")
    a, b, da, db = Session(host, Link()), Session(host, Link()), Driver(), Driver()
    hello(a, da)
    hello(b, db)
    da.run(a.receive(push(da.last()[1]["learner_id"], 0, pull=True)))
    assert da.waiting is not None
    _, conversation = da.waiting
    with pytest.raises(ConnectionError):
        conversation.throw(ConnectionError("lost"))
    learner = a.learner
    assert learner is not None and learner.busy == 0  # the conversation's finally ended the request
    a.end(closing=False)
    assert a.state is State.CLOSED and not learner.connected

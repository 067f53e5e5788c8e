"""The asyncio side of a :class:`~.session.Session`: reads its connection's requests and
carries out the actions of each one's conversation (sending, measuring, waiting), either
on the event loop (:meth:`SessionShell.run`) or at once from the transport's callback
(:meth:`SessionShell.express`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..errors import FrameTooLarge, RequestError, RudraError, WireError
from ..transports.base import Connection
from ..wire import Frame
from .session import Action, AwaitUpdates, Conversation, Measure, Send, Session, State, WaitUntil, advance

if TYPE_CHECKING:
    from .parameter_server import ParameterServer

log = logging.getLogger(__name__)


class SessionShell:
    """Serves one connection through its session until the session ends or the connection is lost."""

    def __init__(self, server: ParameterServer, session: Session, conn: Connection) -> None:
        self.server = server
        self.session = session
        self.conn = conn

    async def run(self) -> None:
        """Read and answer requests until the session is CLOSED (a BYE, a fatal refusal)
        or the connection is lost; then end the session."""
        session, conn = self.session, self.conn
        try:
            while session.state is not State.CLOSED:
                conn.express = self.express if session.state is State.READY else None
                try:
                    frame = await conn.recv()
                except WireError as exc:  # fatal: the byte stream lost sync
                    await self.carry_out(session.lost_sync(exc))
                    return
                finally:
                    conn.express = None
                await self.carry_out(session.receive(frame))
        finally:
            session.end(closing=self.server.closing)

    async def carry_out(self, conversation: Conversation) -> None:
        """Carry out each action of ``conversation`` in turn, sending its result back or
        throwing its error in, until the conversation ends (its own error is raised)."""
        result: Any = None
        error: BaseException | None = None
        try:
            while (action := advance(conversation, result, error)) is not None:
                result, error = None, None
                try:
                    result = await self.perform(action)
                except BaseException as exc:  # the conversation decides: its finally blocks run either way
                    error = exc
        finally:
            conversation.close()
            error = None  # no reference cycle through the traceback

    async def perform(self, action: Action) -> Any:
        """Carry out one action on the event loop; its result (see :mod:`.session`)."""
        server, conn = self.server, self.conn
        if isinstance(action, Send):
            if action.gate is None:
                await conn.send(action.msg_type, action.meta, action.arrays)
            else:
                await conn.send_computing(action.msg_type, action.meta, action.arrays, action.gate)
            return None
        if isinstance(action, Measure):
            return await server.pipeline.measure(action.learner, action.frame, action.on_written)
        if isinstance(action, AwaitUpdates):
            await server.pipeline.updates_computed()
            return None
        assert isinstance(action, WaitUntil)
        await server.wait_until(action.ready, conn, action.learner_id, parked=action.parked)
        return None

    def express(self, frame: Frame) -> bool:
        """The connection's ``express`` hook: carry out the session's :meth:`~Session.express`
        conversation at once; True when answered. Declined (False): a frame the session does
        not express, or one it refuses (nothing changed: the usual way refuses it). An
        unexpected error closes the connection (the frame is taken: True)."""
        conversation = self.session.express(frame)
        if conversation is None:
            return False
        result: Any = None
        error: FrameTooLarge | None = None
        try:
            while (action := advance(conversation, result, error)) is not None:
                result, error = None, None
                try:
                    result = self._at_once(action)
                except FrameTooLarge as exc:  # nothing of it went out: the conversation answers instead
                    error = exc
            return True
        except RequestError:
            return False
        except Exception:  # from a transport callback: end this session as a failed handler would
            learner = self.session.learner
            who = learner.learner_id if learner is not None else "?"
            log.exception("answering a push+pull of learner %s failed; closing %s", who, self.conn.peer)
            self.conn.close()
            return True
        finally:
            conversation.close()

    def _at_once(self, action: Action) -> Any:
        """Carry out an action of an express conversation without waiting (RudraError where
        it would have to wait)."""
        if isinstance(action, Send):
            if not self.conn.nowait_room(sum(a.nbytes for a in action.arrays)):
                raise RudraError("the transport cannot send the reply at once")
            copies = [a.copy() for a in action.arrays]  # the transport may send them after we return
            self.conn.send_nowait(action.msg_type, action.meta, copies)
            return None
        if isinstance(action, Measure):  # a gradient still written, or measured off the loop
            raise RudraError("a push+pull answered at once would have to wait for its gradient")
        if isinstance(action, AwaitUpdates):  # updates are computed on this thread: none is in flight
            return None
        raise RudraError("a push+pull answered at once would have to wait for the protocol")

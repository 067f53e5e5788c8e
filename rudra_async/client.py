"""Framework-agnostic learner client: hello, push and pull numpy arrays.

:class:`Client` is the asyncio API; :class:`SyncClient` runs it on a blocking socket (tcp,
shm) or a private event loop (other transports) for code that is not async (e.g. a PyTorch
training loop). Replies are matched to requests by a sequence number; an ERROR reply raises
:class:`~rudra_async.errors.RemoteError` with the server's stable code.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, Union

import numpy as np

from . import security, transports
from .errors import (
    ConfigError,
    ConnectError,
    ConnectionClosed,
    PeerGone,
    RemoteError,
    RequestError,
    RudraError,
    ServerBusy,
    TransportError,
    TryLater,
    quoted,
)
from .eventloop import PrivateLoop, run_sync, serving_here
from .layout import Layout, Shard
from .model_state import StateLayout
from .wire import DEFAULT_TIMEOUT, Allocator, Frame, Limits, MsgType

__all__ = [
    "Ack",
    "Client",
    "Gradient",
    "ShardedClient",
    "Stamp",
    "SyncClient",
    "Weights",
    "connect",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

BYE_TIMEOUT_S = 5.0  # how long close() waits for the server's answer to its BYE


Stamp = Union[int, tuple[int, ...]]  # noqa: UP007 (a runtime alias: X | Y needs Python 3.10 types)  # a server clock; one per shard for a sharded group


#: a gradient: one array, or its parts end to end (e.g. each tensor's gradient, in layout order)
Gradient = Union[np.ndarray, Sequence[np.ndarray]]  # noqa: UP007 (a runtime alias, as Stamp)


def gradient_parts(grad: Gradient) -> list[np.ndarray]:
    """The arrays ``grad`` is made of; RequestError (``bad_request``) unless it is a numpy
    array or a sequence of them."""
    parts = [grad] if isinstance(grad, np.ndarray) else grad
    if isinstance(parts, Sequence) and all(isinstance(part, np.ndarray) for part in parts):
        return list(parts)
    what = type(grad).__name__
    if isinstance(parts, Sequence):
        what += " holding a " + next(type(p).__name__ for p in parts if not isinstance(p, np.ndarray))
    raise RequestError(
        f"a gradient must be a numpy array or a sequence of numpy arrays, got a {what}", code="bad_request"
    )


def gradient_segments(grad: Gradient, lo: int = 0, hi: int | None = None) -> list[np.ndarray]:
    """Values ``[lo, hi)`` of ``grad`` as a PUSH's one-dimensional segments: views of its
    parts, nothing gathered (docs/wire.md: a gradient may be several segments)."""
    out, start = [], 0
    for part in gradient_parts(grad):
        flat = part.reshape(-1)
        end = start + flat.size
        if end > lo and (hi is None or start < hi):
            out.append(flat[max(lo - start, 0) : (flat.size if hi is None else min(hi, end) - start)])
        start = end
    return out


def scalar(stamp: Stamp) -> int:
    """One server's clock: a whole number (of any integer type), or a one-element tuple (a
    group of one shard). RequestError ``bad_request`` otherwise."""
    one = stamp[0] if isinstance(stamp, (tuple, list)) and len(stamp) == 1 else stamp
    try:
        return operator.index(one)  # type: ignore[arg-type]
    except TypeError:
        raise RequestError(f"one server's clock is a whole number, got {stamp!r}", code="bad_request") from None


def went_back(new: Stamp, old: Stamp) -> bool:
    """True when a server's clock (any shard's) is behind what it was: the server restarted."""
    pairs = zip((new,) if isinstance(new, int) else new, (old,) if isinstance(old, int) else old)
    return any(a < b for a, b in pairs)


@dataclass
class Weights:
    """Weights at server clock ``timestamp``. ``array`` is the client's reusable buffer."""

    timestamp: Stamp
    array: np.ndarray
    stop: bool


@dataclass
class Ack:
    """``status`` is 'applied', 'pending' (waits for more gradients) or 'dropped'."""

    timestamp: Stamp
    status: str
    staleness: int | None
    stop: bool


class Channel(Protocol):
    """What a client needs of a connection: an asyncio :class:`~rudra_async.transports.base.Connection`,
    or a :class:`~rudra_async.transports.blocking.BlockingConnection` whose coroutines never suspend."""

    peer: str
    allocator: Allocator | None

    @property
    def is_closed(self) -> bool: ...

    async def send(
        self, msg_type: int, meta: dict[str, Any] | None = None, arrays: Sequence[np.ndarray] = ()
    ) -> None: ...

    async def recv(self) -> Frame: ...

    async def within(self, operation: Awaitable[T], timeout: float) -> T:
        """``operation`` with a deadline (asyncio's, or a blocking socket's timeout); TimeoutError past it."""
        ...

    def close(self) -> None: ...


class Client:
    """One learner's connection. Create with :meth:`connect` (or :meth:`hello` on a channel)."""

    def __init__(self, conn: Channel, welcome: dict[str, Any]) -> None:
        self.conn = conn
        self.welcome = welcome  # the server's WELCOME (docs/wire.md): its groups, momentum, protocol, ...
        self.learner_id: int = welcome["learner_id"]
        self.layout = Layout.from_wire(welcome["layout"])  # the whole model's
        self.shard = Shard.from_wire(welcome.get("shard"))
        self.range: tuple[int, int] = self.shard.range(self.layout.size)  # the part this server holds
        self.protocol: str = welcome.get("protocol", "")
        self.clock: int = welcome.get("clock", 0)
        #: the checkpoint clock the server resumed from (``--resume``), or None
        self.resumed_from: int | None = welcome.get("resumed")
        #: this learner's index and λ, to take its part of the data by (the newest WEIGHTS' λ)
        self.index: int = welcome.get("index", 0)
        self.learners: int = welcome.get("learners", 1)
        self._seq = 1
        self._abandoned: str | None = None  # why the connection was closed under a request
        self.weights = np.empty(self.range[1] - self.range[0], np.float32)
        conn.allocator = self._allocate

    @classmethod
    async def connect(
        cls,
        url: str,
        layout: Layout,
        initial: np.ndarray | None = None,
        *,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        limits: Limits = Limits(),
        shard: Shard | None = None,
        groups: Sequence[Sequence[Any]] | None = None,
        secret: bytes | str | None = None,
        tls: ssl.SSLContext | None = None,
        index: int | None = None,
        state: StateLayout | None = None,
        reader: bool = False,
    ) -> Client:
        """Connect, authenticate and register. ``initial`` (flat float32) seeds the server if
        it has no weights, and ``groups`` (``[[tensors, lr, weight_decay], ...]``,
        docs/wire.md) its parameter groups. For one shard of a sharded group, pass ``shard``
        and only that shard's part of ``initial``. ``secret``: the server's shared secret
        (default: the ``RUDRA_ASYNC_SECRET`` variable, if set); the server must prove it
        knows it too. ``tls``: an ``ssl.SSLContext`` (e.g. :func:`rudra_async.security.client_tls`)
        for a TLS server (tcp only). ``index``: the learner index to ask for; ``state``: the
        model's frozen parameters and buffers (:meth:`exchange_state` sends their values).
        ``reader``: a client that only pulls (evaluation, monitoring): it never takes part in
        a round and cannot push."""
        conn = await transports.connect(url, limits=limits, timeout=timeout, tls=tls)
        return await cls.hello(
            conn,
            layout,
            initial,
            name=name,
            timeout=timeout,
            shard=shard,
            groups=groups,
            secret=secret,
            url=url,
            index=index,
            state=state,
            reader=reader,
            tls=tls,
        )

    @classmethod
    async def hello(
        cls,
        conn: Channel,
        layout: Layout,
        initial: np.ndarray | None = None,
        *,
        name: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        shard: Shard | None = None,
        groups: Sequence[Sequence[Any]] | None = None,
        secret: bytes | str | None = None,
        url: str | None = None,
        index: int | None = None,
        state: StateLayout | None = None,
        reader: bool = False,
        tls: ssl.SSLContext | None = None,
    ) -> Client:
        """Authenticate (with a secret) and register on an open connection (see :meth:`connect`;
        ``tls``: the context the connection was made with, for clearer errors); the connection
        is closed on failure."""
        key = security.resolve_secret(secret)
        where = _Where(url or conn.peer, tls)
        try:
            if key is not None:
                await _authenticate(conn, key, where, timeout)
            meta = {"name": name or f"{socket.gethostname()}:{os.getpid()}", "layout": layout.to_wire(), "seq": 0}
            if shard is not None:
                meta["shard"] = shard.to_wire()
            if groups is not None:
                meta["groups"] = [list(g) for g in groups]
            if index is not None:
                meta["index"] = index
            if state is not None:
                meta["state"] = state.to_wire()
            if reader:
                meta["reader"] = True
            arrays = [np.ascontiguousarray(initial, np.float32).reshape(-1)] if initial is not None else []
            reply = await _exchange(conn, MsgType.HELLO, meta, arrays, where, timeout, "WELCOME")
            welcome = _check(reply, MsgType.WELCOME, auth_hint=key is None).meta
            reply.release()
        except BaseException:
            conn.close()
            raise
        return cls(conn, welcome)

    def _allocate(self, msg_type: int, meta: dict[str, Any], nbytes: int) -> memoryview | None:
        if msg_type == MsgType.WEIGHTS and nbytes == self.weights.nbytes:
            return self.weights.data.cast("B")
        return None

    async def _request(self, msg_type: MsgType, meta: dict[str, Any], arrays: Sequence[np.ndarray] = ()) -> Frame:
        """Send a request and read its reply. Interrupted in between (cancelled, timed out,
        KeyboardInterrupt), the stream is out of step: the connection is closed and every later
        request raises ConnectionClosed saying why."""
        if self._abandoned is not None:
            raise ConnectionClosed(self._abandoned)
        meta["seq"] = seq = self._seq
        self._seq += 1
        try:
            await self.conn.send(msg_type, meta, arrays)
            reply = await self.conn.recv()
        except BaseException as exc:
            if not isinstance(exc, Exception) or isinstance(exc, TimeoutError):
                self._abandon(msg_type, exc)
            raise
        if reply.meta.get("seq") != seq and reply.msg_type != MsgType.ERROR:
            raise RudraError(f"reply out of order: expected seq {seq}, got {reply.meta.get('seq')}")
        return reply

    def _abandon(self, msg_type: MsgType, exc: BaseException) -> None:
        """Close the connection under an interrupted request (its reply must never be read)."""
        self._abandoned = (
            f"connection closed: a {msg_type.name} request was interrupted ({type(exc).__name__}) "
            "before its reply came; connect again"
        )
        self.conn.close()

    def _weights(self, frame: Frame) -> Weights:
        frame = _check(frame, MsgType.WEIGHTS)
        arrays = frame.arrays
        if len(arrays) != 1 or arrays[0].size != self.weights.size:
            frame.release()
            raise RudraError("the weights reply does not match the parameter layout")
        if not np.shares_memory(arrays[0], self.weights):
            self.weights[:] = arrays[0]
        if frame.lent is not None and not frame.lent():
            frame.release()
            raise PeerGone("the server closed the connection while its weights were being read (they may mix updates)")
        self.clock = frame.meta["timestamp"]
        self.learners = frame.meta.get("learners", self.learners)
        frame.release()
        return Weights(self.clock, self.weights, bool(frame.meta.get("stop")))

    async def pull(self, newer_than: Stamp = -1) -> Weights:
        """The newest weights; with ``newer_than``, wait until the clock passes it."""
        return self._weights(await self._request(MsgType.PULL, {"newer_than": scalar(newer_than)}))

    async def push(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Ack:
        """Push a gradient computed on weights stamped ``timestamp`` over ``samples`` examples
        (``loss``, the mini-batch's training loss, feeds the server's loss curve). ``grad``:
        one float32 (or float16) array of the layout's size, or its parts end to end (each
        tensor's gradient, in layout order), sent as they are, without gathering them.
        ``lr``: new base rates of the parameter groups (a scheduler's), one per group."""
        meta = self._push_meta(timestamp, step, samples, False, loss, lr)
        reply = _check(await self._request(MsgType.PUSH, meta, gradient_segments(grad)), MsgType.ACK)
        reply.release()
        m = reply.meta
        return Ack(m["timestamp"], m["status"], m.get("staleness"), bool(m.get("stop")))

    async def push_pull(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Weights:
        """Push a gradient and get the weights the protocol lets this learner have next, in one
        round trip (for hardsync: the weights after this round's update)."""
        meta = self._push_meta(timestamp, step, samples, True, loss, lr)
        return self._weights(await self._request(MsgType.PUSH, meta, gradient_segments(grad)))

    async def exchange_state(self, arrays: Sequence[np.ndarray], *, every: bool, reply: bool) -> list[np.ndarray]:
        """Send the model's frozen parameters and buffers (``every``: all state tensors, in
        the order of the hello's ``state``) or its buffers only; with ``reply``, return the
        run's values of every state tensor (new arrays), else []."""
        meta = {"tensors": "all" if every else "buffers", "reply": reply}
        frame = _check(
            await self._request(MsgType.STATE, meta, [np.require(a, requirements="C") for a in arrays]), MsgType.STATE
        )
        values = [a.copy() for a in frame.arrays]
        frame.release()
        return values

    def _push_meta(
        self, timestamp: Stamp, step: int, samples: int, pull: bool, loss: float | None, lr: Sequence[float] | None
    ) -> dict[str, Any]:
        """A PUSH's fields; whole numbers of any integer type (numpy's, a one-element integer
        tensor) are sent as ints, anything else is RequestError ``bad_request``."""
        try:
            meta: dict[str, Any] = {
                "learner_id": self.learner_id,
                "timestamp": scalar(timestamp),
                "step": operator.index(step),
                "samples": operator.index(samples),
                "pull": pull,
            }
            if loss is not None:
                meta["loss"] = float(loss)
            if lr is not None:
                meta["lr"] = [float(r) for r in lr]
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad push argument: {exc}", code="bad_request") from None
        return meta

    async def close(self) -> None:
        """Say bye (best effort, waiting at most :data:`BYE_TIMEOUT_S` for the answer) and close.
        Idempotent."""
        if not self.conn.is_closed:
            try:
                await self.conn.within(self._request(MsgType.BYE, {}), BYE_TIMEOUT_S)
            except (RudraError, TimeoutError, asyncio.TimeoutError):
                pass
        self.conn.close()


@dataclass(frozen=True)
class _Where:
    """Whom a handshake talks to: the URL, and the TLS context if any (for the errors)."""

    url: str
    tls: ssl.SSLContext | None = None

    def __str__(self) -> str:
        return self.url

    def cut(self, expected: str, exc: Exception) -> ConnectError:
        """The error for a server that closed the connection before its ``expected`` reply."""
        if self.tls is not None and not security.has_client_certificate(self.tls):
            return ConnectError(
                f"{self.url} closed the TLS connection before its {expected} ({exc}): it requires a client "
                "certificate, most likely: give --tls-cert and --tls-key, a certificate its --tls-client-ca signed"
            )
        secret = "if it requires a secret, give --secret-file or RUDRA_ASYNC_SECRET"
        tls = "" if self.tls is not None else "if it uses TLS, connect with a CA (--tls-ca); "
        return TryLater(  # a full server may close before its ERROR is read: worth trying again
            f"{self.url} closed the connection before its {expected} ({exc}); it may be full (then try again "
            f"later); {tls}{secret}"
        )


async def _exchange(
    conn: Channel,
    msg_type: MsgType,
    meta: dict[str, Any],
    arrays: Sequence[np.ndarray],
    where: _Where,
    timeout: float,
    expected: str,
) -> Frame:
    """Send a request of the handshake and return its reply, within ``timeout``; clear
    errors for silence and for a server that hangs up (e.g. a TLS server spoken to in
    plain text, or a server that wants a secret or a client certificate)."""
    try:
        await conn.send(msg_type, meta, arrays)
    except PeerGone:
        pass  # it hung up before this request: why (a full server's ERROR), if it said, is read next
    try:
        return await conn.within(conn.recv(), timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise ConnectError(f"{where} sent no {expected} within {timeout:g} s (is it a rudra-async server?)") from None
    except PeerGone as exc:
        raise where.cut(expected, exc) from None


async def _authenticate(conn: Channel, secret: bytes, url: _Where, timeout: float) -> None:
    """The handshake of docs/wire.md: prove we know the secret, then make the server prove it."""
    nonce = security.new_nonce()
    reply = _check(
        await _exchange(conn, MsgType.AUTH, {"nonce": nonce}, (), url, timeout, "CHALLENGE"), MsgType.CHALLENGE
    )
    reply.release()
    server_nonce = reply.meta.get("nonce")
    if not isinstance(server_nonce, bytes) or len(server_nonce) != len(nonce):
        raise ConnectError(f"{url} answered the authentication with a malformed challenge")
    proof = {"proof": security.client_proof(secret, nonce, server_nonce)}
    ok = _check(await _exchange(conn, MsgType.PROOF, proof, (), url, timeout, "AUTHENTICATED"), MsgType.AUTHENTICATED)
    ok.release()
    if not security.verify(security.server_proof(secret, nonce, server_nonce), ok.meta.get("proof")):
        raise ConnectError(
            f"{url} does not know the secret: it is not the server it claims to be (or the secrets differ)"
        )


def _check(frame: Frame, expected: MsgType, auth_hint: bool = False) -> Frame:
    if frame.msg_type == MsgType.ERROR:
        frame.release()
        code = str(frame.meta.get("code", "internal"))
        message = str(frame.meta.get("message", ""))
        if code == "auth_required" and auth_hint:
            message += "; give the secret with --secret-file or RUDRA_ASYNC_SECRET"
        elif code == "auth_failed":
            message += " (the secrets differ)"
        elif code == "auth_unavailable":
            message += "; this learner has a secret and will not talk to a server that cannot prove it knows it"
        elif code == "shutting_down":  # the server is going away: the connection is lost, and here is why
            raise PeerGone(message)
        elif code in BUSY:
            raise ServerBusy(f"the server is busy: {message} (it may take the connection later)", reason=code)
        raise RemoteError(message, code=code)
    if frame.msg_type != expected:
        frame.release()
        raise RudraError(f"expected {expected.name}, got message type {frame.msg_type}")
    return frame


#: the codes of a server that had no room for the connection (:class:`ServerBusy`)
BUSY = frozenset({"too_many_connections", "evicted"})

#: WELCOME fields that differ from shard to shard of one group by design
PER_SHARD = frozenset(
    {"learner_id", "shard", "range", "clock", "resumed", "server", "pid", "index", "learners", "state", "lr"}
)


def same_settings(welcomes: Sequence[dict[str, Any]]) -> None:
    """ConfigError unless the shards' WELCOMEs agree on everything but :data:`PER_SHARD`
    (protocol, its options, parameter groups, momentum, ...): a group whose servers were
    started with other settings (a typo on one host) would train differently shard by shard."""
    first = {k: v for k, v in welcomes[0].items() if k not in PER_SHARD}
    for index, welcome in enumerate(welcomes[1:], 1):
        theirs = {k: v for k, v in welcome.items() if k not in PER_SHARD}
        differ = sorted(k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k))
        if differ:
            shown = "; ".join(f"{k} {quoted(theirs.get(k))} there, {quoted(first.get(k))} on shard 0" for k in differ)
            raise ConfigError(f"shard {index} of the group runs other settings than shard 0: {shown}")


class ShardedClient:
    """One learner's connections to every shard of a sharded server group, with the
    interface of :class:`Client`. Shard i (of S) holds the i-th of S contiguous ranges of the
    flat parameters; pushes and pulls go to all shards at once, each with its own clock, so
    timestamps are tuples. Pulled weights land straight in one flat buffer."""

    def __init__(self, clients: Sequence[Client], layout: Layout) -> None:
        self.clients = list(clients)
        self.layout = layout
        self.weights = np.empty(layout.size, np.float32)

    @classmethod
    async def connect(
        cls, urls: Sequence[str], layout: Layout, initial: np.ndarray | None = None, **kwargs: Any
    ) -> ShardedClient:
        """Connect to ``urls[i]`` as shard i of ``len(urls)``."""
        shards = [Shard(i, len(urls)) for i in range(len(urls))]
        ranges = [s.range(layout.size) for s in shards]
        parts = [
            None if initial is None else np.ascontiguousarray(initial, np.float32).reshape(-1)[lo:hi]
            for lo, hi in ranges
        ]
        state = kwargs.pop("state", None)  # shard 0 keeps the model's frozen parameters and buffers
        results = await asyncio.gather(
            *(
                Client.connect(url, layout, part, shard=shard, state=state if shard.index == 0 else None, **kwargs)
                for url, part, shard in zip(urls, parts, shards)
            ),
            return_exceptions=True,
        )
        clients = [r for r in results if isinstance(r, Client)]
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            try:
                same_settings([c.welcome for c in clients])
            except ConfigError as exc:
                errors.append(exc)
        if errors:
            await asyncio.gather(*(c.close() for c in clients))
            raise errors[0]
        return cls(clients, layout)

    @property
    def weights(self) -> np.ndarray:
        return self._weights

    @weights.setter
    def weights(self, buffer: np.ndarray) -> None:
        """Each shard's part of the buffer becomes that shard client's receive buffer."""
        self._weights = buffer
        for c in self.clients:
            c.weights = buffer[c.range[0] : c.range[1]]

    @property
    def learner_id(self) -> int:
        return self.clients[0].learner_id

    @property
    def resumed_from(self) -> int | None:
        return self.clients[0].resumed_from

    @property
    def protocol(self) -> str:
        return self.clients[0].protocol

    @property
    def index(self) -> int:
        return self.clients[0].index

    @property
    def learners(self) -> int:
        return self.clients[0].learners

    @property
    def welcome(self) -> dict[str, Any]:
        """Shard 0's WELCOME (every shard runs the same settings: :meth:`connect` checks)."""
        return self.clients[0].welcome

    def _per_shard(self, stamp: Stamp) -> list[int]:
        """One clock per shard: ``stamp`` for each, or its items (whole numbers of any integer
        type); RequestError ``bad_request`` otherwise."""
        try:
            items: list[Any] = list(stamp) if np.ndim(stamp) == 1 else [stamp] * len(self.clients)  # type: ignore[arg-type]
            stamps = [operator.index(s) for s in items]
        except TypeError:
            stamps = []
        if len(stamps) != len(self.clients):
            raise RequestError(
                f"need a whole number or one per shard ({len(self.clients)}) as timestamp, got {stamp!r}",
                code="bad_request",
            )
        return stamps

    def _combine(self, parts: Sequence[Weights]) -> Weights:
        return Weights(tuple(scalar(w.timestamp) for w in parts), self._weights, any(w.stop for w in parts))

    async def pull(self, newer_than: Stamp = -1) -> Weights:
        return self._combine(await _all(c.pull(n) for c, n in zip(self.clients, self._per_shard(newer_than))))

    async def _to_every_shard(
        self,
        method: str,
        grad: Gradient,
        timestamp: Stamp,
        step: int,
        samples: int,
        loss: float | None,
        lr: Sequence[float] | None,
    ) -> list[Any]:
        """Call ``Client.<method>`` on every shard with its part of ``grad`` and its own stamp
        (the loss goes to shard 0 only, for its loss curve). A gradient of the wrong length is
        refused (RequestError ``bad_shape``) before any shard gets a part of it."""
        parts = gradient_parts(grad)
        values = sum(p.size for p in parts)
        if values != self.layout.size:
            raise RequestError(
                f"gradient must have {self.layout.size} values end to end (the layout's size), got {values}",
                code="bad_shape",
            )
        return await _all(
            getattr(c, method)(gradient_segments(parts, *c.range), t, step, samples, loss if i == 0 else None, lr)
            for i, (c, t) in enumerate(zip(self.clients, self._per_shard(timestamp)))
        )

    async def push(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Ack:
        acks = await self._to_every_shard("push", grad, timestamp, step, samples, loss, lr)
        statuses = {a.status for a in acks}
        status = "applied" if statuses == {"applied"} else "dropped" if "dropped" in statuses else "pending"
        staleness = [a.staleness for a in acks if a.staleness is not None]
        return Ack(
            tuple(scalar(a.timestamp) for a in acks),
            status,
            max(staleness) if staleness else None,
            any(a.stop for a in acks),
        )

    async def push_pull(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Weights:
        return self._combine(await self._to_every_shard("push_pull", grad, timestamp, step, samples, loss, lr))

    async def exchange_state(self, arrays: Sequence[np.ndarray], *, every: bool, reply: bool) -> list[np.ndarray]:
        """Shard 0 keeps the model's frozen parameters and buffers (:meth:`Client.exchange_state`)."""
        return await self.clients[0].exchange_state(arrays, every=every, reply=reply)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


async def _all(coros: Any) -> list[Any]:
    """Run every coroutine to its end; then raise the first error, if any (none is left running)."""
    results = await asyncio.gather(*coros, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


async def connect(url: str, layout: Layout, initial: np.ndarray | None = None, **kwargs: Any) -> Client | ShardedClient:
    """A :class:`Client`, or a :class:`ShardedClient` when ``url`` lists the shards' addresses
    separated by commas, in shard order (``tcp://a:7000,tcp://b:7000``)."""
    urls = [u.strip() for u in url.split(",")]
    if len(urls) == 1:
        return await Client.connect(url, layout, initial, **kwargs)
    return await ShardedClient.connect(urls, layout, initial, **kwargs)


BLOCKING_ON_A_SERVING_LOOP = (
    "a blocking client (SyncClient, DistributedOptimizer) was made on the thread that runs the "
    "event loop of a parameter server in this process (a notebook cell or a coroutine next to an "
    "embedded server): each call would block that loop, so the server could never answer. Make it "
    "on another thread (threading.Thread, or 'await asyncio.to_thread(...)'), or use the async "
    "Client ('await Client.connect(...)') on that loop"
)


class SyncClient:
    """Blocking form of :class:`Client` (or of :class:`ShardedClient`, when ``url`` lists
    several shards), for code that is not async.

    Over a transport with a blocking connection (``tcp://``, ``shm://``), the asyncio client's
    code runs on a blocking socket with no event loop at all
    (:func:`~rudra_async.eventloop.run_sync`), so a round trip costs what the asyncio client's
    does; otherwise it drives the asyncio client on a private event loop (uvloop when available)."""

    def __init__(
        self, url: str, layout: Layout, initial: np.ndarray | None = None, *, wait: float = 0.0, **kwargs: Any
    ) -> None:
        """``wait``: seconds to keep trying while the server cannot take the connection (not up
        yet, or full: :class:`~rudra_async.errors.TryLater`); other failures are raised at once.
        ``kwargs``: :meth:`Client.connect`'s. ConfigError at once if this thread runs the event
        loop of a parameter server of this process (a notebook's cell under an embedded
        server): blocking there would stall that server, which could then never answer."""
        if serving_here():
            raise ConfigError(BLOCKING_ON_A_SERVING_LOOP)
        self._loop: PrivateLoop | None = None
        self._run: Callable[[Coroutine[Any, Any, Any]], Any] = run_sync
        self._closed = False
        self._pulled = False  # whether weights have come whole into the buffer (a reconnect's seed)
        self._connect_args = (url, layout, initial, kwargs)
        try:
            self._client = self._connect_within(wait)
        except BaseException:
            self._close_loop()
            raise

    def _connect_within(self, wait: float, retry_every: float = 0.25) -> Client | ShardedClient:
        """:meth:`_connect`, again while the server cannot take the connection now
        (:class:`~rudra_async.errors.TryLater`: not up yet, or full), for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._connect()
            except TryLater as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if left + retry_every >= wait:  # said once, at the first failure
                    log.info("%s; waiting for the server for up to %g s", exc, wait)
                time.sleep(min(retry_every, left))

    def reconnect(self, within: float, retry_every: float = 0.5) -> Weights:
        """After losing the server: connect, say hello and pull again, retrying until
        ``within`` seconds have passed (then the last error is raised); returns the pulled
        weights. The weights buffer is kept, and once weights have come into it, they are this
        learner's initial ones in the new hello: a server restarted without a checkpoint (a
        shard of a group, say) goes on from the weights the learner last had (if the server
        was lost while they came, partly the ones before), not from the run's first ones.
        The learner id may change; the learner asks for its index again."""
        buffer = self._client.weights
        url, layout, initial, kwargs = self._connect_args
        kwargs = {**kwargs, "index": self._client.index}  # the same part of the data, if still free
        self._connect_args = (url, layout, buffer.copy() if self._pulled else initial, kwargs)
        self._call(self._client.close())
        deadline = time.monotonic() + within
        while True:
            try:
                self._client = self._connect()
                self._client.weights = buffer
                weights = self.pull()
                break
            except (TransportError, TimeoutError, asyncio.TimeoutError):
                if time.monotonic() + retry_every > deadline:
                    raise
                time.sleep(retry_every)
        log.warning("reconnected to %s at update %s", self._connect_args[0], weights.timestamp)
        return weights

    def _connect(self) -> Client | ShardedClient:
        url, layout, initial, kwargs = self._connect_args
        limits, timeout, tls = kwargs.get("limits", Limits()), kwargs.get("timeout", DEFAULT_TIMEOUT), kwargs.get("tls")
        channel = None if "," in url else transports.connect_blocking(url, limits=limits, timeout=timeout, tls=tls)
        if channel is None:
            self._loop = self._loop or PrivateLoop()
            self._run = self._loop.run
            client: Client | ShardedClient = self._loop.run(connect(url, layout, initial, **kwargs))
            return client
        self._run = run_sync
        hello_kwargs = {k: v for k, v in kwargs.items() if k != "limits"}
        channel.settimeout(timeout)  # the deadline of the hello
        client = run_sync(Client.hello(channel, layout, initial, url=url, **hello_kwargs))
        channel.settimeout(None)
        return client

    @property
    def learner_id(self) -> int:
        return self._client.learner_id

    @property
    def welcome(self) -> dict[str, Any]:
        return self._client.welcome

    @property
    def resumed_from(self) -> int | None:
        """The checkpoint clock the server resumed from (``--resume``), or None."""
        return self._client.resumed_from

    @property
    def layout(self) -> Layout:
        return self._client.layout

    @property
    def weights(self) -> np.ndarray:
        return self._client.weights

    def set_weights_buffer(self, buffer: np.ndarray) -> None:
        """Receive pulled weights straight into ``buffer`` (flat float32, e.g. a model's parameters)."""
        if buffer.dtype != np.float32 or buffer.size != self.layout.size or not buffer.flags.c_contiguous:
            raise ValueError(f"weights buffer must be contiguous float32 of {self.layout.size} values")
        self._client.weights = buffer.reshape(-1)

    def pull(self, newer_than: Stamp = -1) -> Weights:
        weights: Weights = self._call(self._client.pull(newer_than))
        self._pulled = True
        return weights

    def push(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Ack:
        ack: Ack = self._call(self._client.push(grad, timestamp, step, samples, loss, lr))
        return ack

    def push_pull(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Weights:
        weights: Weights = self._call(self._client.push_pull(grad, timestamp, step, samples, loss, lr))
        self._pulled = True
        return weights

    def exchange_state(self, arrays: Sequence[np.ndarray], *, every: bool, reply: bool) -> list[np.ndarray]:
        """See :meth:`Client.exchange_state`."""
        values: list[np.ndarray] = self._call(self._client.exchange_state(arrays, every=every, reply=reply))
        return values

    @property
    def index(self) -> int:
        """This learner's index (its part of the data), as the server assigned it."""
        return self._client.index

    @property
    def learners(self) -> int:
        """λ as the server last said (WELCOME, then every WEIGHTS): how many parts the data has."""
        return self._client.learners

    def _call(self, request: Coroutine[Any, Any, T]) -> T:
        """Run one of the client's coroutines; ConnectionClosed once this client is closed."""
        if self._closed:
            request.close()
            raise ConnectionClosed("the client is closed")
        result: T = self._run(request)
        return result

    def close(self) -> None:
        """Say bye (waiting at most :data:`BYE_TIMEOUT_S` for the answer) and close (and the
        private event loop, if any). Idempotent."""
        if self._closed:
            return
        try:
            self._run(self._client.close())
        finally:
            self._closed = True
            self._close_loop()

    def _close_loop(self) -> None:
        if self._loop is not None:
            self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Learner groups (the paper's "adv"): G learner processes on one host that meet the server
as one learner.

Every step, the group's members add their gradients locally (an all-reduce over gloo, on
this host) and the group's leader (rank 0) pushes the result as one gradient, of the
group's samples; the weights come back once, to the leader, which shares them with the
members. The server sees λ/G learners; its staleness statistics are per pushed gradient.

The combined gradient, for members i = 0 … G−1 with mini-batch gradients g_i (float32) of
S_i samples: g = (Σ_i m_i·g_i) / (Σ_i m_i), m_i = S_i (1 for a member that gave no
samples); the products, gloo's sum (in its order) and the division in float32. With mean
losses this is the gradient of the mean loss over the members' mini-batches put together:
hardsync over groups is SGD on the concatenated batch. The push carries S = Σ S_i and the
mean of the members' losses (of those that gave one).

A group ends when its first member stops (its loop ended, or it closed): the others' next
exchange returns no new weights and says the run is over, so every member's loop ends too;
the leader then says bye to the server. Buffers (BatchNorm's statistics) are averaged over
the members (floating-point ones; the others are the leader's) before the leader reports
them. A member that dies is noticed by the others' next exchange (LearnerError).

The members trust each other: the group's channel (a TCPStore at ``address`` and gloo's
connections) has no secret; bind it to a loopback or host-local address.
"""

from __future__ import annotations

import datetime
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from .. import errors
from ..client import Gradient, Stamp, SyncClient, Weights, gradient_segments
from ..errors import LearnerError
from ..layout import Layout

T = TypeVar("T")

#: seconds a member waits for the others (a step of the slowest, or the server's answer to the leader)
DEFAULT_GROUP_TIMEOUT = 900.0
#: int64 values of the header that comes with the weights (7 + the clocks: at most 57 shards)
HEADER = 64


class _Op(enum.IntEnum):
    """What a member is doing; every call of the group starts by comparing them."""

    HELLO = 0
    PULL = 1
    PUSH_PULL = 2
    RUN_STATE = 3  # the run's state at the start (or after a reconnect)
    REPORT = 4  # the buffers' report
    RECONNECT = 5
    CLOSE = 6


class LocalGroup:
    """The channel of a learner group: ``size`` processes, this one ``rank`` (0: the leader,
    which listens at ``address``, ``host:port``). Blocks until every member has joined (at
    most ``timeout`` seconds). Errors: LearnerError."""

    def __init__(self, rank: int, size: int, address: str, timeout: float = DEFAULT_GROUP_TIMEOUT) -> None:
        if size < 1 or not 0 <= rank < size:
            raise LearnerError(f"a group of {size} learners has no rank {rank}")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise LearnerError(f"a group's address is host:port, got {address!r}")
        self.rank, self.size = rank, size
        host, wait = host.strip("[]"), datetime.timedelta(seconds=timeout)
        try:
            store = dist.TCPStore  # type: ignore[attr-defined]
            self._store = store(host, int(port), size, rank == 0, timeout=wait)
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = wait
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # gloo there too
            self._pg = dist.ProcessGroupGloo(self._store, rank, size, options)
        except (RuntimeError, ValueError, OSError) as exc:
            raise LearnerError(f"learner group at {address}: rank {rank} of {size} could not join: {exc}") from exc

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's ``tensor`` added, in place, on every member."""
        return self._wait(lambda: self._pg.allreduce([tensor]), tensor, "add")  # type: ignore[attr-defined]

    def share_(self, tensor: torch.Tensor) -> torch.Tensor:
        """The leader's ``tensor``, in place, on every member."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self._wait(lambda: self._pg.broadcast([tensor], opts), tensor, "share")  # type: ignore[attr-defined]

    def share(self, value: Any = None) -> Any:
        """The leader's ``value`` (msgpack-able) on every member."""
        data = msgpack.packb(value, use_bin_type=True) if self.leader else b""
        size = self.share_(torch.tensor([len(data)], dtype=torch.int64))
        body = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.leader
            else torch.empty(int(size), dtype=torch.uint8)
        )
        if int(size):
            self.share_(body)
        return msgpack.unpackb(body.numpy().tobytes(), raw=False)

    def _wait(self, start: Callable[[], Any], tensor: torch.Tensor, what: str) -> torch.Tensor:
        try:
            start().wait()
        except RuntimeError as exc:
            raise LearnerError(f"learner group: a member was lost ({what}): {exc}") from exc
        return tensor

    def close(self) -> None:
        """Let go of the group's connections (idempotent)."""
        self._pg = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def _error_record(exc: BaseException) -> dict[str, Any]:
    return {"kind": type(exc).__name__, "code": getattr(exc, "code", None), "message": str(exc)}


def _raise_record(record: dict[str, Any]) -> None:
    """Raise, on a member, the error the leader's call raised (its class where it is one of
    rudra-async's with the usual constructor, else a LearnerError naming it)."""
    cls = getattr(errors, str(record["kind"]), None)
    if isinstance(cls, type) and issubclass(cls, errors.RudraError) and cls.__init__ is errors.RudraError.__init__:
        exc = cls(record["message"], code=record["code"])
    else:
        exc = LearnerError(f"the group's leader failed: {record['kind']}: {record['message']}")
    exc.group_shared = True  # type: ignore[attr-defined]
    raise exc


def _collective(method: Callable[..., T]) -> Callable[..., T]:
    """A call of the group: an error that every member raised alike (the leader's, shared)
    leaves the group in step; any other (a lost member, Ctrl-C part-way) ends it, so that
    :meth:`GroupClient.close` makes no collective the others would not match."""

    @functools.wraps(method)
    def call(self: GroupClient, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            if not getattr(exc, "group_shared", False):
                self._ended = True
            raise

    return call


class GroupClient:
    """What :class:`~rudra_async.learner.api.DistributedOptimizer` needs of a
    :class:`~rudra_async.client.SyncClient`, for one member of a :class:`LocalGroup`: the
    leader runs the real client (made by ``connect``), the members none. Every call is the
    group's: each member makes the same calls in the same order (the same steps), with the
    same ``layout`` (checked at the start)."""

    def __init__(self, group: LocalGroup, connect: Callable[[], SyncClient], layout: Layout) -> None:
        self.group = group
        self._values = layout.size
        self._client: SyncClient | None = None
        self._ended = False  # a member stopped: from now on every call is this process's alone
        self._buffer: np.ndarray | None = None
        self._timestamp: Stamp = 0
        self._start(_Op.HELLO)
        facts = self._lead(lambda: self._hello(connect))
        same = facts["layout"] == msgpack.unpackb(msgpack.packb(layout.to_wire()))  # as the leader's came
        if self.group.sum_(torch.tensor([float(same)])).item() != group.size:
            self._ended = True
            self.close()
            raise LearnerError(
                "the models of a learner group differ (parameters' names, shapes or order): "
                + ("this learner's differs from the leader's" if not same else "a member's differs from this leader's")
            )
        self.welcome: dict[str, Any] = facts["welcome"]
        self.learner_id: int = facts["learner_id"]
        self.resumed_from: int | None = facts["resumed_from"]
        self._index: int = facts["index"]
        self._learners: int = facts["learners"]

    def _hello(self, connect: Callable[[], SyncClient]) -> dict[str, Any]:
        self._client = client = connect()
        return {
            "layout": client.layout.to_wire(),
            "welcome": client.welcome,
            "learner_id": client.learner_id,
            "resumed_from": client.resumed_from,
            "index": client.index,
            "learners": client.learners,
        }

    # -- what the learner is ---------------------------------------------------------------------
    @property
    def index(self) -> int:
        """This member's part of the data: the group's index × G + its rank."""
        return self._index * self.group.size + self.group.rank

    @property
    def learners(self) -> int:
        """The run's learner processes: the server's learners (groups) × G."""
        return self._learners * self.group.size

    @property
    def ended(self) -> bool:
        """Whether the group has ended (a member stopped): exchanges no longer reach the server."""
        return self._ended

    # -- calls -----------------------------------------------------------------------------------
    def set_weights_buffer(self, buffer: np.ndarray) -> None:
        self._buffer = buffer.reshape(-1)
        if self._client is not None:
            self._client.set_weights_buffer(buffer)

    @_collective
    def pull(self, newer_than: Stamp = -1) -> Weights:
        if self._start(_Op.PULL) is None:
            return self._over()
        return self._weights(lambda client: client.pull(newer_than))

    @_collective
    def reconnect(self, within: float, retry_every: float = 0.5) -> Weights:
        if self._start(_Op.RECONNECT) is None:
            return self._over()
        return self._weights(lambda client: client.reconnect(within, retry_every))

    @_collective
    def push_pull(
        self,
        grad: Gradient,
        timestamp: Stamp,
        step: int = 0,
        samples: int = 0,
        loss: float | None = None,
        lr: Sequence[float] | None = None,
    ) -> Weights:
        told = self._start(_Op.PUSH_PULL, grad, samples, loss)
        if told is None:
            return self._over()
        tail = told[self._values :].tolist()
        weight, total, losses, given = tail[len(_Op) :]
        combined = told[: self._values].div_(weight).numpy()
        mean_loss = losses / given if given else None
        return self._weights(lambda client: client.push_pull(combined, timestamp, step, int(total), mean_loss, lr))

    @_collective
    def exchange_state(self, arrays: Sequence[np.ndarray], *, every: bool, reply: bool) -> list[np.ndarray]:
        """``every``: the run's state at the start (the leader's is sent; the run's comes back
        to every member); else the buffers' report: their mean over the members is sent."""
        if self._start(_Op.RUN_STATE if every else _Op.REPORT) is None:
            return self._client.exchange_state(arrays, every=every, reply=reply) if self._client else list(arrays)
        if not every:
            arrays = self._means(arrays)
        record = self._lead(lambda: _encode(self._client.exchange_state(arrays, every=every, reply=reply)))  # type: ignore[union-attr]
        return _decode(record)

    def close(self) -> None:
        """The leader says bye to the server; the group's channel is let go (idempotent)."""
        try:
            if not self._ended:
                self._start(_Op.CLOSE)
        finally:
            self._ended = True
            if self._client is not None:
                self._client.close()
            self.group.close()

    # -- the group's steps -------------------------------------------------------------------------
    def _start(
        self, op: _Op, grad: Gradient | None = None, samples: int = 0, loss: float | None = None
    ) -> torch.Tensor | None:
        """Every call of the group starts with one all-reduce: the members' m_i·g_i (zeros
        but for a push), what each is doing, and Σm_i, ΣS_i and their losses (m_i: S_i, or 1
        for a member that gave no samples). None (and the group has ended) when the members
        are not all doing the same, or when it had already ended; else the summed tensor."""
        if self._ended:
            return None
        # Every op's tensor has the gradient's room (zeros but for a push): members doing different
        # ops must still meet in one all-reduce of one size, and a push then needs no second one.
        n = 0 if op is _Op.HELLO else self._values  # at the hello the layouts are not yet known to agree
        told = torch.zeros(n + len(_Op) + 4, dtype=torch.float32)
        weight = samples if samples > 0 else 1
        if grad is not None:
            start = 0
            for part in gradient_segments(grad):  # each part straight into its place: no gathered copy
                torch.mul(torch.from_numpy(part), weight, out=told[start : start + part.size])
                start += part.size

        tail = told[n:]
        tail[op] = 1
        tail[len(_Op) :] = torch.tensor([weight, samples, 0.0 if loss is None else loss, loss is not None])
        self.group.sum_(told)
        if tail[op] != self.group.size:  # a member stopped (or left its loop early): the group ends here
            self._ended = True
            return None
        return told

    def _lead(self, call: Callable[[], Any]) -> Any:
        """The leader's ``call``, its result (or its error) shared with every member (msgpack)."""
        record = None
        if self.group.leader:
            try:
                record = {"ok": call()}
            except BaseException as exc:
                self.group.share({"error": _error_record(exc)})
                exc.group_shared = True  # type: ignore[attr-defined]
                raise
        record = self.group.share(record)
        if "error" in record:
            _raise_record(record["error"])
        return record["ok"]

    def _weights(self, call: Callable[[SyncClient], Weights]) -> Weights:
        """The leader's ``call`` (a push+pull, pull or reconnect): its weights shared, with a
        header of :data:`HEADER` int64: status (0; 1: an error, shared next), stop, the
        server's λ, the leader's learner id, the checkpoint clock its server resumed from + 1
        (0: none), the group's index, k, then the k clocks (one per shard)."""
        assert self._buffer is not None, "set_weights_buffer first"
        head = torch.zeros(HEADER, dtype=torch.int64)
        failed: BaseException | None = None
        if self.group.leader:
            client = self._client
            assert client is not None
            try:
                weights = call(client)
                clocks = list(weights.timestamp) if isinstance(weights.timestamp, tuple) else [weights.timestamp]
                resumed = 0 if client.resumed_from is None else client.resumed_from + 1
                facts = [0, weights.stop, client.learners, client.learner_id, resumed, client.index, len(clocks)]
                head[: len(facts) + len(clocks)] = torch.tensor([*facts, *clocks])
            except BaseException as exc:
                failed, head[0] = exc, 1
        self.group.share_(head)
        if int(head[0]):
            record = self.group.share({"error": _error_record(failed)} if failed is not None else None)
            if failed is not None:
                failed.group_shared = True  # type: ignore[attr-defined]
                raise failed
            _raise_record(record["error"])
        self.group.share_(torch.from_numpy(self._buffer))
        _, stop, self._learners, self.learner_id, resumed, self._index, k = head[:7].tolist()
        self.resumed_from = None if resumed == 0 else resumed - 1
        clocks = head[7 : 7 + k].tolist()
        self._timestamp = tuple(clocks) if k > 1 else clocks[0]
        return Weights(self._timestamp, self._buffer, bool(stop))

    def _over(self) -> Weights:
        """No exchange: the group has ended (a member stopped); the weights at hand, and stop."""
        assert self._buffer is not None, "set_weights_buffer first"
        return Weights(self._timestamp, self._buffer, True)

    def _means(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The members' mean of each floating-point array (one all-reduce, in float64, rounded
        back to the array's dtype); the others (counts: BatchNorm's batches seen) the leader's."""
        floating = [a for a in arrays if np.issubdtype(a.dtype, np.floating)]
        if not floating:
            return list(arrays)
        total = self.group.sum_(torch.from_numpy(np.concatenate([a.reshape(-1) for a in floating]).astype(np.float64)))
        means = iter(np.split((total / self.group.size).numpy(), np.cumsum([a.size for a in floating])[:-1]))
        return [
            next(means).astype(a.dtype).reshape(a.shape) if np.issubdtype(a.dtype, np.floating) else a for a in arrays
        ]


def _encode(arrays: Sequence[np.ndarray]) -> list[list[Any]]:
    return [[a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()] for a in arrays]


def _decode(record: list[list[Any]]) -> list[np.ndarray]:
    return [np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy() for dtype, shape, data in record]

"""A conformance suite any transport can run on itself.

    from rudra_async.testing import check_transport
    await check_transport("tcp://127.0.0.1:0")        # or your plugin's URL

It listens on the URL, connects to the listener's address, and checks the contract of
:mod:`rudra_async.transports.base`: small and large frames (over 256 MiB) both ways,
ordering with many frames in flight, concurrent connections, close semantics, reconnects,
back-pressure (a receiver that stops reading makes ``send`` wait long before
``CLOG_LIMIT`` bytes were accepted, and the send completes once it reads again), size
limits (``FrameTooLarge`` from the sender before sending, and from the receiver before
allocating), that the listener's ``on_accept`` hook runs before the first byte of a
connection is parsed (a frame sent with the connect is already subject to it), that a
server with a secret on this transport refuses missing, wrong and replayed proofs before
any state change and serves a learner that knows the secret, that the blocking connection
(where ``connect_blocking`` gives one) moves frames and closes as the asyncio one does, and — for transports that
cross processes — that a peer killed in the middle of a frame gives an error, never a hang
or a partial frame. Raises AssertionError on a violation; returns the names of the checks
that ran.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from . import transports
from .errors import ConnectionClosed, FrameTooLarge, PeerGone, RemoteError, RudraError
from .eventloop import run_sync
from .transports.base import Connection, Transport
from .transports.blocking import BlockingConnection
from .wire import Frame, Header, Limits, MsgType

__all__ = [
    "CHECKS",
    "check_transport",
]

MiB = 1 << 20
#: a transport must make ``send`` wait before a receiver that reads nothing was sent this much
CLOG_LIMIT = 256 * MiB
#: how long a ``send`` to a clogged receiver may take before it counts as waiting
CLOG_WAIT_S = 0.5
CHECKS: list[Callable[[_Suite], Awaitable[None]]] = []


def _check(fn: Callable[[_Suite], Awaitable[None]]) -> Callable[[_Suite], Awaitable[None]]:
    CHECKS.append(fn)
    return fn


def _payload(nbytes: int, seed: int) -> np.ndarray:
    a = np.empty(nbytes, np.uint8)
    a[:] = seed % 251
    if nbytes:
        a[:: max(1, nbytes // 64)] = np.arange(len(a[:: max(1, nbytes // 64)])) % 256
    return a


def _echoed_meta(frame: Frame) -> dict[str, Any]:
    """A received frame's metadata without the transport's ``seg`` list, to send back."""
    return {k: v for k, v in frame.meta.items() if k != "seg"}


class _Suite:
    def __init__(self, url: str, transport: Transport, limits: Limits, large: tuple[int, ...], timeout: float) -> None:
        self.url, self.transport, self.limits, self.large, self.timeout = url, transport, limits, large, timeout
        self.address = ""
        self.victim_outcome: asyncio.Future[BaseException | None] | None = None
        self.server_saw_close: asyncio.Future[type] | None = None
        self.unclog: asyncio.Future[None] | None = None
        self.admitted: list[tuple[int, int]] = []  # (type, body length) of headers the admit hook saw

    def accept(self, conn: Connection) -> None:
        """The listener's on_accept: every header of the connection goes through ``admit``."""
        conn.admit = self.admit

    def admit(self, header: Header) -> None:
        self.admitted.append((header.msg_type, header.body_len))
        if header.msg_type == _REFUSED_TYPE:
            raise FrameTooLarge("refused by the admit hook", msg_type=header.msg_type)

    async def echo(self, conn: Connection) -> None:
        """Server side: send every frame back; obey a few commands carried in the metadata."""
        while True:
            try:
                frame = await conn.recv()
            except (PeerGone, ConnectionClosed) as exc:
                if self.server_saw_close is not None and not self.server_saw_close.done():
                    self.server_saw_close.set_result(type(exc))
                return
            cmd = frame.meta.get("cmd")
            if cmd == "victim":
                await self._watch_victim(conn)
                return
            if cmd == "close":
                conn.close()
                return
            if cmd == "express":
                await self._express_echo(conn)
            elif cmd == "clog":
                await self._clogged(conn)
            elif cmd == "send":
                await conn.send(MsgType.PUSH, {}, [np.zeros(frame.meta["nbytes"], np.uint8)])
            else:
                await self._echo_one(conn, frame)
            frame.release()

    async def _echo_one(self, conn: Connection, frame: Frame) -> None:
        await conn.send(frame.msg_type, _echoed_meta(frame), frame.arrays)

    async def _express_echo(self, conn: Connection) -> None:
        """Echo each frame from the ``express`` hook where the transport can send at once
        (``nowait_room``), else the usual way, until one with ``cmd: end`` (echoed, with
        ``answered``: how many went from the hook, and ``nowait``: whether this end's class
        overrides ``nowait_room``)."""
        answered = 0

        def express(frame: Frame) -> bool:
            nonlocal answered
            if frame.meta.get("cmd") == "end" or not conn.nowait_room(frame.body.nbytes):
                return False
            copies = [a.copy() for a in frame.arrays]  # the transport may send them after we return
            conn.send_nowait(frame.msg_type, _echoed_meta(frame), copies)
            frame.release()
            answered += 1
            return True

        while True:
            conn.express = express  # only while waiting in recv, as a server does
            try:
                frame = await conn.recv()
            finally:
                conn.express = None
            if frame.meta.get("cmd") == "end":
                overrides = type(conn).nowait_room is not Connection.nowait_room  # this (receiving) end's class
                await conn.send(frame.msg_type, {"cmd": "end", "answered": answered, "nowait": overrides})
                frame.release()
                return
            await self._echo_one(conn, frame)
            frame.release()

    async def _clogged(self, conn: Connection) -> None:
        """Read nothing until ``unclog``; then drop frames up to one with ``cmd: unclogged``, and echo that."""
        assert self.unclog is not None
        await self.unclog
        while True:
            frame = await conn.recv()
            if frame.meta.get("cmd") == "unclogged":
                await self._echo_one(conn, frame)
                frame.release()
                return
            frame.release()

    async def _watch_victim(self, conn: Connection) -> None:
        assert self.victim_outcome is not None
        outcome: BaseException | None = None
        try:
            while True:  # whole frames may arrive before the kill (a fast transport); a cut one must not
                frame = await conn.recv()
                if frame.body.nbytes != VICTIM_BYTES:
                    outcome = AssertionError(
                        f"a frame cut short arrived from a peer killed mid-frame ({frame.body.nbytes} body bytes)"
                    )
                    break
                frame.release()
        except RudraError as exc:
            outcome = exc
        if not self.victim_outcome.done():
            self.victim_outcome.set_result(outcome)

    async def connect(self, limits: Limits | None = None) -> Connection:
        return await self.transport.connect(self.address, limits=limits or self.limits, timeout=self.timeout)

    async def round_trip(self, conn: Connection, arrays: list[np.ndarray], **meta: Any) -> None:
        await conn.send(MsgType.PUSH, meta, arrays)
        _check_echo(await asyncio.wait_for(conn.recv(), self.timeout), arrays, meta)


@_check
async def small_frames(s: _Suite) -> None:
    conn = await s.connect()
    cases: list[list[np.ndarray]] = [
        [],
        [np.zeros(0, np.float32)],
        [np.arange(7, dtype=np.int64)],
        [np.ones((3, 4), np.float16), np.arange(5, dtype=np.uint8), np.zeros((0, 2), np.float64)],
    ]
    for i, arrays in enumerate(cases):
        await s.round_trip(conn, arrays, i=i, text="é", nested={"a": [1, 2.5, None]})
    conn.close()


@_check
async def large_frames(s: _Suite) -> None:
    conn = await s.connect()
    for size in s.large:
        await s.round_trip(
            conn, [_payload(size, size // MiB).view(np.float32) if size % 4 == 0 else _payload(size, 1)], size=size
        )
    conn.close()


@_check
async def ordering_with_many_in_flight(s: _Suite) -> None:
    conn = await s.connect()
    n = 200
    for i in range(n):
        await conn.send(MsgType.PULL, {"i": i}, [np.full(i % 5, i, np.int32)])
    for i in range(n):
        frame = await asyncio.wait_for(conn.recv(), s.timeout)
        assert frame.meta["i"] == i, f"frame {frame.meta['i']} arrived in place of {i}"
        assert np.all(frame.arrays[0] == i)
        frame.release()
    conn.close()


@_check
async def express_hook(s: _Suite) -> None:
    """Frames answered from the receiver's ``express`` hook (with ``send_nowait`` where the
    transport has room) and frames it declines arrive intact and in order, one at a time
    and many in flight."""
    conn = await s.connect()
    await conn.send(MsgType.PULL, {"cmd": "express"})
    for i in range(20):  # one at a time: each finds the inbox empty
        await s.round_trip(conn, [_payload(8 + 13 * i, i)] if i % 3 else [], i=i)
    n = 60
    for i in range(n):  # many in flight: offered only while the inbox is empty, else queued
        await conn.send(MsgType.PUSH, {"i": i}, [_payload(4 + 7 * i, i)])
    for i in range(n):
        frame = await asyncio.wait_for(conn.recv(), s.timeout)
        assert frame.meta == {"i": i, "seg": frame.meta["seg"]}, f"frame {frame.meta} arrived in place of {i}"
        assert np.array_equal(frame.arrays[0], _payload(4 + 7 * i, i)), "payload corrupted"
        frame.release()
    await conn.send(MsgType.PULL, {"cmd": "end"})
    end = await asyncio.wait_for(conn.recv(), s.timeout)
    assert end.meta.get("cmd") == "end", end.meta
    if end.meta["nowait"]:  # the receiving end can send without waiting: it did here
        assert end.meta["answered"] > 0, "nowait_room never said yes to a small frame on an idle connection"
    end.release()
    conn.close()


@_check
async def concurrent_connections(s: _Suite) -> None:
    async def pusher(k: int) -> None:
        conn = await s.connect()
        for step in range(20):
            await s.round_trip(conn, [_payload(4096 + 97 * k, k * 31 + step)], k=k, step=step)
        conn.close()

    await asyncio.gather(*(pusher(k) for k in range(8)))


@_check
async def close_semantics(s: _Suite) -> None:
    conn = await s.connect()
    await s.round_trip(conn, [np.ones(3, np.float32)])
    s.server_saw_close = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(conn.recv())
    await asyncio.sleep(0.01)
    conn.close()
    conn.close()  # twice is harmless
    assert conn.is_closed
    await _raises(
        ConnectionClosed, waiting, s.timeout, "a recv waiting during a local close must raise ConnectionClosed"
    )
    await asyncio.wait_for(conn.wait_lost(), s.timeout)
    for op in (conn.recv(), conn.send(MsgType.PULL, {})):
        await _raises(ConnectionClosed, op, s.timeout, "using a locally closed connection must raise ConnectionClosed")
    seen = await asyncio.wait_for(s.server_saw_close, s.timeout)
    assert seen is PeerGone, f"the server side saw {seen.__name__} when the client closed, not PeerGone"
    # the other way round: the server closes, the client sees PeerGone
    conn = await s.connect()
    await conn.send(MsgType.BYE, {"cmd": "close"})
    await _raises(PeerGone, conn.recv(), s.timeout, "recv after the peer closed must raise PeerGone")
    await asyncio.wait_for(conn.wait_lost(), s.timeout)
    conn.close()


async def _raises(expected: type[BaseException], aw: Awaitable[Any], timeout: float, violation: str) -> BaseException:
    """The ``expected`` exception ``aw`` raises within ``timeout``; else AssertionError(``violation``)."""
    try:
        await asyncio.wait_for(aw, timeout)
    except expected as exc:
        return exc
    except asyncio.TimeoutError:
        raise AssertionError(f"{violation} (it hung for {timeout:g} s)") from None
    except Exception as exc:
        raise AssertionError(f"{violation}, not {exc!r}") from exc
    raise AssertionError(f"{violation} (it returned)")


@_check
async def reconnect(s: _Suite) -> None:
    for attempt in range(3):
        conn = await s.connect()
        await s.round_trip(conn, [np.full(10, attempt, np.int16)], attempt=attempt)
        conn.close()


@_check
async def blocking_connection(s: _Suite) -> None:
    """The transport's blocking connection (``connect_blocking``), where it has one, against
    the same listener: frames both ways (empty, small, 1 MiB), in order with many in flight,
    intact with an allocator set; the listener closing it gives ``PeerGone``; after a local
    close (twice harmless) ``send`` raises ``ConnectionClosed``. Run on a thread, as a
    training script runs it, so the listener's event loop goes on serving."""
    await asyncio.to_thread(_blocking_side, s)


def _blocking_side(s: _Suite) -> None:
    conn = s.transport.connect_blocking(s.address, limits=s.limits, timeout=s.timeout)
    if conn is None:
        return
    try:
        conn.settimeout(s.timeout)  # a transport that never answers fails the check instead of hanging it
        cases: list[list[np.ndarray]] = [
            [],
            [np.arange(7, dtype=np.int64), np.ones((2, 3), np.float16)],
            [_payload(MiB, 5)],
        ]
        for i, arrays in enumerate(cases):
            _blocking_round_trip(conn, arrays, i=i)
        target = np.empty(4096, np.uint8)  # an allocator that offers a buffer: the body arrives intact
        conn.allocator = lambda msg_type, meta, nbytes: target.data if nbytes == target.nbytes else None
        _blocking_round_trip(conn, [_payload(4096, 9)], allocated=True)
        conn.allocator = None
        n = 50
        for i in range(n):
            run_sync(conn.send(MsgType.PULL, {"i": i}, [np.full(i % 5, i, np.int32)]))
        for i in range(n):
            frame = run_sync(conn.recv())
            assert frame.meta["i"] == i, f"blocking side: frame {frame.meta['i']} arrived in place of {i}"
            frame.release()
        run_sync(conn.send(MsgType.BYE, {"cmd": "close"}))
        try:
            run_sync(conn.recv())
        except PeerGone:
            pass
        else:
            raise AssertionError("blocking side: recv after the peer closed must raise PeerGone")
    finally:
        conn.close()
    conn.close()
    assert conn.is_closed, "blocking side: is_closed after close"
    try:
        run_sync(conn.send(MsgType.PULL, {}))
    except ConnectionClosed:
        return
    raise AssertionError("blocking side: send on a locally closed connection must raise ConnectionClosed")


def _blocking_round_trip(conn: BlockingConnection, arrays: list[np.ndarray], **meta: Any) -> None:
    run_sync(conn.send(MsgType.PUSH, meta, arrays))
    _check_echo(run_sync(conn.recv()), arrays, meta, side="blocking side: ")


def _check_echo(frame: Frame, arrays: list[np.ndarray], meta: dict[str, Any], side: str = "") -> None:
    """``frame`` is the echo of a PUSH of ``arrays`` with ``meta``, byte for byte; released."""
    assert frame.msg_type == MsgType.PUSH and _echoed_meta(frame) == meta, (side, frame.msg_type, frame.meta)
    assert len(frame.arrays) == len(arrays), f"{side}a segment went missing"
    for a, b in zip(arrays, frame.arrays):
        assert a.dtype == b.dtype and a.shape == b.shape, (side, a.dtype, a.shape, b.dtype, b.shape)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{side}payload corrupted"
    frame.release()


@_check
async def back_pressure(s: _Suite) -> None:
    conn = await s.connect()
    s.unclog = asyncio.get_running_loop().create_future()
    try:
        await conn.send(MsgType.HELLO, {"cmd": "clog"})
        blocked = await _send_until_blocked(conn, np.zeros(MiB, np.uint8))
        s.unclog.set_result(None)
        try:
            await asyncio.wait_for(blocked, s.timeout)
        except asyncio.TimeoutError:
            raise AssertionError("a send waiting on a clogged receiver must complete once it reads again") from None
        await s.round_trip(conn, [np.arange(5, dtype=np.int32)], cmd="unclogged")
    finally:
        if not s.unclog.done():
            s.unclog.set_result(None)
        conn.close()


async def _send_until_blocked(conn: Connection, chunk: np.ndarray) -> asyncio.Future[None]:
    """Send ``chunk`` until a send waits longer than CLOG_WAIT_S; return that send, still running."""
    accepted = 0
    while accepted < CLOG_LIMIT:
        sending = asyncio.ensure_future(conn.send(MsgType.PUSH, {}, [chunk]))
        done, _ = await asyncio.wait({sending}, timeout=CLOG_WAIT_S)
        if not done:
            return sending
        sending.result()
        accepted += chunk.nbytes
    raise AssertionError(
        f"send accepted {accepted // MiB} MiB for a receiver that reads nothing and never "
        "waited: the transport must bound what it buffers (back-pressure)"
    )


@_check
async def size_limits(s: _Suite) -> None:
    small = Limits(max_meta=4096, max_body=MiB)
    conn = await s.connect(small)
    for meta, arrays in (({}, [np.zeros(MiB + 4, np.uint8)]), ({"pad": "x" * 5000}, [])):
        await _raises(
            FrameTooLarge,
            conn.send(MsgType.PUSH, meta, arrays),
            s.timeout,
            "send beyond the sender's limits must raise FrameTooLarge",
        )
    await _still_in_sync(s, conn)
    conn.close()
    conn = await s.connect(small)  # a receiver with smaller limits than its peer's
    asked: list[int] = []

    def allocate(msg_type: int, meta: dict[str, Any], nbytes: int) -> None:
        asked.append(nbytes)

    conn.allocator = allocate
    await conn.send(MsgType.PULL, {"cmd": "send", "nbytes": 2 * MiB})
    exc = await _raises(
        FrameTooLarge, conn.recv(), s.timeout, "recv of a body beyond the receiver's limits must raise FrameTooLarge"
    )
    assert getattr(exc, "fatal", False), "FrameTooLarge from recv must be fatal"
    assert all(n <= small.max_body for n in asked), f"a body beyond the limits was allocated: {asked}"
    conn.close()


async def _still_in_sync(s: _Suite, conn: Connection) -> None:
    """After a refused send, no byte of it went out: a frame still round-trips, or the
    connection was closed; it never hangs on half a frame."""
    try:
        await s.round_trip(conn, [np.ones(3, np.float32)], after="refused")
    except (PeerGone, ConnectionClosed):
        pass
    except asyncio.TimeoutError:
        raise AssertionError("part of a frame refused with FrameTooLarge went out: the peer lost sync") from None


_REFUSED_TYPE = 77  # a frame type the suite's admit hook refuses


@_check
async def accept_hook_comes_first(s: _Suite) -> None:
    """A frame sent at once after connecting (in the first packet) already goes through the
    hooks ``on_accept`` installed: the listener must call it before parsing anything."""
    conn = await s.connect()
    s.admitted.clear()
    try:
        await conn.send(_REFUSED_TYPE, {"first": True}, [np.zeros(MiB, np.uint8)])  # may fail: refused mid-frame
        reply = await asyncio.wait_for(conn.recv(), s.timeout)
        reply.release()
        raise AssertionError("a frame the on_accept hook refuses was served: on_accept ran too late (or never)")
    except (PeerGone, ConnectionClosed):
        pass
    except asyncio.TimeoutError:
        raise AssertionError("the listener neither refused nor served a frame sent with the connect") from None
    finally:
        conn.close()
    # (a transport that carries bodies aside, as shm, may announce the body in a later header)
    assert [t for t, _ in s.admitted[:1]] == [_REFUSED_TYPE], f"on_accept did not see the first frame: {s.admitted[:3]}"


@_check
async def authentication(s: _Suite) -> None:
    """A server with a shared secret on this transport: missing, wrong and replayed proofs
    are refused before any state change; a learner that knows the secret trains."""
    from . import security
    from .client import Client
    from .config import ServerConfig
    from .layout import Layout
    from .server import ParameterServer

    secret = security.new_nonce().hex()
    layout = Layout.from_shapes([("w", (8,))])
    listen = s.transport.fresh_address()  # the suite's own listener holds s.url
    cfg = ServerConfig(listen=[listen], kernel="numpy", momentum=0.0, handshake_timeout=s.timeout)
    async with ParameterServer(cfg, secret=secret) as ps:
        url = ps.addresses[0]
        w0 = np.arange(8, dtype=np.float32)
        try:
            await Client.connect(url, layout, w0, secret=None, timeout=s.timeout)
            raise AssertionError("a learner without the secret was served")
        except RemoteError as exc:
            assert exc.code == "auth_required", exc.code
        recorded = await _handshake(s, url, secret.encode())  # an honest exchange, recorded
        for nonce, proof, why in ((recorded[0], recorded[1], "replayed"), (security.new_nonce(), bytes(32), "wrong")):
            conn = await s.transport.connect(url, limits=s.limits, timeout=s.timeout)
            try:
                await conn.send(MsgType.AUTH, {"nonce": nonce})
                (await asyncio.wait_for(conn.recv(), s.timeout)).release()
                await conn.send(MsgType.PROOF, {"proof": proof})
                reply = await asyncio.wait_for(conn.recv(), s.timeout)
                reply.release()
                assert reply.msg_type == MsgType.ERROR and reply.meta.get("code") == "auth_failed", (why, reply.meta)
            finally:
                conn.close()
        assert ps.core.store is None and not ps.core.learners, "a refused peer changed the server's state"
        client = await Client.connect(url, layout, w0, secret=secret, timeout=s.timeout)
        w = await client.pull()
        w = await client.push_pull(np.ones(8, np.float32), w.timestamp)
        assert w.timestamp == 1 and np.allclose(w.array, w0 - cfg.lr), "the authenticated learner was not served"
        await client.close()


async def _handshake(s: _Suite, url: str, secret: bytes) -> tuple[bytes, bytes]:
    """Authenticate by hand; returns the (client nonce, proof) sent."""
    from . import security

    conn = await s.transport.connect(url, limits=s.limits, timeout=s.timeout)
    try:
        nonce = security.new_nonce()
        await conn.send(MsgType.AUTH, {"nonce": nonce})
        challenge = await asyncio.wait_for(conn.recv(), s.timeout)
        challenge.release()
        assert challenge.msg_type == MsgType.CHALLENGE, challenge.meta
        proof = security.client_proof(secret, nonce, challenge.meta["nonce"])
        await conn.send(MsgType.PROOF, {"proof": proof})
        ok = await asyncio.wait_for(conn.recv(), s.timeout)
        ok.release()
        assert ok.msg_type == MsgType.AUTHENTICATED, ok.meta
        return nonce, proof
    finally:
        conn.close()


#: the body of each frame the victim sends, over and over, until it is killed
VICTIM_BYTES = 512 * MiB
_VICTIM = textwrap.dedent("""
    import asyncio, sys, numpy as np
    from rudra_async import transports
    from rudra_async.wire import MsgType
    async def main():
        conn = await transports.connect(sys.argv[1])
        await conn.send(MsgType.HELLO, {"cmd": "victim"})
        big = np.ones(int(sys.argv[2]), np.uint8)
        print("sending", flush=True)
        while True:
            await conn.send(MsgType.PUSH, {}, [big])
    asyncio.run(main())
""")


@_check
async def peer_killed_mid_frame(s: _Suite) -> None:
    if s.transport.in_process:
        return  # no second process can share an in-process transport
    s.victim_outcome = asyncio.get_running_loop().create_future()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _VICTIM,
        s.address,
        str(VICTIM_BYTES),
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), s.timeout)
        await asyncio.sleep(0.05)  # now inside the 512 MiB frame
        proc.send_signal(signal.SIGKILL)
        outcome = await asyncio.wait_for(s.victim_outcome, s.timeout)  # an error, not a hang
        assert isinstance(outcome, PeerGone), f"expected PeerGone, got {outcome!r}"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.communicate()  # reap it and close its pipe


async def check_transport(
    url: str,
    *,
    transport: Transport | None = None,
    limits: Limits = Limits(),
    large: tuple[int, ...] = (MiB, 64 * MiB, 257 * MiB),
    timeout: float = 60.0,
    only: tuple[str, ...] = (),
) -> list[str]:
    """Run every contract check (or those named in ``only``) against ``transport`` (by
    default the one registered for ``url``'s scheme), listening on ``url``."""
    transport = transport or transports.transport_for(url)
    suite = _Suite(url, transport, limits, large, timeout)
    listener = await transport.listen(url, suite.echo, limits=limits, on_accept=suite.accept)
    suite.address = listener.address
    ran = []
    try:
        for check in CHECKS:
            if only and check.__name__ not in only:
                continue
            await asyncio.wait_for(check(suite), timeout * 3)
            ran.append(check.__name__)
    finally:
        await listener.close()
    return ran

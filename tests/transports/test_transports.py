"""Every built-in and plugin transport passes the conformance suite; a broken one fails it."""

import sys

import pytest

from rudra_async.testing import CHECKS, check_transport
from rudra_async.transports.memory import MemoryConnection, MemoryTransport

TRANSPORTS = ["tcp://127.0.0.1:0", "tcp://[::1]:0", "memory://", "shm://", "ucx://127.0.0.1:0"]


@pytest.mark.parametrize("url", TRANSPORTS)
async def test_conformance(url):
    ran = await check_transport(url)
    assert ran == [c.__name__ for c in CHECKS]


class UnboundedConnection(MemoryConnection):
    """Deliberately broken: the inbox never fills, so send never waits."""

    _inbox_frames = _inbox_bytes = sys.maxsize


class UnboundedTransport(MemoryTransport):
    connection_type = UnboundedConnection


async def test_conformance_fails_on_a_transport_that_buffers_without_bound():
    with pytest.raises(AssertionError, match=r"send accepted 256 MiB .* never waited.*back-pressure"):
        await check_transport("memory://", transport=UnboundedTransport(), large=(1 << 20,))


async def test_a_frame_and_garbage_in_one_read_deliver_the_frame_then_the_error():
    """Over a real socket, both ends: a frame followed by bytes that are not framing, sent
    together, is received as that frame, then a fatal error, then PeerGone."""
    import asyncio
    import socket

    from rudra_async import errors, transports
    from rudra_async.transports.blocking import BlockingConnection
    from rudra_async.wire import HEADER_SIZE, Limits, MsgType, encode_frame

    data = b"".join(bytes(p) for p in encode_frame(MsgType.PULL, {"newer_than": 7})) + b"XXXX" + bytes(HEADER_SIZE)
    got: list = []
    done = asyncio.Event()

    async def handler(conn):
        got.append((await conn.recv()).meta["newer_than"])
        with pytest.raises(errors.BadMagic):
            await conn.recv()
        done.set()

    listener = await transports.listen("tcp://127.0.0.1:0", handler)
    try:
        port = int(listener.address.rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(data)
            await asyncio.wait_for(done.wait(), 10)
        assert got == [7]
    finally:
        await listener.close()

    here, there = socket.socketpair()
    conn = BlockingConnection(here, Limits(), "pair")
    try:
        there.sendall(data)
        assert (await conn.recv()).meta["newer_than"] == 7
        with pytest.raises(errors.BadMagic):
            await conn.recv()
        with pytest.raises(errors.PeerGone):
            await conn.recv()
    finally:
        conn.close()
        there.close()


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "shm://"])
@pytest.mark.parametrize("threshold", [0, 1], ids=["loop writes every frame", "threads write every body"])
async def test_conformance_whoever_writes_the_frames(url, threshold, send_threads):
    """The whole contract holds with every frame written by the event loop, and with every
    frame that has a body written by a sender thread (ordering, back-pressure, close and a
    peer killed mid-frame included)."""
    send_threads(threshold)
    ran = await check_transport(url, large=(1 << 20, 64 << 20))
    assert ran == [c.__name__ for c in CHECKS]
    assert bool(send_threads.calls) == bool(threshold)
    assert all(name.startswith("rudra-send") for name in send_threads.calls)


async def test_a_listener_subclass_may_use_any_attribute_name(monkeypatch):
    """The base listener's own state is name-mangled: a plugin's listener with attributes
    named like the base class's old private ones (``_accepted``, ``_conns``, ``_tasks``,
    ``_on_accept``) still accepts, serves and closes as the contract says."""
    from rudra_async.transports import memory

    class PluginListener(memory.MemoryListener):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._accepted, self._conns, self._tasks, self._on_accept = [], "mine", None, "also mine"

    monkeypatch.setattr(memory, "MemoryListener", PluginListener)
    ran = await check_transport(
        "memory://plugin-names",
        only=("small_frames", "concurrent_connections", "close_semantics", "accept_hook_comes_first"),
    )
    assert len(ran) == 4

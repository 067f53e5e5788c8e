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

"""Every built-in and plugin transport passes the conformance suite."""
import pytest

from rudra_async.testing import CHECKS, check_transport

TRANSPORTS = ["tcp://127.0.0.1:0", "tcp://[::1]:0", "memory://", "shm://", "ucx://127.0.0.1:0"]


@pytest.mark.parametrize("url", TRANSPORTS)
async def test_conformance(url):
    ran = await check_transport(url)
    assert ran == [c.__name__ for c in CHECKS]

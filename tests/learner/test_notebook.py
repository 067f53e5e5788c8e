"""Notebooks: a cell runs on the thread of a running event loop, the one an embedded server
uses. A blocking client made there hung 10 s and blamed the server; `train` could only be
reached through internal modules."""

import asyncio
import time

import pytest
from helpers import initial_weights, run_server, small_layout

import rudra_async
from rudra_async.client import SyncClient
from rudra_async.errors import ConfigError
from rudra_async.eventloop import serving_here


async def test_a_blocking_client_on_the_embedded_servers_loop_is_refused_at_once_and_works_off_it():
    layout = small_layout()
    async with run_server(kernel="numpy") as ps:
        started = time.monotonic()
        with pytest.raises(ConfigError, match="on another thread"):
            SyncClient(ps.addresses[0], layout, initial_weights(layout))
        assert time.monotonic() - started < 1  # not the 10 s hello timeout

        def learn() -> int:
            client = SyncClient(ps.addresses[0], layout, initial_weights(layout))
            try:
                w = client.pull()
                return client.push_pull(initial_weights(layout, seed=1), w.timestamp).timestamp
            finally:
                client.close()

        assert await asyncio.to_thread(learn) == 1  # from another thread, the same server answers
    assert not serving_here()  # the server closed: the loop serves nothing, nothing is refused


async def test_train_is_a_public_call_that_works_from_a_running_loop():
    """A notebook's cell runs inside a loop: the run gets a thread and a loop of its own."""
    with pytest.raises(ConfigError, match="learners"):
        rudra_async.train(learner=2)  # the nearest valid name is suggested
    out = rudra_async.train(learners=1, updates=40)
    assert out["updates"] == 40 and out["test_accuracy"] > 0.2 and out["stopped_by"] is None

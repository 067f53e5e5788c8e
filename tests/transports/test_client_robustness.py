"""The client under misuse and interruption: a request given up on, a gradient of the wrong
length or type. Each leaves the client usable, or clearly closed, and never half-applied."""

import asyncio
import contextlib

import numpy as np
import pytest
from helpers import initial_weights, run_server, server_thread, small_layout

from rudra_async.client import Client, ShardedClient, SyncClient
from rudra_async.errors import ConnectionClosed, RemoteError, RequestError
from rudra_async.layout import Shard

INTERRUPTED = r"connection closed: a {} request was interrupted \({}\) before its reply came; connect again"


async def test_a_request_given_up_on_closes_the_connection_and_leaves_the_weights_alone():
    """Its reply, sent later, would answer the next request: the client closes instead, and
    every later call says why (not 'reply out of order', not the old reply's weights)."""
    layout = small_layout()
    async with run_server(protocol="async", lr=0.1, momentum=0.0, kernel="numpy") as ps:
        client = await Client.connect(ps.addresses[0], layout, initial_weights(layout))
        other = await Client.connect(ps.addresses[0], layout)
        client.weights[:] = 7.0
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.pull(newer_than=0), 0.3)  # no update comes meanwhile
        await other.push(np.ones(layout.size, np.float32), 0)  # now the server answers the abandoned pull
        for _ in range(2):
            with pytest.raises(ConnectionClosed, match=INTERRUPTED.format("PULL", "CancelledError")):
                await client.pull()
        np.testing.assert_array_equal(client.weights, 7.0)  # no reply was read into the buffer
        await client.close()  # idempotent, no bye on a closed connection
        assert (await other.pull()).timestamp == 1 == ps.clock  # the server serves the others as before
        await other.close()


@pytest.mark.parametrize("listen", ["tcp://127.0.0.1:0", "shm://"])
@pytest.mark.parametrize("where", ["send", "recv"])
def test_a_blocking_request_interrupted_closes_the_connection(monkeypatch, listen, where):
    """Ctrl-C just after the request went out, or while its reply is awaited: the reply stays
    unread, so the connection is closed and the next call raises ConnectionClosed."""
    layout = small_layout()
    with server_thread(listen=[listen], protocol="async", lr=0.1, momentum=0.0, kernel="numpy") as ps:
        client = SyncClient(ps.addresses[0], layout, initial_weights(layout))
        conn = client._client.conn
        original = getattr(conn, where)

        async def interrupted(*args):
            monkeypatch.setattr(conn, where, original)  # once
            if where == "send":
                await original(*args)
            raise KeyboardInterrupt

        monkeypatch.setattr(conn, where, interrupted)
        with pytest.raises(KeyboardInterrupt):
            client.push_pull(np.ones(layout.size, np.float32), 0)
        with pytest.raises(ConnectionClosed, match=INTERRUPTED.format("PUSH", "KeyboardInterrupt")):
            client.pull()
        assert conn.is_closed
        client.close()


@pytest.mark.parametrize("values", [small_layout().size + 5, small_layout().size - 1])
async def test_a_shard_group_refuses_a_gradient_of_the_wrong_length_before_any_shard_applies_it(values):
    """One server refuses it (bad_shape); so does a group, locally, so that no shard applies
    its part of a gradient that is cut or padded."""
    layout = small_layout()
    w0 = initial_weights(layout)
    grad = np.ones(values, np.float32)
    async with contextlib.AsyncExitStack() as stack:
        single = await stack.enter_async_context(run_server(protocol="async", kernel="numpy"))
        shards = [await stack.enter_async_context(run_server(protocol="async", shard=Shard(i, 2))) for i in range(2)]
        one = await Client.connect(single.addresses[0], layout, w0)
        with pytest.raises(RemoteError) as remote:
            await one.push(grad, 0)
        group = await ShardedClient.connect([ps.addresses[0] for ps in shards], layout, w0)
        with pytest.raises(RequestError, match=rf"must have {layout.size} values .*, got {values}") as local:
            await group.push(grad, (0, 0))
        with pytest.raises(RequestError):
            await group.push_pull([grad[:3], grad[3:]], (0, 0))
        assert local.value.code == remote.value.code == "bad_shape"
        assert [ps.clock for ps in shards] == [0, 0]
        np.testing.assert_array_equal((await group.pull()).array, w0)
        assert (await group.push(np.zeros(layout.size, np.float32), (0, 0))).status == "applied"  # still usable
        await one.close()
        await group.close()


def _torch_tensor(size):
    import torch

    return torch.ones(size)


@pytest.mark.parametrize(
    "make, named",
    [
        (lambda n: [0.5] * n, "a list holding a float"),
        (lambda n: (np.ones(2, np.float32), 0.5), "a tuple holding a float"),
        (lambda n: 0.5, "a float"),
        pytest.param(_torch_tensor, "a Tensor", marks=pytest.mark.torch),
    ],
)
def test_a_gradient_that_is_not_numpy_arrays_is_a_clear_error(make, named):
    layout = small_layout()
    with (
        server_thread(protocol="async", lr=0.1, momentum=0.0, kernel="numpy") as ps,
        SyncClient(ps.addresses[0], layout, initial_weights(layout)) as client,
    ):
        with pytest.raises(RequestError, match=f"must be a numpy array or a sequence of numpy arrays, got {named}$"):
            client.push(make(layout.size), 0)
        assert client.push(np.zeros(layout.size, np.float32), 0).status == "applied"  # still usable


def test_push_arguments_of_numpy_integer_types_are_sent_and_others_refused():
    """``samples=np.int64(8)`` (what ``len`` of a numpy batch may give) is a whole number:
    sent as one; a fractional count is refused before anything is sent."""
    layout = small_layout()
    with (
        server_thread(protocol="async", lr=0.1, momentum=0.0, kernel="numpy") as ps,
        SyncClient(ps.addresses[0], layout, initial_weights(layout)) as client,
    ):
        grad = np.zeros(layout.size, np.float32)
        ack = client.push(grad, np.int64(0), step=np.int32(1), samples=np.int64(8), loss=np.float32(0.5))
        assert ack.status == "applied" and ps.core.samples == 8
        with pytest.raises(RequestError, match="bad push argument"):
            client.push(grad, 1, samples=8.5)
        assert client.push(grad, 1, samples=8).status == "applied"  # still usable


async def test_clock_arguments_of_numpy_integer_types_go_to_one_server_and_a_shard_group():
    """A timestamp or ``newer_than`` may be any whole number, for one server and for a group
    (one for every shard, or one per shard); anything else is RequestError bad_request."""
    layout = small_layout()
    w0, grad = initial_weights(layout), np.zeros(layout.size, np.float32)
    async with contextlib.AsyncExitStack() as stack:
        single = await stack.enter_async_context(run_server(protocol="async", kernel="numpy"))
        shards = [await stack.enter_async_context(run_server(protocol="async", shard=Shard(i, 2))) for i in range(2)]
        one = await Client.connect(single.addresses[0], layout, w0)
        group = await ShardedClient.connect([ps.addresses[0] for ps in shards], layout, w0)
        for client in (one, group):
            assert (await client.push(grad, np.int64(0))).status == "applied"
            assert (await client.pull(newer_than=np.int64(0))).array.size == layout.size
            for bad in (0.5, "1", (0, 0, 0)):
                with pytest.raises(RequestError) as refused:
                    await client.pull(newer_than=bad)
                assert refused.value.code == "bad_request"
        assert (await group.push(grad, (np.int32(1), 1))).status == "applied"
        assert (await group.push(grad, np.array([2, 2]))).status == "applied"  # one per shard, as an array
        await one.close()
        await group.close()

"""Embed the parameter server in an asyncio application.

The application owns the event loop: it starts a ParameterServer with its own initial
weights, lets three numpy learners (in-process tasks here; they could be anywhere on the
network) fit a linear least-squares model through it, reads the statistics, and stops it.

    python examples/embed_server.py
"""

import asyncio

import numpy as np

from rudra_async import Client, ParameterServer, ServerConfig
from rudra_async.eventloop import run
from rudra_async.layout import Layout

rng = np.random.default_rng(0)
TRUE_W = rng.standard_normal(8).astype(np.float32)
X = rng.standard_normal((2048, 8)).astype(np.float32)
Y = X @ TRUE_W


async def numpy_learner(url: str, layout: Layout, steps: int, seed: int) -> None:
    client = await Client.connect(url, layout, name=f"numpy-{seed}")
    local = np.random.default_rng(seed)
    w = await client.pull()
    for step in range(steps):
        idx = local.integers(0, len(X), 32)
        residual = X[idx] @ w.array - Y[idx]
        grad = (2 / len(idx)) * X[idx].T @ residual
        w = await client.push_pull(grad.astype(np.float32), w.timestamp, step)
    await client.close()


async def main() -> None:
    config = ServerConfig(listen=["tcp://127.0.0.1:0"], lr=0.05, momentum=0.5)
    async with ParameterServer(config, initial={"w": np.zeros(8, np.float32)}) as server:
        serving = asyncio.create_task(server.serve())
        layout = Layout.from_shapes([("w", (8,))])
        url = server.addresses[0]
        await asyncio.gather(*(numpy_learner(url, layout, 200, seed) for seed in range(3)))
        stats = server.stats()
        error = float(np.abs(server.weights()["w"] - TRUE_W).max())
        print(f"updates {stats['updates']}  mean staleness {stats['staleness_mean']:.2f}  max |w - w*| {error:.2e}")
        await server.close()
        await serving


if __name__ == "__main__":
    run(main())

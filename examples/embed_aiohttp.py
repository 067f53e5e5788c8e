"""Embed the parameter server in an aiohttp application, with its metrics and status page
on the application's own routes.

The application owns the event loop: the server starts and stops with the application
(a cleanup context) inside the loop aiohttp already runs, and nothing here touches the
loop or its policy. Routes:

- ``/ps/``: the status page (it polls ``status.json`` relative to itself, so any prefix works);
- ``/ps/status.json``: the snapshot the page and ``rudra-async status http://HOST:PORT/ps/`` read;
- ``/metrics``: Prometheus metrics of the server;
- ``/weights``: the application's own route, the current weights as JSON.

    pip install 'rudra-async[monitor,web]'
    python examples/embed_aiohttp.py --port 8080     # serve until Ctrl-C; learners connect to the printed address
    python examples/embed_aiohttp.py --demo          # three numpy learners train, the routes are read, and it exits
"""

import argparse
import asyncio
import json
from collections.abc import AsyncIterator

import numpy as np
from aiohttp import ClientSession, web

from rudra_async import Client, ParameterServer, ServerConfig
from rudra_async.layout import Layout
from rudra_async.monitor import Monitor

SERVER = web.AppKey("server", ParameterServer)
MONITOR = web.AppKey("monitor", Monitor)
W0 = {"w": np.zeros(8, np.float32)}


def make_app(config: ServerConfig) -> web.Application:
    """An aiohttp application that runs a parameter server while it runs."""

    async def parameter_server(app: web.Application) -> AsyncIterator[None]:
        async with ParameterServer(config, initial=W0) as server, Monitor(server) as monitor:
            app[SERVER], app[MONITOR] = server, monitor
            yield  # the application runs; the server serves on the same loop
        # leaving the block closed both (and wrote the final checkpoint, if configured)

    async def metrics(request: web.Request) -> web.Response:
        monitor = request.app[MONITOR]
        return web.Response(body=monitor.metrics(), headers={"Content-Type": monitor.content_type})

    async def page(request: web.Request) -> web.Response:
        return web.Response(text=request.app[MONITOR].page(), content_type="text/html")

    async def status(request: web.Request) -> web.Response:
        return web.json_response(request.app[MONITOR].status())

    async def weights(request: web.Request) -> web.Response:
        server = request.app[SERVER]
        return web.json_response({"clock": server.clock, **{k: v.tolist() for k, v in server.weights().items()}})

    async def to_page(request: web.Request) -> web.Response:
        raise web.HTTPFound("/ps/")

    app = web.Application()
    app.cleanup_ctx.append(parameter_server)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/ps", to_page)
    app.router.add_get("/ps/", page)
    app.router.add_get("/ps/status.json", status)
    app.router.add_get("/weights", weights)
    return app


async def numpy_learner(url: str, steps: int, seed: int) -> None:
    """Fits w in y = X·w by least squares through the server."""
    rng = np.random.default_rng(seed)
    true_w = np.arange(8, dtype=np.float32) / 8
    client = await Client.connect(url, Layout.from_shapes([("w", (8,))]), name=f"numpy-{seed}")
    w = await client.pull()
    for step in range(steps):
        x = rng.standard_normal((32, 8)).astype(np.float32)
        grad = (2 / len(x)) * x.T @ (x @ w.array - x @ true_w)
        w = await client.push_pull(grad.astype(np.float32), w.timestamp, step, samples=len(x))
    await client.close()


async def demo(port: int = 0) -> dict:
    """Run the application on ``port`` (0: any), let three learners train, read its routes."""
    runner = web.AppRunner(make_app(ServerConfig(listen=["tcp://127.0.0.1:0"], lr=0.05, momentum=0.5)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        server = runner.app[SERVER]
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await asyncio.gather(*(numpy_learner(server.addresses[0], 200, seed) for seed in range(3)))
        async with ClientSession() as http:
            metrics = await (await http.get(base + "/metrics")).text()
            page = await (await http.get(base + "/ps")).text()  # redirected to /ps/
            status = await (await http.get(base + "/ps/status.json")).json()
            weights = await (await http.get(base + "/weights")).json()
    finally:
        await runner.cleanup()
    return {"base": base, "metrics": metrics, "page": page, "status": status, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument(
        "--demo", action="store_true", help="train three numpy learners, print the routes' figures, exit"
    )
    args = parser.parse_args()
    if args.demo:
        out = asyncio.run(demo())
        status = out["status"]
        print(
            f"clock {status['clock']}  learners {len(status['learners'])}  mean staleness {status['staleness_mean']:.2f}"
        )
        print(json.dumps(out["weights"]))
        return
    config = ServerConfig(listen=["tcp://127.0.0.1:7000"], lr=0.05, momentum=0.5)
    print(f"parameter server on {config.listen[0]}; status page http://127.0.0.1:{args.port}/ps/")
    web.run_app(make_app(config), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()

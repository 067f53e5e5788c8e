"""What watching a server costs: updates/s with --metrics on vs off, in one run.

Two server processes run side by side, one with ``--metrics`` and one without. Rounds
come in pairs, one on each server, in alternating order (off-on, on-off, ...): in each,
LEARNERS asynchronous numpy learners (in this process) push gradients of SIZE parameters
as fast as the server answers for SECONDS, while the server with metrics is scraped once a
second at ``/metrics`` (a Prometheus at a 1 s interval; 15 to 60 s is usual) and at
``/status.json`` (the status page open in a browser). The sampler of the monitored server
runs throughout. The ratio is the median of the pairs' ratios, so that load from outside
that changes slowly cancels out.

Then, in this process, the time one scrape of both takes on the server's event loop (the
cost the rounds measure, without the noise): a server with LEARNERS learners that pushed
gradients, ``monitor.metrics()`` and ``json.dumps(monitor.status())`` timed together.

With ``--hammer N``, N clients fetch both pages without pause instead (clients gone wrong,
or many dashboards): what answers reused for ``RENDER_EVERY_S`` save.

    python benchmarks/metrics_cost.py [--size 100000] [--learners 4] [--seconds 2] [--rounds 15] [--hammer N]

Prints the median updates/s of each, the ratio on/off (the target is >= 0.97), the time
of one scrape, and one JSON line with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from loopback import free_port, wait_listening  # benchmarks/loopback.py (the script's directory is on sys.path)

from rudra_async.client import connect
from rudra_async.eventloop import run
from rudra_async.layout import Layout


def start_server(port: int, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "rudra_async", "--log-level", "WARNING", "server", "--kernel", "numpy"]
    proc = subprocess.Popen(
        [*command, "--listen", f"tcp://127.0.0.1:{port}", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.DEVNULL,  # its final statistics
    )
    wait_listening(port, 30)
    return proc


async def http_get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data


async def learner(url: str, layout: Layout, initial: np.ndarray, until: float, seed: int) -> int:
    client = await connect(url, layout, initial)
    grad = (1e-6 * np.random.default_rng(seed).standard_normal(layout.size)).astype(np.float32)
    w = await client.pull()
    pushes = 0
    while time.monotonic() < until:
        w = await client.push_pull(grad, w.timestamp, pushes)
        pushes += 1
    await client.close()
    return pushes


async def scrape(port: int, until: float, pause: float = 1.0) -> int:
    """Fetch /metrics and /status.json together every ``pause`` seconds (0: as fast as the
    server answers) until ``until``; the number of fetches."""
    scrapes = 0
    while time.monotonic() < until:
        await asyncio.gather(http_get(port, "/metrics"), http_get(port, "/status.json"))
        scrapes += 1
        await asyncio.sleep(pause)
    return scrapes


async def one_round(
    url: str, metrics_port: int | None, args: argparse.Namespace, layout: Layout
) -> tuple[float, float]:
    """(updates/s, fetches of both pages per second) of one round."""
    initial = np.zeros(layout.size, np.float32)
    started = time.monotonic()
    until = started + args.seconds
    scraper = None
    if metrics_port:
        pause = 0.0 if args.hammer else 1.0
        scraper = asyncio.gather(*(scrape(metrics_port, until, pause) for _ in range(args.hammer or 1)))
    pushes = await asyncio.gather(*(learner(url, layout, initial, until, i) for i in range(args.learners)))
    elapsed = time.monotonic() - started
    scrapes = sum(await scraper) if scraper is not None else 0
    return sum(pushes) / elapsed, scrapes / elapsed  # async: one update per gradient


async def main(args: argparse.Namespace) -> dict[str, float]:
    layout = Layout.from_shapes([("w", (args.size,))])
    off_port, on_port, metrics_port = free_port(), free_port(), free_port()
    servers = [start_server(off_port), start_server(on_port, "--metrics", f"127.0.0.1:{metrics_port}")]
    try:
        off_url, on_url = f"tcp://127.0.0.1:{off_port}", f"tcp://127.0.0.1:{on_port}"
        await one_round(off_url, None, argparse.Namespace(**{**vars(args), "seconds": 1.0}), layout)  # warm-up
        await one_round(on_url, metrics_port, argparse.Namespace(**{**vars(args), "seconds": 1.0}), layout)
        off, on, fetches = [], [], []
        for r in range(args.rounds):
            for which in ("on", "off") if r % 2 else ("off", "on"):
                if which == "on":
                    rate, fetched = await one_round(on_url, metrics_port, args, layout)
                    on.append(rate)
                    fetches.append(fetched)
                else:
                    off.append((await one_round(off_url, None, args, layout))[0])
            print(
                f"pair {r + 1}: off {off[-1]:8.0f} updates/s   on {on[-1]:8.0f} updates/s"
                f"   ({fetches[-1]:.0f} fetches of both pages/s)",
                flush=True,
            )
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
    return {
        "size": args.size,
        "learners": args.learners,
        "off_updates_per_s": statistics.median(off),
        "on_updates_per_s": statistics.median(on),
        "ratio": statistics.median(b / a for a, b in zip(off, on)),
        "fetches_per_s": statistics.median(fetches),
        "scrape_ms": await scrape_cost(args, layout),
    }


async def scrape_cost(args: argparse.Namespace, layout: Layout) -> float:
    """Median milliseconds of one /metrics and one /status.json answer, on the loop."""
    from rudra_async.config import ServerConfig
    from rudra_async.monitor import Monitor
    from rudra_async.server import ParameterServer

    config = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy")
    async with ParameterServer(config, initial={"w": np.zeros(args.size, np.float32)}) as ps, Monitor(ps) as monitor:
        until = time.monotonic() + 2.0
        initial = np.zeros(layout.size, np.float32)
        await asyncio.gather(*(learner(ps.addresses[0], layout, initial, until, i) for i in range(args.learners)))
        times = []
        for _ in range(50):
            started = time.perf_counter()
            monitor.metrics()
            json.dumps(monitor.status())
            times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=100_000, help="parameters (float32)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each round")
    parser.add_argument("--rounds", type=int, default=15, help="pairs of rounds")
    parser.add_argument(
        "--hammer", type=int, default=0, help="instead of one scrape a second, this many clients fetching without pause"
    )
    out = run(main(parser.parse_args()))
    print(
        f"metrics off {out['off_updates_per_s']:.0f} updates/s, on {out['on_updates_per_s']:.0f} updates/s "
        f"(medians); ratio on/off {out['ratio']:.3f} (median of the pairs; target >= 0.97)\n"
        f"one scrape of /metrics and /status.json: {out['scrape_ms']:.2f} ms of the server's loop "
        f"({out['scrape_ms'] / 10:.2f} % of its time at one scrape a second)"
    )
    print(json.dumps(out))

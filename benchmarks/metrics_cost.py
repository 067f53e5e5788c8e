"""What watching a server costs: updates/s with --metrics on vs off, in one run.

Two server processes run side by side, one with ``--metrics`` and one without. Rounds
alternate between them (off, on, off, on, ...): in each, LEARNERS asynchronous numpy
learners (in this process) push gradients of SIZE parameters as fast as the server
answers for SECONDS, while the server with metrics is scraped once a second at
``/metrics`` (a Prometheus at a 1 s interval, 15 to 60 s is usual) and at
``/status.json`` (the status page open in a browser). The sampler of the monitored server
runs throughout.

    python benchmarks/metrics_cost.py [--size 100000] [--learners 4] [--seconds 3] [--rounds 5]

Prints the median updates/s of each and the ratio on/off (the target is >= 0.97), and one
JSON line with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from rudra_async.client import connect
from rudra_async.eventloop import run
from rudra_async.layout import Layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, *args: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "rudra_async", "--log-level", "WARNING", "server", "--kernel", "numpy"]
    proc = subprocess.Popen(
        [*command, "--listen", f"tcp://127.0.0.1:{port}", *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stderr=subprocess.DEVNULL,  # its final statistics
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


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


async def scrape(port: int, until: float) -> int:
    scrapes = 0
    while time.monotonic() < until:
        await asyncio.gather(http_get(port, "/metrics"), http_get(port, "/status.json"))
        scrapes += 1
        await asyncio.sleep(1.0)
    return scrapes


async def one_round(url: str, metrics_port: int | None, args: argparse.Namespace, layout: Layout) -> float:
    initial = np.zeros(layout.size, np.float32)
    started = time.monotonic()
    until = started + args.seconds
    scraper = asyncio.ensure_future(scrape(metrics_port, until)) if metrics_port else None
    pushes = await asyncio.gather(*(learner(url, layout, initial, until, i) for i in range(args.learners)))
    elapsed = time.monotonic() - started
    if scraper is not None:
        await scraper
    return sum(pushes) / elapsed  # async: one update per gradient


async def main(args: argparse.Namespace) -> dict[str, float]:
    layout = Layout.from_shapes([("w", (args.size,))])
    off_port, on_port, metrics_port = free_port(), free_port(), free_port()
    servers = [start_server(off_port), start_server(on_port, "--metrics", f"127.0.0.1:{metrics_port}")]
    try:
        off_url, on_url = f"tcp://127.0.0.1:{off_port}", f"tcp://127.0.0.1:{on_port}"
        await one_round(off_url, None, argparse.Namespace(**{**vars(args), "seconds": 1.0}), layout)  # warm-up
        await one_round(on_url, metrics_port, argparse.Namespace(**{**vars(args), "seconds": 1.0}), layout)
        off, on = [], []
        for r in range(args.rounds):
            off.append(await one_round(off_url, None, args, layout))
            on.append(await one_round(on_url, metrics_port, args, layout))
            print(f"round {r + 1}: off {off[-1]:8.0f} updates/s   on {on[-1]:8.0f} updates/s", flush=True)
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(10)
    result = {
        "size": args.size,
        "learners": args.learners,
        "off_updates_per_s": statistics.median(off),
        "on_updates_per_s": statistics.median(on),
    }
    result["ratio"] = result["on_updates_per_s"] / result["off_updates_per_s"]
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=100_000, help="parameters (float32)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each round")
    parser.add_argument("--rounds", type=int, default=5)
    out = run(main(parser.parse_args()))
    print(
        f"metrics off {out['off_updates_per_s']:.0f} updates/s, on {out['on_updates_per_s']:.0f} updates/s "
        f"(median of the rounds): ratio on/off {out['ratio']:.3f} (target >= 0.97)"
    )
    print(json.dumps(out))

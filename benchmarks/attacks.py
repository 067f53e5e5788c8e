"""The attacks of the issue "what an attacker and a cluster user hit", measured again on a
real server (in this process) with learners and attackers in other processes:

1. a hardsync run of two learners (numpy, small model) and a client that pulls every 1 s or
   0.5 s but never pushes: updates/s and evictions with ``--learner-timeout 2``, and with the
   client saying it only reads (HELLO ``reader``) and no timeout; the clean run beside them;
2. a flood of idle connections (``--flooders`` processes, each opening and dropping
   connections as fast as it can) while LEARNERS learners join one after another over a secret (the
   learner's SyncClient with ``wait``): joins that failed, and join times.

    python benchmarks/attacks.py [--seconds 6] [--learners 22] [--flooders 2]

Prints one line per figure (medians where there are several).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from rudra_async.client import SyncClient
from rudra_async.config import ServerConfig
from rudra_async.eventloop import run
from rudra_async.layout import Layout
from rudra_async.server import ParameterServer

LAYOUT = Layout.from_shapes([("w", (256,)), ("b", (16,))])
SECRET = b"4f9c2b7e1a8d3c6f0e5b9a2d7c4f1e8b"


def honest(url: str, seconds: float) -> None:
    """A learner pushing small gradients for ``seconds`` (its own process)."""
    client = SyncClient(url, LAYOUT, np.zeros(LAYOUT.size, np.float32), wait=10)
    deadline = time.monotonic() + seconds
    w = client.pull()
    while time.monotonic() < deadline and not w.stop:
        w = client.push_pull(np.full(LAYOUT.size, 1e-3, np.float32), w.timestamp)
    client.close()


def pulling(url: str, seconds: float, every: float, reader: bool) -> None:
    """A client that pulls every ``every`` seconds and never pushes."""
    client = SyncClient(url, LAYOUT, wait=10, reader=reader)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        client.pull()
        time.sleep(every)
    client.close()


def flood(port: int, seconds: float, counter: Any) -> None:
    """Open connections 50 at a time and leave them idle (the newest 500 held), as fast as it can."""

    async def main() -> None:
        deadline = time.monotonic() + seconds
        held: list[asyncio.StreamWriter] = []
        while time.monotonic() < deadline:
            opened = await asyncio.gather(
                *(asyncio.open_connection("127.0.0.1", port) for _ in range(50)), return_exceptions=True
            )
            writers = [w for r in opened if isinstance(r, tuple) for w in r[1:]]
            held.extend(writers)
            with counter.get_lock():
                counter.value += len(writers)
            if len(held) > 500:
                for w in held[:250]:
                    w.close()
                del held[:250]
        for w in held:
            w.close()

    asyncio.run(main())


async def pulled_round(seconds: float, every: float | None, reader: bool, timeout: float | None) -> tuple[float, int]:
    cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy", protocol="hardsync", learner_timeout=timeout)
    async with ParameterServer(cfg) as ps:
        url = ps.addresses[0]
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=honest, args=(url, seconds + 4)) for _ in range(2)]
        for p in procs:
            p.start()
        while sum(info.connected for info in ps.core.learners.values()) < 2:  # the model exists
            await asyncio.sleep(0.05)
        if every is not None:
            procs.append(ctx.Process(target=pulling, args=(url, seconds + 2, every, reader)))
            procs[-1].start()
            while sum(info.connected for info in ps.core.learners.values()) < 3:
                await asyncio.sleep(0.05)
        start_clock, started = ps.clock, time.monotonic()
        await asyncio.sleep(seconds)
        rate = (ps.clock - start_clock) / (time.monotonic() - started)
        evictions = ps.stats()["evictions"]
        ps.core.stop_at(ps.clock + 1)
        for p in procs:
            await asyncio.to_thread(p.join, 20)
            if p.is_alive():
                p.kill()
        return rate, evictions


def join_once(url: str, out: Any) -> None:
    started = time.monotonic()
    try:
        client = SyncClient(url, LAYOUT, np.zeros(LAYOUT.size, np.float32), secret=SECRET, wait=30)
        client.close()
        out.put(time.monotonic() - started)
    except Exception as exc:
        out.put(f"{type(exc).__name__}: {exc}")


async def flooded_joins(
    learners: int, seconds: float, flooders: int
) -> tuple[list[float], list[str], int, dict[str, int]]:
    cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], kernel="numpy")
    async with ParameterServer(cfg, secret=SECRET) as ps:
        url = ps.addresses[0]
        port = int(url.rsplit(":", 1)[1])
        ctx = mp.get_context("spawn")
        counter = ctx.Value("i", 0)
        procs = [ctx.Process(target=flood, args=(port, seconds + 60, counter)) for _ in range(flooders)]
        for p in procs:
            p.start()
        await asyncio.sleep(1.0)
        out: Any = ctx.Queue()
        times, failures = [], []
        flood_started, connections_before = time.monotonic(), counter.value
        for _ in range(learners):
            p = ctx.Process(target=join_once, args=(url, out))
            p.start()
            result = await asyncio.to_thread(out.get, True, 60)
            await asyncio.to_thread(p.join, 10)
            (times if isinstance(result, float) else failures).append(result)
        rate = int((counter.value - connections_before) / (time.monotonic() - flood_started))
        for p in procs:
            p.kill()
            p.join()
        return times, failures, rate, dict(ps.core.rejected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--learners", type=int, default=22)
    parser.add_argument("--flooders", type=int, default=2)
    args = parser.parse_args()
    for label, every, reader, timeout in [
        ("clean hardsync, 2 learners", None, False, None),
        ("+ a client pulling every 1 s, --learner-timeout 2", 1.0, False, 2.0),
        ("+ a client pulling every 0.5 s, --learner-timeout 2", 0.5, False, 2.0),
        ("+ a reader pulling every 0.5 s, no timeout", 0.5, True, None),
    ]:
        rate, evictions = run(pulled_round(args.seconds, every, reader, timeout))
        print(f"(1) {label}: {rate:.0f} updates/s, {evictions} evictions", flush=True)
    times, failures, rate, rejected = run(flooded_joins(args.learners, args.seconds, args.flooders))
    print(
        f"(3) {args.learners} learner joins under a flood of ~{rate} idle connections/s: {len(failures)} failed; "
        f"join time median {statistics.median(times) if times else float('nan'):.2f} s, "
        f"max {max(times, default=float('nan')):.2f} s; refused: {rejected}"
    )
    for failure in failures[:3]:
        print("    failed:", failure)


if __name__ == "__main__":
    main()

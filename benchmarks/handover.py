"""Where updates should leave the event loop: λ learners push+pull a model of N values
against a server that updates it on the loop, then against one that hands the check and
the update to its background threads, in one run.

    python benchmarks/handover.py [--values 1000000,4000000] [--learners 4] [--seconds 6]

Prints each server's updates/s (all learners together, no compute between round trips,
median of ``--reps`` launches) and the ratio inline ÷ background; ``store.BACKGROUND_MIN_VALUES``
should sit where the ratio crosses 1.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time

import numpy as np

from rudra_async.client import SyncClient
from rudra_async.config import ServerConfig
from rudra_async.eventloop import run
from rudra_async.layout import Layout
from rudra_async.server import ParameterServer, store


def _serve(values: int, url: str, background: bool, address_q) -> None:
    store.BACKGROUND_MIN_VALUES = 1 if background else values + 1  # this process only

    async def main() -> None:
        cfg = ServerConfig(listen=[url], lr=1e-6, momentum=0.9)
        async with ParameterServer(cfg, initial={"w": np.zeros(values, np.float32)}) as ps:
            address_q.put(ps.addresses[0])
            await asyncio.sleep(3600)  # until killed

    run(main())


def _learn(address: str, values: int, seconds: float, rate_q) -> None:
    client = SyncClient(address, Layout.from_shapes([("w", (values,))]))
    grad = np.full(values, 1e-3, np.float32)
    w = client.pull()
    for _ in range(3):  # warm-up
        w = client.push_pull(grad, w.timestamp)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        w = client.push_pull(grad, w.timestamp)
        n += 1
    rate_q.put(n / (time.perf_counter() - start))
    client.close()


def updates_per_s(values: int, url: str, background: bool, learners: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    address_q, rate_q = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_serve, args=(values, url, background, address_q), daemon=True)
    server.start()
    try:
        address = address_q.get(timeout=60)
        procs = [ctx.Process(target=_learn, args=(address, values, seconds, rate_q)) for _ in range(learners)]
        for p in procs:
            p.start()
        total = sum(rate_q.get(timeout=60 + 2 * seconds) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        return total
    finally:
        server.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", default="1000000,4000000", help="comma-separated model sizes")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--urls", default="tcp://127.0.0.1:0,shm://")
    args = ap.parse_args()
    print(f"{args.learners} learners, push+pull without compute, {args.seconds:g} s per launch, median of {args.reps}")
    for values in (int(v) for v in args.values.split(",")):
        for url in args.urls.split(","):
            rates: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.reps):  # alternate, so drift on a shared machine hits both
                for background in (False, True):
                    rates[background].append(updates_per_s(values, url, background, args.learners, args.seconds))
            inline, off = statistics.median(rates[False]), statistics.median(rates[True])
            print(
                f"  {values:>10,} values {url.partition(':')[0]:3}: inline {inline:7.0f}/s   "
                f"background {off:7.0f}/s   ratio inline/background {inline / off:.2f}x"
            )


if __name__ == "__main__":
    main()

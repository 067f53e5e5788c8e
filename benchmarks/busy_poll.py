"""A small push+pull with each busy-poll window, against polling off, in one run.

One server process per window (``RUDRA_ASYNC_BUSY_POLL_US`` set in it) over ``tcp://`` and
``shm://``; one ``SyncClient`` per server in this process, its window set with
``polling.set_window``. Rounds alternate between the windows (so a shared host's drift
spreads over all of them); each round times ``--per`` push+pulls after 50 unmeasured ones.
Prints, per transport and window, the median of the round medians (min-max of the rounds),
the ratio to the first window (polling off by default), and the CPU each side spent per
round trip (the client's ``process_time``; the server's utime+stime from /proc).

    python benchmarks/busy_poll.py [--floats 1000] [--windows 0,100,300] [--rounds 8] [--per 500]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import numpy as np
from timing import cpu_seconds  # benchmarks/timing.py (the script's directory is on sys.path)


def _serve(url: str, floats: int, window_us: float, q, stop) -> None:
    os.environ["RUDRA_ASYNC_BUSY_POLL_US"] = str(window_us)  # before rudra_async reads it
    from rudra_async.config import ServerConfig
    from rudra_async.eventloop import run
    from rudra_async.server import ParameterServer

    async def main() -> None:
        cfg = ServerConfig(listen=[url], lr=1e-6, momentum=0.9)
        async with ParameterServer(cfg, initial={"w": np.zeros(floats, np.float32)}) as ps:
            q.put((window_us, ps.addresses[0]))
            while not stop.is_set():
                await asyncio.sleep(0.05)

    run(main())


def measure(scheme: str, floats: int, windows: list[float], rounds: int, per: int) -> dict[float, dict]:
    from rudra_async.client import SyncClient
    from rudra_async.layout import Layout
    from rudra_async.transports import polling

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    procs = {}
    for i, w in enumerate(windows):
        url = "tcp://127.0.0.1:0" if scheme == "tcp" else f"shm://busy-poll-{os.getpid()}-{i}"
        procs[w] = ctx.Process(target=_serve, args=(url, floats, w, q, stop), daemon=True)
        procs[w].start()
    try:
        urls = dict(q.get(timeout=60) for _ in windows)
        layout = Layout.from_shapes([("w", (floats,))])
        clients = {w: SyncClient(urls[w], layout) for w in windows}
        stamps = {w: clients[w].pull().timestamp for w in windows}
        grad = np.full(floats, 1e-3, np.float32)
        result = {w: {"medians": [], "client_cpu": 0.0, "server_cpu": 0.0} for w in windows}
        for _ in range(rounds):
            for w in windows:
                polling.set_window(w * 1e-6)
                client, r = clients[w], result[w]
                for _ in range(50):
                    stamps[w] = client.push_pull(grad, stamps[w]).timestamp
                cpu, server_cpu, times = time.process_time(), cpu_seconds(procs[w].pid), []
                for _ in range(per):
                    t = time.perf_counter()
                    stamps[w] = client.push_pull(grad, stamps[w]).timestamp
                    times.append(time.perf_counter() - t)
                r["client_cpu"] += time.process_time() - cpu
                r["server_cpu"] += cpu_seconds(procs[w].pid) - server_cpu
                r["medians"].append(statistics.median(times))
        for client in clients.values():
            client.close()
        return result
    finally:
        stop.set()
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--floats", type=int, default=1000)
    ap.add_argument("--windows", default="0,100,300", help="microseconds, comma-separated; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per", type=int, default=500, help="timed push+pulls per round and window")
    ap.add_argument("--schemes", default="tcp,shm")
    args = ap.parse_args()
    windows = [float(w) for w in args.windows.split(",")]
    print(f"{args.floats:,}-float SyncClient push+pull, {args.rounds} rounds x {args.per} per window")
    for scheme in args.schemes.split(","):
        result = measure(scheme, args.floats, windows, args.rounds, args.per)
        base = statistics.median(result[windows[0]]["medians"])
        for w in windows:
            r = result[w]
            med = statistics.median(r["medians"])
            n = args.rounds * args.per
            print(
                f"  {scheme}  window {w:6.0f} us: {med * 1e6:6.0f} us "
                f"({min(r['medians']) * 1e6:.0f}-{max(r['medians']) * 1e6:.0f})  "
                f"{base / med:4.2f}x faster than window {windows[0]:g}  "
                f"CPU per round trip: client {r['client_cpu'] / n * 1e6:4.0f} us, server {r['server_cpu'] / n * 1e6:4.0f} us"
            )


if __name__ == "__main__":
    main()

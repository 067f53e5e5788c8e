"""Updates of a large model against the server's update threads (``--update-threads``).

For a model of 25,175,040 float32 ((a)'s MLP, the (a0) workload's), the time of one update
as the server computes it (``WeightStore.apply`` on its update thread, the pieces on
``threads`` part threads, torch kernel, momentum, one gradient) and of one gradient's
max |g| (``WeightStore.max_abs``), for threads = 1 … the cores this process may use; the
medians of ``--reps``, and each one's speed-up over one thread measured in the same run.
Next to them, the memory traffic an update needs (5 × 4 bytes per value: read w, g, v;
write w, v) over its time, in GB/s.

With ``--end-to-end``, the (a0) exchange instead: a server process with 1 or N update
threads (alternating, ``--reps`` of each) and one ``SyncClient`` pushing a fixed gradient
and pulling the weights, over ``--scheme`` tcp or shm; updates/s and the server's CPU ms per
update (``/proc``), medians, and N threads ÷ 1.

From the measured times, the prediction for 8 to 64 cores: Amdahl's law with the parallel
share p fitted to the speed-up at the most threads measured here, capped by a memory
bandwidth (``--bandwidth`` GB/s, an assumption for the target machine, stated in the output),
since the update is a streaming kernel and a machine's cores share its memory.

    python benchmarks/update_threads.py [--reps 7] [--bandwidth 100]
    python benchmarks/update_threads.py --end-to-end [--scheme shm] [--steps 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from timing import cpu_seconds  # benchmarks/timing.py (the script's directory is on sys.path)

from rudra_async.kernels import SGD, Group
from rudra_async.layout import Layout
from rudra_async.server.store import Background, WeightStore, usable_cores

VALUES = 25_175_040
BYTES_PER_VALUE = 20  # read w, g, v; write w, v (float32)


def time_update(threads: int, reps: int) -> tuple[float, float]:
    """Median seconds of one update and of one max |g| with ``threads`` part threads."""
    torch.set_num_threads(1)  # as the server runs the torch kernel (--kernel-threads 1)
    layout = Layout.from_shapes([("w", (VALUES,))])
    rng = np.random.default_rng(0)
    background = Background(threads=threads)
    store = WeightStore(layout, rng.standard_normal(VALUES).astype(np.float32), "torch", background=background)
    grad = (rng.standard_normal(VALUES) * 1e-3).astype(np.float32)
    steps = [Group(0, VALUES, SGD(1e-4, 0.9, 1e-4))]
    updates, checks = [], []
    try:
        for _ in range(reps + 1):  # the first warms the buffers and the threads
            t0 = time.perf_counter()
            store.apply([grad], [1.0], steps)
            store.finish()
            t1 = time.perf_counter()
            store.max_abs(grad)
            updates.append(t1 - t0)
            checks.append(time.perf_counter() - t1)
    finally:
        store.close()
        background.close()
    return statistics.median(updates[1:]), statistics.median(checks[1:])


SERVER = """
import sys
from rudra_async import eventloop
from rudra_async.config import ServerConfig
from rudra_async.server import ParameterServer

async def main():
    protocol = sys.argv[3] if len(sys.argv) > 3 else "async"
    config = ServerConfig(listen=[sys.argv[1]], protocol=protocol, kernel="torch", lr=1e-4, momentum=0.9,
                          update_threads=int(sys.argv[2]))
    async with ParameterServer(config) as ps:
        print(ps.addresses[0], flush=True)
        await ps.serve()

eventloop.run(main())
"""


def end_to_end(scheme: str, threads: int, steps: int) -> tuple[float, float]:
    """(updates/s, server CPU ms per update) of ``steps`` push+pulls of one SyncClient."""
    from rudra_async.client import SyncClient

    listen = "shm://" if scheme == "shm" else "tcp://127.0.0.1:0"
    server = subprocess.Popen([sys.executable, "-c", SERVER, listen, str(threads)], stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip() if server.stdout else ""
        client = SyncClient(address, Layout.from_shapes([("w", (VALUES,))]), np.zeros(VALUES, np.float32))
        grad = np.full(VALUES, 1e-3, np.float32)
        w = client.pull()
        for _ in range(5):  # warm-up
            w = client.push_pull(grad, w.timestamp)
        cpu0, t0 = cpu_seconds(server.pid), time.perf_counter()
        for _ in range(steps):
            w = client.push_pull(grad, w.timestamp)
        cpu1, t1 = cpu_seconds(server.pid), time.perf_counter()
        client.close()
        return steps / (t1 - t0), 1e3 * (cpu1 - cpu0) / steps
    finally:
        server.terminate()
        server.wait(30)


def main_end_to_end(scheme: str, steps: int, reps: int) -> None:
    cores = usable_cores()
    runs: dict[int, list[tuple[float, float]]] = {1: [], cores: []}
    for _ in range(reps):  # alternating, so the host's drift spreads over both
        for k in runs:
            runs[k].append(end_to_end(scheme, k, steps))
    print(f"(a0) exchange over {scheme}, {VALUES:,} float32, {steps} push+pulls, median of {reps} alternating runs")
    base = statistics.median(r[0] for r in runs[1])
    for k, rows in runs.items():
        rate, cpu = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"  update threads {k}: {rate:5.1f} updates/s ({rate / base:4.2f}x), server CPU {cpu:5.1f} ms/update")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s of the target machine (an assumption)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--end-to-end", action="store_true", help="the (a0) exchange with 1 and N update threads")
    parser.add_argument("--scheme", choices=("tcp", "shm"), default="shm")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    if args.end_to_end:
        main_end_to_end(args.scheme, args.steps, args.reps)
        return
    cores = usable_cores()
    rows = {k: time_update(k, args.reps) for k in range(1, cores + 1)}
    base_update, base_check = rows[1]
    result = {"cores": cores, "values": VALUES, "reps": args.reps, "threads": {}}
    print(f"{VALUES:,} float32, torch kernel, median of {args.reps}; this process may use {cores} cores")
    print(f"{'threads':>7} {'update ms':>10} {'speed-up':>9} {'GB/s':>6} {'max|g| ms':>10} {'speed-up':>9}")
    for k, (update, check) in rows.items():
        gbs = VALUES * BYTES_PER_VALUE / update / 1e9
        print(
            f"{k:>7} {1e3 * update:10.1f} {base_update / update:9.2f} {gbs:6.1f} {1e3 * check:10.1f} {base_check / check:9.2f}"
        )
        result["threads"][k] = {"update_s": update, "check_s": check, "update_gbs": gbs}
    if cores > 1:
        speedup = base_update / rows[cores][0]
        p = min(max((1 - 1 / speedup) / (1 - 1 / cores), 0.0), 1.0)  # Amdahl: S(k) = 1 / ((1 - p) + p / k)
        floor = VALUES * BYTES_PER_VALUE / (args.bandwidth * 1e9)
        print(f"\nprediction (Amdahl, p = {p:.2f} from {cores} threads; memory bound {args.bandwidth:g} GB/s assumed):")
        print(f"{'cores':>7} {'update ms':>10} {'updates/s':>10} {'bound by':>9}")
        for k in (8, 16, 32, 64):
            amdahl = base_update * ((1 - p) + p / k)
            t = max(amdahl, floor)
            print(f"{k:>7} {1e3 * t:10.1f} {1 / t:10.1f} {'memory' if floor > amdahl else 'Amdahl':>9}")
        result["prediction"] = {"p": p, "bandwidth_gbs": args.bandwidth}
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()


if __name__ == "__main__":
    main()

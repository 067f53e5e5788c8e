"""What a checkpoint costs a running server (25M float32 parameters by default).

1. Writing: ``rudra_async.checkpoint.save`` (header, CRC-32 of both segments, write, fsync,
   rename) next to a plain ``write`` + ``fsync`` of the same 200 MB from the same buffers
   (the baseline), in the same directory, same run.
2. The server's event loop during ``await ps.checkpoint()``: the file is written in a thread
   from the *leased* published weights, so the loop only copies the momentum. The longest
   stall of a 1 ms ticker is reported next to one memcpy of the momentum (the floor), and
   the updates the loop applied while the file was being written show it kept serving.

    python benchmarks/checkpoint.py [--params 25000000] [--reps 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import numpy as np
from timing import median_time  # benchmarks/timing.py (the script's directory is on sys.path)

from rudra_async import ParameterServer, ServerConfig
from rudra_async import checkpoint as ckpt
from rudra_async.layout import Layout


def raw_write(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            f.write(memoryview(a.view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())


def file_costs(n: int, reps: int, directory: str) -> None:
    layout = Layout.from_shapes([("w", (n,))])
    rng = np.random.default_rng(0)
    w, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    state = ckpt.Checkpoint(layout, 1, w, v)
    path = os.path.join(directory, "bench.ckpt")
    base = median_time(lambda: raw_write(path + ".raw", [w, v]), reps, warmup=False)
    save = median_time(lambda: ckpt.save(path, state), reps, warmup=False)
    load = median_time(lambda: ckpt.load(path), reps, warmup=False)
    gb = 2 * w.nbytes / 1e9
    print(f"file: {gb:.2f} GB in {directory}, median of {reps}")
    print(f"  plain write+fsync  {base * 1e3:8.1f} ms  {gb / base:5.2f} GB/s")
    print(f"  checkpoint.save    {save * 1e3:8.1f} ms  {gb / save:5.2f} GB/s  = {base / save:4.2f}x the plain write")
    print(f"  checkpoint.load    {load * 1e3:8.1f} ms  {gb / load:5.2f} GB/s  (read + CRC check)")
    for p in (path, path + ".raw"):
        os.unlink(p)


async def while_checkpointing(ps: ParameterServer, job) -> float:
    """Run ``job()`` (an async generator of figures) during one ``ps.checkpoint()``; its last figure."""
    done = asyncio.Event()
    figures = job()
    figure = 0.0

    async def drive() -> None:
        nonlocal figure
        async for figure in figures:  # noqa: B007 (the last one is read after the loop)
            if done.is_set():
                break

    task = asyncio.create_task(drive())
    await asyncio.sleep(0.02)
    await ps.checkpoint()
    done.set()
    await task
    return figure


async def ticker():
    """Yields the longest stall so far of a 1 ms sleep loop, counted from the first tick."""
    worst, last = 0.0, None
    while True:
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        if last is not None:
            worst = max(worst, now - last - 0.001)
        last = now
        yield worst


async def updater(store, grad):
    """Applies an update every 5 ms; yields how many were applied so far."""
    updates = 0
    while True:
        store.apply([grad], [1.0], 0.01, 0.9, 0.0)  # into a spare buffer while the lease is held
        updates += 1
        yield updates
        await asyncio.sleep(0.005)


async def loop_stall(n: int, reps: int, directory: str) -> None:
    cfg = ServerConfig(
        listen=["memory://bench-ckpt"], checkpoint=os.path.join(directory, "server.ckpt"), kernel="torch"
    )
    grad = np.full(n, 1e-6, np.float32)
    ps = ParameterServer(cfg, initial={"w": np.zeros(n, np.float32)})
    await ps.start()
    store = ps.core.store
    assert store is not None
    v = store.updater.momentum
    copy = median_time(lambda: v.copy(), reps)
    stalls, during = [], []
    for _ in range(reps):
        stalls.append(await while_checkpointing(ps, ticker))  # the loop alone: its longest stall
        during.append(await while_checkpointing(ps, lambda: updater(store, grad)))  # updates meanwhile
    await ps.close()
    os.unlink(cfg.checkpoint)
    stall = statistics.median(stalls)
    print(f"server loop during ps.checkpoint(), median of {reps}:")
    print(
        f"  longest loop stall {stall * 1e3:8.1f} ms  (floor: one momentum copy {copy * 1e3:.1f} ms; ratio {stall / copy:4.2f}x)"
    )
    print(f"  updates applied by the loop while the file was written: median {statistics.median(during):.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    file_costs(args.params, args.reps, args.dir)
    asyncio.run(loop_stall(args.params, args.reps, args.dir))


if __name__ == "__main__":
    main()

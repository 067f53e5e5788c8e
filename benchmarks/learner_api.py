"""The PyTorch API's costs, each against a baseline measured in the same run.

    python benchmarks/learner_api.py [--parts roundtrip,overlap,overhead] [--reps 5] [--quick]

- **roundtrip**: a small push+pull (1,000 and 10,000 floats) through the API
  (``DistributedOptimizer.step``) and through the blocking ``SyncClient``, next to the
  asyncio ``Client``, against one server process; rounds interleaved, medians and ratios
  (target: within 1.3x of the asyncio client).
- **overlap**: the 25.2M-parameter MLP (1024-4096-4096-1024, batch 8, MSE, synthetic data)
  trained by λ = 1 and 2 learner processes through the API, without and with ``overlap``,
  over ``tcp://`` and ``shm://``: samples/s and the overlap gain (target: >= 1.3x at λ = 1).
- **overhead**: one learner through the API (with overlap) against a plain single-process
  ``torch.optim.SGD(fused=True)`` loop on the same model and data: samples/s ratio
  (target: >= 0.7x over shm:// and tcp://).

Every process computes with one thread (OMP/MKL_NUM_THREADS=1, torch.set_num_threads(1));
the server runs in its own process (``rudra-async server``), as in a deployment.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from loopback import free_port, wait_listening  # benchmarks/loopback.py (the script's directory is on sys.path)

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MLP = (1024, 4096, 4096, 1024)
BATCH = 8


def mlp():
    from torch import nn

    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(MLP):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def synthetic(steps: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, MLP[0], generator=g), torch.randn(BATCH, MLP[-1], generator=g)) for _ in range(steps)]


@contextmanager
def server(*extra: str) -> Iterator[dict[str, str]]:
    """A ``rudra-async server`` process (async, one compute thread) on tcp and shm; yields its URLs."""
    port, name = free_port(), f"bench-{secrets.token_hex(4)}"
    cmd = [sys.executable, "-m", "rudra_async", "server", "--listen", f"tcp://127.0.0.1:{port}"]
    cmd += ["--listen", f"shm://{name}", "--protocol", "async", "--lr", "1e-6", "--momentum", "0.9", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env={**os.environ, **ONE_THREAD})
    try:
        wait_listening(port)
        yield {"tcp": f"tcp://127.0.0.1:{port}", "shm": f"shm://{name}"}
    finally:
        proc.terminate()
        proc.wait(30)


# -- roundtrip --------------------------------------------------------------------------------
def roundtrip(url: str, size: int, rounds: int, calls: int) -> dict[str, float]:
    """Median µs per small push+pull for the asyncio Client, the SyncClient and the API."""
    import torch
    from torch import nn

    from rudra_async.client import Client, SyncClient
    from rudra_async.eventloop import new_event_loop
    from rudra_async.torch import DistributedOptimizer

    torch.set_num_threads(1)
    model = nn.Linear(size // 10 - 1, 10)  # (size/10 - 1)·10 + 10 = size parameters
    opt = DistributedOptimizer(model, url)
    layout, grad = opt.flat.layout, np.full(size, 1e-6, np.float32)
    loop = new_event_loop()
    client = loop.run_until_complete(Client.connect(url, layout))
    sync = SyncClient(url, layout)
    x = torch.zeros(1, model.in_features)

    def backward() -> None:
        """The training step's compute, untimed, before every call of each client: a server
        woken after a pause answers more slowly than one in a tight loop, so all three see it."""
        opt.zero_grad()
        model(x).sum().backward()

    async def async_calls() -> list[float]:
        w, times = await client.pull(), []
        for _ in range(calls):
            backward()
            t = time.perf_counter()
            w = await client.push_pull(grad, w.timestamp)
            times.append(time.perf_counter() - t)
        return times

    def sync_calls() -> list[float]:
        w, times = sync.pull(), []
        for _ in range(calls):
            backward()
            t = time.perf_counter()
            w = sync.push_pull(grad, w.timestamp)
            times.append(time.perf_counter() - t)
        return times

    def api_calls() -> list[float]:
        times = []
        for _ in range(calls):
            backward()  # step() needs this step's gradient
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        return times

    medians: dict[str, list[float]] = {"async": [], "sync": [], "api": []}
    for _ in range(rounds):
        medians["async"].append(statistics.median(loop.run_until_complete(async_calls())))
        medians["sync"].append(statistics.median(sync_calls()))
        medians["api"].append(statistics.median(api_calls()))
    loop.run_until_complete(client.close())
    loop.close()
    sync.close()
    opt.close()
    return {k: statistics.median(v) * 1e6 for k, v in medians.items()}


# -- training throughput ----------------------------------------------------------------------
def learner_main(url: str, overlap: bool, warmup: int, steps: int) -> None:
    """One learner process: warm up, then time ``steps`` steps; prints JSON."""
    import torch
    from torch import nn

    from rudra_async.torch import DistributedOptimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp()
    data = synthetic(warmup + steps, seed=os.getpid())
    with DistributedOptimizer(model, url, overlap=overlap) as opt:
        for i, (x, y) in enumerate(data):
            if i == warmup:
                started = time.perf_counter()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step(samples=BATCH)
        elapsed = time.perf_counter() - started
    print(json.dumps({"samples_per_s": steps * BATCH / elapsed}))


def learners(url: str, count: int, overlap: bool, warmup: int, steps: int) -> float:
    """Aggregate samples/s of ``count`` learner processes running at once."""
    cmd = [sys.executable, __file__, "--learner", url, "--warmup", str(warmup), "--steps", str(steps)]
    procs = [
        subprocess.Popen(cmd + (["--overlap"] if overlap else []), stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **ONE_THREAD})
        for _ in range(count)
    ]  # fmt: skip
    rates = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"a learner failed (exit {p.returncode})")
        rates.append(json.loads(out.strip().splitlines()[-1])["samples_per_s"])
    return sum(rates)


def plain_sgd(warmup: int, steps: int) -> float:
    """samples/s of a plain single-process loop: the same model and data, SGD(fused=True)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9, fused=True)
    data = synthetic(warmup + steps)
    for i, (x, y) in enumerate(data):
        if i == warmup:
            started = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - started)


def median_of(reps: int, fn: Callable[[], float]) -> tuple[float, float, float]:
    values = [fn() for _ in range(reps)]
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="roundtrip,overlap,overhead")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each throughput point (median, min-max)")
    parser.add_argument("--quick", action="store_true", help="few steps: a smoke run, not a measurement")
    parser.add_argument("--learner", help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner:
        learner_main(args.learner, args.overlap, args.warmup, args.steps)
        return
    os.environ.update(ONE_THREAD)
    parts = args.parts.split(",")
    warmup, steps = (2, 4) if args.quick else (5, 40)
    print(f"# learner API benchmark ({os.cpu_count()} cores); medians (min-max) of {args.reps} repetitions")
    if "roundtrip" in parts:
        for size in (1000, 10_000):
            with server() as urls:
                r = roundtrip(urls["tcp"], size, rounds=3 if args.quick else 7, calls=200 if args.quick else 1000)
                print(f"push+pull of {size:>6} floats (tcp): async Client {r['async']:6.0f} us | SyncClient "
                      f"{r['sync']:6.0f} us ({r['sync'] / r['async']:.2f}x) | API step {r['api']:6.0f} us "
                      f"({r['api'] / r['async']:.2f}x)   target <= 1.3x")  # fmt: skip
    if "overlap" in parts or "overhead" in parts:
        plain = median_of(args.reps, lambda: plain_sgd(warmup, steps))
        print(f"plain torch SGD(fused=True), one process: {plain[0]:7.1f} samples/s ({plain[1]:.1f}-{plain[2]:.1f})")
        with server() as urls:
            for transport in ("shm", "tcp"):
                for count in (1, 2) if "overlap" in parts else (1,):
                    rate = {
                        o: median_of(args.reps, lambda o=o: learners(urls[transport], count, o, warmup, steps))
                        for o in (False, True)
                    }
                    off, on = rate[False][0], rate[True][0]
                    line = (f"{transport}:// λ={count}: {off:7.1f} samples/s without overlap "
                            f"({rate[False][1]:.1f}-{rate[False][2]:.1f}), {on:7.1f} with "
                            f"({rate[True][1]:.1f}-{rate[True][2]:.1f}): overlap gain {on / off:.2f}x")  # fmt: skip
                    if count == 1:
                        line += f" (target >= 1.3x); API with overlap / plain SGD {on / plain[0]:.2f}x (target >= 0.7x)"
                    print(line, flush=True)


if __name__ == "__main__":
    main()

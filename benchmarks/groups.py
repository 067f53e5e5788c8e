"""Learner groups (``--group-size``, the paper's "adv") against single learners, across
emulated hosts: when do groups pay?

A server host and two learner hosts (network namespaces joined through a bridge, each
learner host's link shaped with tc ``tbf`` to ``--rate`` both ways: tests/netns.py), λ = 4
learner processes, two on each learner host, async, for ``--seconds`` per point:

- **singles**: the 4 learners each exchange with the server (two connections per link);
- **groups**: 2 groups of 2, one per host: the members add their gradients on their host
  (gloo over the host's loopback) and one exchanges for both (one connection per link).

Each learner trains a ``torch.nn.Linear(d, d)`` (``--dims``: one run per model size, d² float32
parameters) on a fixed random mini-batch of ``--batch`` rows through
``rudra_async.torch.DistributedOptimizer``. Printed per model size and layout (medians of
``--reps``, alternating): server updates/s, samples/s (distinct samples: every learner's),
mean staleness, and groups ÷ singles.

Needs root and iproute2 (it says so and exits otherwise). On this 2-core host every
"host" shares the same two cores, so compute is 4 processes on 2 cores in both layouts.

    python benchmarks/groups.py [--rate 1gbit] [--dims 2048,256] [--seconds 15] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import SERVER_ADDRESS, Hosts, unavailable

LEARNER = """
import json, sys, time, torch
from torch import nn
import rudra_async.torch as rt
url, d, batch, seconds, rank, size, address, index = sys.argv[1:9]
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Linear(int(d), int(d), bias=False)
x = torch.randn(int(batch), int(d))
group = rt.LocalGroup(int(rank), int(size), address, timeout=120) if int(size) > 1 else None
opt = rt.DistributedOptimizer(model, url, index=int(index), group=group, threads=1, reconnect=30)
steps, started = 0, None
while True:
    opt.zero_grad()
    model(x).square().mean().backward()
    if not opt.step(samples=len(x)):
        break
    if started is None:
        started = time.perf_counter()  # from the first exchange on (connections made, torch warm)
    elif time.perf_counter() - started >= float(seconds):
        break
    else:
        steps += 1
elapsed = time.perf_counter() - started
opt.close()
print(json.dumps({"steps": steps, "elapsed": elapsed}), flush=True)
"""
PORT = 7411


def run_point(hosts: Hosts, d: int, size: int, args: argparse.Namespace) -> dict:
    """λ = 4, two learners per learner host, in groups of ``size`` (1: singles)."""
    groups = 4 // size
    server = subprocess.Popen(
        hosts.on(hosts.server, sys.executable, "-m", "rudra_async", "--log-level", "WARNING", "server", "--listen",
                 f"tcp://{SERVER_ADDRESS}:{PORT}", "--protocol", "async", "--lr", "1e-6", "--momentum", "0",
                 "--expected-learners", str(groups), "--insecure"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    learners = []
    try:
        for k in range(4):
            host = hosts.learners[k // 2]
            rank, group = k % size, k // size
            command = [sys.executable, "-c", LEARNER, f"tcp://{SERVER_ADDRESS}:{PORT}", str(d), str(args.batch),
                       str(args.seconds), str(rank), str(size), f"127.0.0.1:{29500 + group}", str(group)]  # fmt: skip
            learners.append(subprocess.Popen(hosts.on(host, *command), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True))  # fmt: skip
        outs = [p.communicate(timeout=args.seconds + 180) for p in learners]
    finally:
        server.send_signal(2)
        _, err = server.communicate(timeout=60)
    for p, (_, e) in zip(learners, outs):
        if p.returncode != 0:
            raise SystemExit(f"a learner failed: {e[-2000:]}")
    rows = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    stats = json.loads(err.strip().splitlines()[-1])
    seconds = max(r["elapsed"] for r in rows)
    return {
        "updates_per_s": sum(r["steps"] for r in rows) / size / seconds,
        "samples_per_s": sum(r["steps"] for r in rows) * args.batch / seconds,
        "staleness": stats["staleness_mean"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--dims", default="2048,256")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    dims = [int(v) for v in args.dims.split(",")]
    print(f"λ = 4 on 2 learner hosts, links {args.rate} both ways, async, {args.seconds:g} s per point, "
          f"median of {args.reps}")  # fmt: skip
    measured: dict[tuple[int, int], list[dict]] = {(d, s): [] for d in dims for s in (1, 2)}
    for _ in range(args.reps):  # alternating: the host's drift spreads over every point
        for d in dims:
            for size in (1, 2):
                with Hosts(2, rate=args.rate) as hosts:
                    measured[(d, size)].append(run_point(hosts, d, size, args))
    print("\n| model (float32) | layout | updates/s | samples/s | mean σ | samples/s, groups ÷ singles |")
    print("| --- | --- | --- | --- | --- | --- |")
    for d in dims:
        med = {s: {k: statistics.median(r[k] for r in measured[(d, s)]) for k in ("updates_per_s", "samples_per_s",
               "staleness")} for s in (1, 2)}  # fmt: skip
        mb = 4 * d * d / 1e6
        for size, name in ((1, "4 single learners"), (2, "2 groups of 2")):
            m = med[size]
            ratio = f"{med[2]['samples_per_s'] / med[1]['samples_per_s']:.2f}" if size == 2 else "—"
            print(f"| {d}² ({mb:.1f} MB) | {name} | {m['updates_per_s']:.1f} | {m['samples_per_s']:.0f} | "
                  f"{m['staleness']:.2f} | {ratio} |")  # fmt: skip


if __name__ == "__main__":
    main()

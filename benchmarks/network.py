"""(a0) and (a) across emulated links: the cost of the network.

The server on one host and λ learners on others: network namespaces joined by veth links
through a bridge, each learner's link shaped with tc ``tbf`` to each rate of ``--rates`` in
both directions (tests/netns.py; this host's kernel has no ``netem``, so no added latency).
Each learner is a ``SyncClient`` pushing a fixed gradient of ``--values`` float32 (100 MB by
default, the (a0) workload) and pulling the weights, for ``--seconds``; the server is
``rudra-async server`` (async, torch kernel). Printed per rate and λ:

- **measured** updates/s (all learners together, the median of ``--reps``);
- **link bound**: what the links allow the payload, each learner's own link carrying its
  gradient one way and the weights the other per update (rate ÷ (8 × 2 × bytes) updates/s per
  learner, at most the host's loopback figure below): measured ÷ bound says how close the
  server comes to the wire;
- **predicted**: the runtime model (rudra_async.runs.runtime_model) with the CPU costs of
  the same exchange measured over loopback in this run (client and server CPU per update,
  ``/proc``) and the wire time of a message (bytes × 8 ÷ rate) as its latency.

With ``--workload a``, the (a) training instead: each learner trains the MLP
1024-4096-4096-1024 (the same 25,175,040 float32) on a fixed random batch of 8 with MSE
through ``rudra_async.torch.DistributedOptimizer`` (one torch thread), samples/s printed
beside updates/s; the model's compute time per step is one such step timed in this process
(one thread), and the client's CPU per update over loopback less that compute is its
protocol cost.

Needs root and iproute2 (it says so and exits otherwise).

    python benchmarks/network.py [--workload a0|a] [--rates 1gbit,10gbit] [--lambdas 1,2] [--seconds 10] [--reps 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from timing import cpu_seconds  # benchmarks/timing.py (the script's directory is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import SERVER_ADDRESS, Hosts, unavailable

from rudra_async.runs.runtime_model import Costs, simulate
from rudra_async.server.store import usable_cores

CLIENT = """
import sys, time
import numpy as np
from rudra_async.client import SyncClient
from rudra_async.layout import Layout
url, seconds, values = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
client = SyncClient(url, Layout.from_shapes([("w", (values,))]), np.zeros(values, np.float32), wait=30)
grad = np.full(values, 1e-3, np.float32)
w = client.pull()
for _ in range(2):  # warm-up
    w = client.push_pull(grad, w.timestamp)
count, cpu0, t0 = 0, time.process_time(), time.perf_counter()
while time.perf_counter() - t0 < seconds:
    w = client.push_pull(grad, w.timestamp)
    count += 1
print(count, time.perf_counter() - t0, time.process_time() - cpu0, flush=True)
client.close()
"""
TRAINER = """
import sys, time, torch
from torch import nn
import rudra_async.torch as rt
url, seconds = sys.argv[1], float(sys.argv[2])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
x, y = torch.randn(8, 1024), torch.randn(8, 1024)
opt = rt.DistributedOptimizer(model, url, threads=1, reconnect=30)


def step():
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step(samples=len(x))


for _ in range(2):  # warm-up
    step()
count, cpu0, t0 = 0, time.process_time(), time.perf_counter()
while time.perf_counter() - t0 < seconds:
    step()
    count += 1
print(count, time.perf_counter() - t0, time.process_time() - cpu0, flush=True)
opt.close()
"""
SERVER = [sys.executable, "-m", "rudra_async", "--log-level", "WARNING", "server", "--protocol", "async", "--kernel",
          "torch", "--lr", "1e-4", "--momentum", "0.9", "--insecure"]  # fmt: skip
RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)bit$")


def bits_per_s(rate: str) -> float:
    m = RATE.match(rate)
    if not m:
        raise SystemExit(f"--rates: {rate!r} is not like 1gbit or 500mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def run_point(on_server: list[str], on_learners: list[list[str]], url: str, args: argparse.Namespace) -> dict:
    """One server and λ clients (commands prefixed to run where they should); updates/s of
    all clients, and per update the clients' CPU and the server's."""
    server = subprocess.Popen([*on_server, *SERVER, "--listen", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        time.sleep(2)  # listening
        if server.poll() is not None:
            raise SystemExit(f"the server failed: {server.communicate()[1].decode()[-2000:]}")
        cpu0 = cpu_seconds(server.pid)
        script = TRAINER if args.workload == "a" else CLIENT
        command = [sys.executable, "-c", script, url, str(args.seconds), str(args.values)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        clients = [subprocess.Popen([*prefix, *command], **pipes) for prefix in on_learners]
        outs = [c.communicate(timeout=args.seconds + 120) for c in clients]
        server_cpu = cpu_seconds(server.pid) - cpu0
    finally:
        server.terminate()
        server.wait(30)
    for c, (out, err) in zip(clients, outs):
        if c.returncode != 0 or not out.strip():
            raise SystemExit(f"a client failed: {err[-2000:]}")
    rows = [tuple(float(v) for v in out.split()) for out, _ in outs]
    updates = sum(count for count, _, _ in rows)
    return {
        "updates_per_s": sum(count / elapsed for count, elapsed, _ in rows),
        "client_s": sum(cpu for _, _, cpu in rows) / updates,
        "server_s": server_cpu / (updates + 2 * len(rows)),  # the warm-up's too
    }


MLP_VALUES = 25_175_040  # the (a) MLP's parameters
BATCH = 8  # the (a) batch


def mlp_step_seconds(reps: int = 7) -> float:
    """One (a) training step's compute on one torch thread here: the median of ``reps``."""
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    x, y = torch.randn(BATCH, 1024), torch.randn(BATCH, 1024)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        times.append(time.perf_counter() - t)
    torch.set_num_threads(threads)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--lambdas", default="1,2")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--values", type=int, default=25_175_040)
    ap.add_argument("--workload", choices=("a0", "a"), default="a0")
    args = ap.parse_args()
    if args.workload == "a":
        args.values = MLP_VALUES
    why = unavailable()
    if why:
        raise SystemExit(f"cannot emulate hosts here: {why}")
    lambdas = [int(v) for v in args.lambdas.split(",")]
    rates = args.rates.split(",")
    size = 4 * args.values
    cores = usable_cores()
    compute_s = mlp_step_seconds() if args.workload == "a" else 0.0
    print(f"({args.workload}) over emulated links: {args.values:,} float32 ({size / 1e6:.0f} MB) each way per update, "
          f"{args.seconds:g} s per point, median of {args.reps}, {cores} cores")  # fmt: skip
    loop = {lam: [] for lam in lambdas}
    links: dict[tuple[str, int], list[dict]] = {(r, lam): [] for r in rates for lam in lambdas}
    for _ in range(args.reps):  # alternating, so the host's drift spreads over every point
        for lam in lambdas:
            loop[lam].append(run_point([], [[]] * lam, "tcp://127.0.0.1:7399", args))
            for rate in rates:
                with Hosts(lam, rate=rate) as hosts:
                    on_learners = [hosts.on(h) for h in hosts.learners]
                    links[(rate, lam)].append(
                        run_point(hosts.on(hosts.server), on_learners, f"tcp://{SERVER_ADDRESS}:7399", args)
                    )
    med = {lam: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for lam, rs in loop.items()}
    print("\n| link | λ | updates/s measured | link bound | measured ÷ bound | predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for lam in lambdas:
        print(f"| loopback | {lam} | {med[lam]['updates_per_s']:.2f} | — | — | — | — |")
    for rate in rates:
        for lam in lambdas:
            got = statistics.median(r["updates_per_s"] for r in links[(rate, lam)])
            wire = 8 * size / bits_per_s(rate)  # one message's time on its link
            bound = min(lam / (2 * wire), med[lam]["updates_per_s"])
            client_s = max(0.0, med[1]["client_s"] - compute_s)  # the protocol's share of the learner's CPU
            costs = Costs(compute_s=compute_s, client_s=client_s, server_s=med[1]["server_s"], update_s=0.0,
                          latency_s=wire)  # fmt: skip
            pred = simulate(costs, lam, "async", cores=cores, batch_size=1, updates=200).updates_per_s
            samples = f" ({BATCH * got:.1f} samples/s)" if args.workload == "a" else ""
            print(f"| {rate} | {lam} | {got:.2f}{samples} | {bound:.2f} | {got / bound:.2f} | {pred:.2f} | "
                  f"{pred / got - 1:+.0%} |")  # fmt: skip
    print(f"\nloopback CPU per update (λ = 1, the model's costs): client {1e3 * med[1]['client_s']:.0f} ms "
          f"(of which compute {1e3 * compute_s:.0f} ms), server {1e3 * med[1]['server_s']:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

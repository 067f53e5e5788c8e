"""The runtime model (rudra_async.runs.runtime_model): calibrated here, validated against real
runs, then used to predict speedup against λ.

1. **Calibration** (a few seconds): the costs of one step of ``--model`` on ``--dataset`` at
   mini-batch ``--batch-size``, measured on this machine: a learner's compute (forward,
   backward, loss; one torch thread), a ``DistributedOptimizer.step`` against a real server
   process over ``--transport`` (the learner's CPU for it, the server process's CPU per push,
   the wall time left over as latency), and the update kernel with 1 and 4 gradients.
2. **Validation**: real ``rudra-async train`` runs (server and λ learner processes) for every
   λ in ``--lambdas`` and protocol in ``--protocols``, each against the model's prediction
   for this machine's cores: updates/s and samples/s, and the error of each.
3. **Prediction**: speedup over λ = 1 for λ up to ``--predict-to``, one core per learner and
   one for the server (the paper's setting), per protocol.

    python benchmarks/runtime_model.py [--model mlp] [--dataset digits] [--batch-size 16]
        [--epochs 10] [--lambdas 1,2,4] [--protocols async,hardsync] [--transport tcp]
        [--predict-to 64] [--no-validate] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from timing import cpu_seconds, median_time  # benchmarks/timing.py (the script's directory is on sys.path)
from update_threads import SERVER  # the same server process as the (a0) end-to-end measurement

from rudra_async.kernels import SGD, make_updater
from rudra_async.learner import data as datasets
from rudra_async.learner.evaluation import build_model
from rudra_async.runs.runtime_model import Costs, simulate
from rudra_async.server.store import usable_cores
from rudra_async.torch import DistributedOptimizer

STEPS = 400  # measured steps of the calibration (after 50 unmeasured)


def compute_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    """Median CPU-bound seconds of one forward, backward and loss on a mini-batch."""
    rng = np.random.default_rng(0)

    def step() -> None:
        idx = torch.from_numpy(rng.integers(0, len(y), batch))
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        loss.item()

    return median_time(step, 300)


def exchange_costs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, scheme: str) -> dict:
    """A learner's CPU per step(), the server's CPU per push and the wall time per step(),
    against a server process (1 update thread), measured over :data:`STEPS` steps."""
    listen = "shm://" if scheme == "shm" else "tcp://127.0.0.1:0"
    server = subprocess.Popen([sys.executable, "-c", SERVER, listen, "1"], stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip() if server.stdout else ""
        opt = DistributedOptimizer(model, address, threads=None)
        idx = torch.arange(batch)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        cpu = wall = 0.0
        for i in range(50 + STEPS):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            if i == 50:
                server_cpu0 = cpu_seconds(server.pid)
            c0, w0 = time.process_time(), time.perf_counter()
            opt.step(loss=loss, samples=batch)
            if i >= 50:
                cpu += time.process_time() - c0
                wall += time.perf_counter() - w0
        server_cpu = cpu_seconds(server.pid) - server_cpu0
        opt.close()
        return {"client_s": cpu / STEPS, "server_cpu_s": server_cpu / STEPS, "step_wall_s": wall / STEPS}
    finally:
        server.terminate()
        server.wait(30)


def update_seconds(size: int) -> tuple[float, float]:
    """(the torch kernel's update with 1 gradient, each further gradient of an update of 4)."""
    updater = make_updater("torch", size)
    w, out = np.zeros(size, np.float32), np.zeros(size, np.float32)
    grads = [np.full(size, 1e-3, np.float32) for _ in range(4)]
    one = median_time(lambda: updater.apply(w, out, grads[:1], [1.0], SGD(0.01, 0.9)), 300)
    four = median_time(lambda: updater.apply(w, out, grads, [0.25] * 4, SGD(0.01, 0.9)), 300)
    return one, max(0.0, (four - one) / 3)


def calibrate(args: argparse.Namespace) -> Costs:
    torch.set_num_threads(1)
    dataset = datasets.load(args.dataset)
    x, y = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    model = build_model(args.model, dataset, 0)
    compute = compute_seconds(model, x, y, args.batch_size)
    exchange = exchange_costs(model, x, y, args.batch_size, args.transport)
    size = sum(p.numel() for p in model.parameters())
    update, combine = update_seconds(size)
    server = max(0.0, exchange["server_cpu_s"] - update)
    latency = max(0.0, (exchange["step_wall_s"] - exchange["client_s"] - exchange["server_cpu_s"]) / 2)
    costs = Costs(compute, exchange["client_s"], server, update, combine, latency)
    print(
        f"calibration ({args.model} on {args.dataset}, μ = {args.batch_size}, {size:,} parameters, {args.transport}):"
    )
    for name, value in vars(costs).items():
        print(f"  {name:10s} {1e3 * value:8.3f} ms")
    return costs


def measure(args: argparse.Namespace, learners: int, protocol: str) -> dict:
    """A real run: ``rudra-async train`` with λ learner processes; its updates/s and samples/s."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        subprocess.run(
            [sys.executable, "-m", "rudra_async", "train", "-l", str(learners), "--protocol", protocol,
             "-b", str(args.batch_size), "--epochs", str(args.epochs), "--model", args.model,
             "--dataset", args.dataset, "--transport", args.transport, "--quiet", "--results", str(results)],
            check=True, capture_output=True, timeout=1800,
        )  # fmt: skip
        found = json.loads(results.read_text())
    return {"updates_per_s": found["updates"] / found["train_s"], "samples_per_s": found["samples_per_s"]}


def validate(args: argparse.Namespace, costs: Costs) -> list[dict]:
    cores = usable_cores()
    rows = []
    print(f"\nvalidation on this machine ({cores} cores): measured (median of {args.reps}) vs predicted")
    print("| protocol | λ | updates/s measured | predicted | error | samples/s measured | predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for protocol in args.protocols.split(","):
        for lam in (int(v) for v in args.lambdas.split(",")):
            runs = [measure(args, lam, protocol) for _ in range(args.reps)]
            got = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            pred = simulate(costs, lam, protocol, cores=cores, batch_size=args.batch_size)
            err_u = pred.updates_per_s / got["updates_per_s"] - 1
            err_s = pred.samples_per_s / got["samples_per_s"] - 1
            rows.append({"protocol": protocol, "learners": lam, **got, "predicted_updates_per_s": pred.updates_per_s,
                         "predicted_samples_per_s": pred.samples_per_s})  # fmt: skip
            print(f"| {protocol} | {lam} | {got['updates_per_s']:,.0f} | {pred.updates_per_s:,.0f} | {err_u:+.0%} "
                  f"| {got['samples_per_s']:,.0f} | {pred.samples_per_s:,.0f} | {err_s:+.0%} |")  # fmt: skip
    return rows


def predict(args: argparse.Namespace, costs: Costs) -> dict:
    """Speedup over λ = 1 with one core per learner and one for the server."""
    lambdas = [lam for lam in (1, 2, 4, 8, 16, 30, 32, 64) if lam <= args.predict_to]
    protocols = args.protocols.split(",")
    curves: dict[str, list[float]] = {}
    base = simulate(costs, 1, "async", cores=2, batch_size=args.batch_size).samples_per_s
    print("\npredicted speedup in samples/s over one learner, one core per learner and one for the server:")
    print("| λ | " + " | ".join(protocols) + " |")
    print("| --- |" + " --- |" * len(protocols))
    for lam in lambdas:
        row = []
        for protocol in protocols:
            pred = simulate(
                costs, lam, protocol, cores=lam + 1, batch_size=args.batch_size, updates=max(2000, 40 * lam)
            )
            curves.setdefault(protocol, []).append(pred.samples_per_s / base)
            row.append(f"{pred.samples_per_s / base:.1f}×")
        print(f"| {lam} | " + " | ".join(row) + " |")
    return {"lambdas": lambdas, "speedup": curves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=float, default=10)
    ap.add_argument("--lambdas", default="1,2,4")
    ap.add_argument("--protocols", default="async,hardsync")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--predict-to", type=int, default=64)
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument("--json", help="write the costs, the validation and the predictions here")
    args = ap.parse_args()
    costs = calibrate(args)
    rows = [] if args.no_validate else validate(args, costs)
    curves = predict(args, costs)
    if args.json:
        Path(args.json).write_text(json.dumps({"costs": vars(costs), "validation": rows, **curves}, indent=1))


if __name__ == "__main__":
    main()

"""The runtime model (rudra_async.runs.runtime_model): calibrated here, validated against real
runs, then used to predict speedup against λ.

1. **Calibration** (under a minute): the costs of one step of ``--model`` on ``--dataset`` at
   mini-batch ``--batch-size``, measured on this machine: a learner's compute (forward,
   backward, loss; one torch thread), a ``DistributedOptimizer.step`` against a real server
   process over ``--transport`` (the learner's CPU for it, the server process's CPU per push,
   the wall time left over as latency), the update kernel with 1 and 4 gradients, and what a
   hardsync round's held push costs the server more (two client processes, hardsync against
   async, the median of five rounds), and what a learner's step costs more after others ran
   while it was away (``Costs.cold_s``, ``cold_tau_s``: a ring of processes,
   ``benchmarks/cold_cache.py``). Then
   two short real runs (as in 2.): one learner, whose step time scales the CPU costs (the
   parts measured alone miss the learner loop's own work), and 2 asynchronous learners,
   whose samples/s gives the switch cost (``Costs.switch_s``) by bisection. These two points
   are marked as calibration in the validation table; the others are predictions.
2. **Validation**: real ``rudra-async train`` runs (server and λ learner processes, one torch
   thread each, as the model's learners) for every λ in ``--lambdas`` and protocol in
   ``--protocols``, each against the model's prediction for this machine's cores: updates/s
   and samples/s, and the error of each. Each run is timed between two half-second speed
   probes (:class:`SpeedProbe`) and its rates scaled to the calibration's speed; the table
   also shows the unscaled rate and its error.
3. **Prediction**: speedup over λ = 1 for λ up to ``--predict-to``, one core per learner and
   one for the server (the paper's setting), per protocol.

    python benchmarks/runtime_model.py [--model mlp] [--dataset digits] [--batch-size 16]
        [--epochs 150] [--lambdas 1,2,4,8] [--protocols async,hardsync] [--transport tcp]
        [--predict-to 64] [--no-validate] [--json FILE] [--plot DIR]

With ``--plot DIR``: ``DIR/runtime_validation.png`` (measured and predicted samples/s against
λ on this machine) and ``DIR/runtime_speedup.png`` (the predicted speedup curves next to the
paper's reported 22–28× at 30 learners).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from cold_cache import cold_costs  # benchmarks/cold_cache.py
from timing import cpu_seconds, median_time  # benchmarks/timing.py (the script's directory is on sys.path)
from update_threads import SERVER  # the same server process as the (a0) end-to-end measurement

from rudra_async.kernels import SGD, make_updater
from rudra_async.learner import data as datasets
from rudra_async.learner.evaluation import build_model
from rudra_async.runs.runtime_model import Costs, gradients_per_update, simulate
from rudra_async.server.store import usable_cores
from rudra_async.torch import DistributedOptimizer
from rudra_async.transports import polling

STEPS = 400  # measured steps of the calibration (after 50 unmeasured)
#: train's progress line: the updates of the last second and the learners connected
PROGRESS = re.compile(r"updates +\d+ \( *(\d+)/s\).*learners (\d+)")
CPU_PARTS = ("compute_s", "client_s", "server_s", "update_s", "combine_s", "hold_s")
#: the validation points the calibration used
CALIBRATION_POINTS = {("async", 1), ("async", 2)}


def compute_seconds(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, reps: int) -> float:
    """Median CPU-bound seconds of one forward, backward and loss on a mini-batch, over ``reps``."""
    rng = np.random.default_rng(0)

    def step() -> None:
        idx = torch.from_numpy(rng.integers(0, len(y), batch))
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        loss.item()

    return median_time(step, reps)


@contextlib.contextmanager
def polling_off_server(scheme: str, protocol: str = "async") -> Iterator[tuple[subprocess.Popen, str]]:
    """A server process (1 update thread, ``protocol``) over ``scheme`` with busy polling
    off, and its address; terminated at the end. Busy polling is also off in this process
    meanwhile: a window spent polling is CPU a process holds while it waits, not work (real
    runs poll; what that saves in wake-ups is in the fitted switch cost)."""
    listen = "shm://" if scheme == "shm" else "tcp://127.0.0.1:0"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, listen, "1", protocol],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, polling.ENV: "0"},
    )
    window = polling.window()
    polling.set_window(0)
    try:
        yield server, server.stdout.readline().strip() if server.stdout else ""
    finally:
        polling.set_window(window)
        server.terminate()
        server.wait(30)


def exchange_costs(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, scheme: str) -> dict:
    """A learner's CPU per step(), the server's CPU per push and the wall time per step(),
    against a :func:`polling_off_server`, measured over :data:`STEPS` steps."""
    with polling_off_server(scheme) as (server, address):
        opt = DistributedOptimizer(model, address, threads=None)
        idx = torch.arange(batch)
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


#: a client process for :func:`hold_seconds`: ``argv[3]`` push+pulls of ``argv[2]`` float32 to ``argv[1]``
CLIENT = """
import sys
import numpy as np
from rudra_async.client import SyncClient
from rudra_async.layout import Layout

size, steps = int(sys.argv[2]), int(sys.argv[3])
client = SyncClient(sys.argv[1], Layout.from_shapes([("w", (size,))]), np.zeros(size, np.float32), wait=10)
grad = np.full(size, 1e-4, np.float32)
w = client.pull()
for _ in range(steps):
    w = client.push_pull(grad, w.timestamp)
client.close()
"""
HOLD_STEPS = 1500  # push+pulls of each of the two clients of hold_seconds
#: rounds of hold_seconds (async then hardsync in each); five single rounds in a row gave
#: 0.00–0.17 ms for the MLP on one host (2026-12-08), so it takes their median
HOLD_ROUNDS = 5


def hold_seconds(size: int, scheme: str) -> float:
    """``Costs.hold_s``: what a server spends more per push under hardsync than under async,
    with two client processes pushing ``size`` floats without compute (busy polling off), per
    held push (one of each round's two); the median of ``HOLD_ROUNDS`` rounds."""
    rounds = []
    for _ in range(HOLD_ROUNDS):
        plain = server_cpu_per_push(size, scheme, "async")
        rounds.append(2 * (server_cpu_per_push(size, scheme, "hardsync") - plain))
    return max(0.0, statistics.median(rounds))


def server_cpu_per_push(size: int, scheme: str, protocol: str) -> float:
    """The server's CPU seconds per push while two client processes each make ``HOLD_STEPS``
    push+pulls of ``size`` floats against it, busy polling off."""
    env = {**os.environ, polling.ENV: "0"}
    with polling_off_server(scheme, protocol) as (server, address):
        cpu0 = cpu_seconds(server.pid)
        clients = [
            subprocess.Popen([sys.executable, "-c", CLIENT, address, str(size), str(HOLD_STEPS)], env=env)
            for _ in range(2)
        ]
        for client in clients:
            if client.wait(300):
                raise SystemExit(f"a {protocol} client of the hold measurement failed")
        return (cpu_seconds(server.pid) - cpu0) / (2 * HOLD_STEPS)


def update_seconds(size: int) -> tuple[float, float]:
    """(the torch kernel's update with 1 gradient, each further gradient of an update of 4)."""
    updater = make_updater("torch", size)
    w, out = np.zeros(size, np.float32), np.zeros(size, np.float32)
    grads = [np.full(size, 1e-3, np.float32) for _ in range(4)]
    one = median_time(lambda: updater.apply(w, out, grads[:1], [1.0], SGD(0.01, 0.9)), 300)
    four = median_time(lambda: updater.apply(w, out, grads, [0.25] * 4, SGD(0.01, 0.9)), 300)
    return one, max(0.0, (four - one) / 3)


def fitted(args: argparse.Namespace, costs: Costs, measured: dict, cores: int) -> Costs:
    """``costs`` with its CPU parts scaled so that one learner runs as fast as the real ones
    did, and the switch cost that makes 2 asynchronous learners as fast as theirs (bisection:
    the model slows monotonically as the switch costs more)."""
    one, two = measured[("async", 1)]["samples_per_s"], measured[("async", 2)]["samples_per_s"]
    k = simulate(costs, 1, "async", cores=cores, batch_size=args.batch_size).samples_per_s / one
    costs = replace(costs, **{name: k * getattr(costs, name) for name in CPU_PARTS})
    low, high = 0.0, 0.02
    for _ in range(30):
        mid = (low + high) / 2
        fast = simulate(replace(costs, switch_s=mid), 2, "async", cores=cores, batch_size=args.batch_size)
        low, high = (mid, high) if fast.samples_per_s > two else (low, mid)
    print(f"  fitted: CPU costs × {k:.3f} (one learner: {one:,.0f} samples/s), switch_s {1e3 * low:.3f} ms "
          f"(2 asynchronous learners: {two:,.0f} samples/s)")  # fmt: skip
    return replace(costs, switch_s=low)


class SpeedProbe:
    """This machine's speed now, against its speed at calibration: a second or so of the
    calibration's compute loop, timed. A virtual machine's speed drifts from run to run (CPU
    steal, other tenants): each real run is timed next to a probe before and after it, and
    its rates are scaled to the calibration's speed by the probes' mean, so that a model
    calibrated once is compared with runs on the machine it was calibrated on."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> None:
        self._time = lambda reps: compute_seconds(model, x, y, batch, reps)
        self.calibrated = self._time(300)
        self._reps = max(20, round(0.5 / self.calibrated))  # half a second

    def slowdown(self) -> float:
        """How many times slower one compute step runs now than at calibration."""
        return self._time(self._reps) / self.calibrated


def calibrate(args: argparse.Namespace) -> tuple[Costs, SpeedProbe]:
    torch.set_num_threads(1)
    dataset = datasets.load(args.dataset)
    x, y = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    model = build_model(args.model, dataset, 0)
    probe = SpeedProbe(model, x, y, args.batch_size)
    compute = probe.calibrated
    exchange = exchange_costs(model, x, y, args.batch_size, args.transport)
    size = sum(p.numel() for p in model.parameters())
    update, combine = update_seconds(size)
    server = max(0.0, exchange["server_cpu_s"] - update)
    latency = max(0.0, (exchange["step_wall_s"] - exchange["client_s"] - exchange["server_cpu_s"]) / 2)
    costs = Costs(
        compute,
        exchange["client_s"],
        server,
        update,
        combine,
        latency,
        hold_s=hold_seconds(size, args.transport),
        **cold_costs(args.model, args.dataset, args.batch_size, usable_cores()),
    )
    print(
        f"calibration ({args.model} on {args.dataset}, μ = {args.batch_size}, {size:,} parameters, {args.transport}):"
    )
    show(costs)
    return costs, probe


def show(costs: Costs) -> None:
    for name, value in vars(costs).items():
        print(f"  {name:10s} {1e3 * value:8.3f} ms")


def measure_all(args: argparse.Namespace, probe: SpeedProbe) -> dict:
    """The median of ``--reps`` real runs at every point of the validation (the two
    calibration points among them), in alternating rounds; each run's rates scaled to the
    calibration's speed (:class:`SpeedProbe`), its unscaled rates kept as ``raw_*``."""
    points = [(p, lam) for p in args.protocols.split(",") for lam in (int(v) for v in args.lambdas.split(","))]
    points += [point for point in sorted(CALIBRATION_POINTS) if point not in points]
    runs: dict = {point: [] for point in points}
    for _ in range(args.reps):
        for protocol, lam in points:
            before = probe.slowdown()
            run = measure(args, lam, protocol)
            slowdown = (before + probe.slowdown()) / 2
            for key in ("updates_per_s", "samples_per_s"):
                run[f"raw_{key}"], run[key] = run[key], run[key] * slowdown
            runs[(protocol, lam)].append({**run, "slowdown": slowdown})
    return {point: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for point, rs in runs.items()}


def measure(args: argparse.Namespace, learners: int, protocol: str) -> dict:
    """A real run: ``rudra-async train`` with λ learner processes (one torch thread each). Its
    steady state: the median of the server's per-second update counts (train's progress lines)
    over the seconds when all λ learners were connected and updates were made, the first and
    last left out (the learners start and end at different times); samples/s = updates/s × c × μ."""
    proc = subprocess.run(
        [sys.executable, "-m", "rudra_async", "train", "-l", str(learners), "--protocol", protocol,
         "-b", str(args.batch_size), "--epochs", str(args.epochs), "--model", args.model,
         "--dataset", args.dataset, "--transport", args.transport, "--threads", "1"],
        check=True, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    found = [(int(m.group(1)), int(m.group(2))) for m in PROGRESS.finditer(proc.stdout + proc.stderr)]
    rates = [rate for rate, connected in found if connected == learners and rate > 0]  # 0: still loading
    if len(rates) < 3:
        raise SystemExit(f"λ = {learners} {protocol}: under 3 s with every learner; give more --epochs")
    updates = statistics.median(rates[1:-1])
    return {
        "updates_per_s": updates,
        "samples_per_s": updates * gradients_per_update(protocol, learners) * args.batch_size,
    }


def validate(args: argparse.Namespace, costs: Costs, measured: dict) -> list[dict]:
    cores = usable_cores()
    rows = []
    print(f"\nvalidation on this machine ({cores} cores): measured (median of {args.reps}) vs predicted")
    print("| protocol | λ | updates/s measured | predicted | error | samples/s measured | predicted | error "
          "| slowdown | samples/s unscaled | error |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (protocol, lam), got in measured.items():
        pred = simulate(costs, lam, protocol, cores=cores, batch_size=args.batch_size)
        err_u = pred.updates_per_s / got["updates_per_s"] - 1
        err_s = pred.samples_per_s / got["samples_per_s"] - 1
        err_raw = pred.samples_per_s / got["raw_samples_per_s"] - 1
        rows.append({"protocol": protocol, "learners": lam, **got, "predicted_updates_per_s": pred.updates_per_s,
                     "predicted_samples_per_s": pred.samples_per_s})  # fmt: skip
        used = " (calibration)" if (protocol, lam) in CALIBRATION_POINTS else ""
        print(f"| {protocol} | {lam}{used} | {got['updates_per_s']:,.0f} | {pred.updates_per_s:,.0f} | {err_u:+.0%} "
              f"| {got['samples_per_s']:,.0f} | {pred.samples_per_s:,.0f} | {err_s:+.0%} "
              f"| {got['slowdown']:.2f} | {got['raw_samples_per_s']:,.0f} | {err_raw:+.0%} |")  # fmt: skip
    alone = [got["samples_per_s"] for (_, lam), got in measured.items() if lam == 1]
    if len(alone) > 1:  # one learner runs the same steps under every protocol
        print(f"noise floor: the {len(alone)} runs of one learner (the same work under each protocol) "
              f"differ by {max(alone) / min(alone) - 1:.0%}")  # fmt: skip
    return rows


def predict(args: argparse.Namespace, costs: Costs) -> dict:
    """Speedup over λ = 1 with one core per learner and one for the server, with this
    machine's switch cost and without it (a host whose wake-ups cost nothing: the bound)."""
    lambdas = [lam for lam in (1, 2, 4, 8, 16, 30, 32, 64) if lam <= args.predict_to]
    variants = {p: costs for p in args.protocols.split(",")}
    variants.update({f"{p}, no switch": replace(costs, switch_s=0.0) for p in args.protocols.split(",")})
    curves: dict[str, list[float]] = {}
    print("\npredicted speedup in samples/s over one learner, one core per learner and one for the server:")
    print("| λ | " + " | ".join(variants) + " |")
    print("| --- |" + " --- |" * len(variants))
    for lam in lambdas:
        row = []
        for name, variant in variants.items():
            protocol = name.split(",")[0]
            base = simulate(variant, 1, "async", cores=2, batch_size=args.batch_size).samples_per_s
            pred = simulate(
                variant, lam, protocol, cores=lam + 1, batch_size=args.batch_size, updates=max(2000, 40 * lam)
            )
            curves.setdefault(name, []).append(pred.samples_per_s / base)
            row.append(f"{pred.samples_per_s / base:.1f}×")
        print(f"| {lam} | " + " | ".join(row) + " |")
    return {"lambdas": lambdas, "speedup": curves}


#: the paper's reported speedup with 30 learners (../shared/PAPER.md): 22–28×
PAPER_SPEEDUP = (30, 22.0, 28.0)


def plot(directory: str, rows: list[dict], curves: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for protocol in dict.fromkeys(r["protocol"] for r in rows):
            mine = [r for r in rows if r["protocol"] == protocol]
            lams = [r["learners"] for r in mine]
            line = ax.plot(
                lams, [r["predicted_samples_per_s"] for r in mine], marker="o", label=f"{protocol}, predicted"
            )
            ax.plot(lams, [r["samples_per_s"] for r in mine], marker="x", linestyle="--", color=line[0].get_color(),
                    label=f"{protocol}, measured")  # fmt: skip
        _save(plt, fig, ax, out / "runtime_validation.png", "learners λ (this machine's cores)", "samples/s",
              "Runtime model against real runs")  # fmt: skip
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    for protocol, speedup in curves["speedup"].items():
        ax.plot(curves["lambdas"], speedup, marker="o", label=f"{protocol}, predicted")
    lam, low, high = PAPER_SPEEDUP
    ax.errorbar([lam], [(low + high) / 2], yerr=[[(high - low) / 2]], fmt="s", color="black", capsize=4,
                label="the paper, 30 learners")  # fmt: skip
    ax.plot(curves["lambdas"], curves["lambdas"], color="gray", linestyle=":", label="linear")
    _save(plt, fig, ax, out / "runtime_speedup.png", "learners λ (one core each, one for the server)",
          "speedup in samples/s over λ = 1", "Predicted speedup")  # fmt: skip


def _save(plt, fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label, legend, grid and write one figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=float, default=150)
    ap.add_argument("--lambdas", default="1,2,4,8")
    ap.add_argument("--protocols", default="async,hardsync")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--predict-to", type=int, default=64)
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument("--json", help="write the costs, the validation and the predictions here")
    ap.add_argument("--plot", metavar="DIR", help="draw the validation and the predicted speedup there")
    args = ap.parse_args()
    costs, probe = calibrate(args)
    rows = []
    if not args.no_validate:
        measured = measure_all(args, probe)
        costs = fitted(args, costs, measured, usable_cores())
        show(costs)
        rows = validate(args, costs, measured)
    curves = predict(args, costs)
    if args.json:
        measured_at = {
            "batch_size": args.batch_size,
            "model": args.model,
            "dataset": args.dataset,
            "transport": args.transport,
        }
        Path(args.json).write_text(
            json.dumps({"costs": vars(costs), **measured_at, "validation": rows, **curves}, indent=1)
        )
    if args.plot:
        plot(args.plot, rows, curves)


if __name__ == "__main__":
    main()

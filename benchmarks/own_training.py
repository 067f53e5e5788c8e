"""A user's own training, plain and on rudra-async, in one run: accuracy and useful samples/s.

Two workloads, each first as a plain single-process PyTorch run (the baseline), then with
λ learner processes on a server over ``--transport`` (shm by default) under each protocol,
with the plain run's own learning rate and momentum and the server's default LR policy:

- ``example``: examples/mnist_cnn.py (a BatchNorm CNN on MNIST-5k, a scheduler, two
  parameter groups, a frozen layer, label smoothing) against λ copies of
  examples/mnist_cnn_distributed.py and a ``rudra-async server`` process. Accuracy is that of
  the server's final checkpoint (``rudra-async evaluate --model --data``: trained weights,
  BatchNorm statistics and the frozen layer); samples/s is the samples the learners trained
  on (each its own part of the data: distinct samples), over the longest learner's loop.
- ``digits``: the digits MLP of ``rudra-async train`` (α0 0.03, momentum 0.9, μ 32, 30
  epochs) as a plain loop here, against ``rudra-async train -l λ``; samples/s is the server's
  samples over its first-to-last update time.

For the example it also runs λ copies of the plain script at once, one torch thread each:
what this host gives λ independent trainings, the bound of what λ learners can reach (on 2
cores it is less than 2× the plain run, which uses both cores itself). Prints one row per
run: test accuracy (and its difference from plain), useful samples/s and the ratio to plain;
each run is done ``--reps`` times, in alternating rounds, and the rows show medians.

    python benchmarks/own_training.py [--workloads example,digits] [--lambdas 2,4]
        [--protocols async,hardsync] [--transport shm] [--example-epochs 4] [--reps 1]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CLI = [sys.executable, "-m", "rudra_async"]
TRAINED = re.compile(r"trained (\d+) samples in ([\d.]+) s; test accuracy ([\d.]+)")


def run_example_plain(epochs: int, tmp: Path, copies: int = 1) -> dict:
    """The plain script (torch's default threads); with ``copies`` > 1, that many at once with
    one thread each: what this host gives λ independent trainings, the bound of λ learners."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if copies > 1 else None
    procs = [
        subprocess.Popen([sys.executable, str(EXAMPLES / "mnist_cnn.py"), "--epochs", str(epochs), "--checkpoint",
                          str(tmp / f"p{i}.pt")], stdout=subprocess.PIPE, text=True, env=env)
        for i in range(copies)
    ]  # fmt: skip
    found = [TRAINED.search(p.communicate(timeout=1800)[0]).groups() for p in procs]
    return {
        "accuracy": float(found[0][2]),
        "samples_per_s": sum(int(s) / float(t) for s, t, _ in found),
        "staleness_mean": 0.0,
    }


def run_example_distributed(epochs: int, learners: int, protocol: str, transport: str, tmp: Path) -> dict:
    address = f"shm://own-training-{os.getpid()}" if transport == "shm" else f"tcp://127.0.0.1:{_free_port()}"
    checkpoint = tmp / f"{protocol}-{learners}.rudra"
    server = subprocess.Popen(
        [*CLI, "server", "--listen", address, "--protocol", protocol, "--expected-learners", str(learners),
         "--momentum", "0.9", "--checkpoint", str(checkpoint)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        script = [sys.executable, str(EXAMPLES / "mnist_cnn_distributed.py"), "--server", address]
        procs = [
            subprocess.Popen([*script, "--epochs", str(epochs), "--checkpoint", str(tmp / f"l{i}.pt")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(learners)
        ]  # fmt: skip
        found = []
        for p in procs:
            out, err = p.communicate(timeout=1800)
            match = TRAINED.search(out)
            if p.returncode or match is None:
                raise RuntimeError(f"a learner failed (exit {p.returncode}):\n{err[-2000:]}")
            found.append(match.groups())
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=120)
    evaluated = subprocess.run(
        [*CLI, "evaluate", str(checkpoint), "--model", "mnist_cnn:model", "--data", "mnist_cnn:test_data", "--json"],
        cwd=EXAMPLES, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    stats = json.loads(err.strip().splitlines()[-1])
    return {
        "accuracy": json.loads(evaluated.stdout)["test_accuracy"],
        "learner_accuracy": [float(a) for _, _, a in found],
        "samples_per_s": sum(int(s) for s, _, _ in found) / max(float(t) for _, t, _ in found),
        "staleness_mean": stats["staleness_mean"],
    }


def run_digits_plain() -> dict:
    """The digits MLP as one plain process: train's recipe (model, data, sampling, steps)."""
    import torch
    from torch import nn

    from rudra_async.learner import data, models

    dataset = data.load("digits")
    torch.manual_seed(0)
    model = models.mlp(dataset.n_features, dataset.n_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    x, y = torch.from_numpy(dataset.x_train), torch.from_numpy(dataset.y_train)
    steps = math.ceil(30 * len(y) / 32)
    batches = data.minibatches(len(y), 32)
    started = time.perf_counter()
    for _ in range(steps):
        rows = torch.from_numpy(next(batches))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(dataset.x_test)).argmax(1) == torch.from_numpy(dataset.y_test)).float()
    return {"accuracy": accuracy.mean().item(), "samples_per_s": steps * 32 / seconds, "staleness_mean": 0.0}


def run_digits_distributed(learners: int, protocol: str, transport: str, tmp: Path) -> dict:
    results = tmp / f"digits-{protocol}-{learners}.json"
    subprocess.run(
        [*CLI, "train", "-q", "-l", str(learners), "--protocol", protocol, "--transport", transport,
         "--results", str(results)],
        check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    r = json.loads(results.read_text())
    return {"accuracy": r["test_accuracy"], "samples_per_s": r["samples_per_s"], "staleness_mean": r["staleness_mean"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="example,digits")
    ap.add_argument("--lambdas", default="2,4")
    ap.add_argument("--protocols", default="async,hardsync")
    ap.add_argument("--transport", default="shm")
    ap.add_argument("--example-epochs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    lambdas = [int(v) for v in args.lambdas.split(",")]
    protocols = args.protocols.split(",")
    print("| workload | run | test accuracy | vs plain | useful samples/s | vs plain | ⟨σ⟩ |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for workload in args.workloads.split(","):
            runs: dict[str, Callable[[], dict]] = {}
            if workload == "example":
                runs["plain, 1 process"] = lambda: run_example_plain(args.example_epochs, tmp)
                for lam in lambdas:  # the host's bound for λ learners: λ plain trainings at once
                    runs[f"{lam} plain processes at once, 1 thread each"] = functools.partial(
                        run_example_plain, args.example_epochs, tmp, lam
                    )
                for lam, proto in itertools.product(lambdas, protocols):
                    runs[f"{proto}, λ = {lam}, {args.transport}"] = functools.partial(
                        run_example_distributed, args.example_epochs, lam, proto, args.transport, tmp
                    )
            elif workload == "digits":
                runs["plain, 1 process"] = run_digits_plain
                for lam, proto in itertools.product(lambdas, protocols):
                    runs[f"{proto}, λ = {lam}, {args.transport}"] = functools.partial(
                        run_digits_distributed, lam, proto, args.transport, tmp
                    )
            else:
                raise SystemExit(f"unknown workload {workload!r}: example or digits")
            measured: dict[str, list[dict]] = {name: [] for name in runs}
            for _ in range(args.reps):  # rounds alternate between the runs: a shared host's drift spreads over all
                for name, run in runs.items():
                    measured[name].append(run())
            plain = measured["plain, 1 process"]
            base_acc, base_rate = _median(plain, "accuracy"), _median(plain, "samples_per_s")
            for name, rows in measured.items():
                acc, rate, sigma = (_median(rows, k) for k in ("accuracy", "samples_per_s", "staleness_mean"))
                print(
                    f"| {workload} | {name} | {acc:.4f} | {acc - base_acc:+.4f} | {rate:.0f} | "
                    f"{rate / base_rate:.2f} | {sigma:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()

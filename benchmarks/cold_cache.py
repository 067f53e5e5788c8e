"""What a learner's step costs more after it was away from the CPU while other processes ran:
the runtime model's ``Costs.cold_s`` and ``Costs.cold_tau_s``.

A process that blocks (a learner waiting for its reply) and is woken after others ran on its
core finds its caches holding their data, and refills them at its own CPU's expense: the
longer it was away, the more. This measures that on the machine at hand, with the model's
own training step: m processes pass ``cores`` tokens round a ring of pipes (each, holding a
token, runs one step and hands the token on), so each is away about (m/cores − 1) steps. For
m = cores + 1, 2·cores + 1, … it records each process's CPU per step and time away per step,
and fits CPU = base + cold·(1 − exp(−away/τ)) (τ on a log grid from the shortest time away
to the longest, base and cold ≥ 0 by least squares). ``base`` is left out: the calibration's switch cost, fitted on a real run of
2 learners, takes it in.

    python benchmarks/cold_cache.py [--model mlp] [--dataset digits] [--batch-size 16]

prints the points and the fit; :func:`cold_costs` returns ``{"cold_s": …, "cold_tau_s": …}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

RING_SECONDS = 1.5  # each ring's run
RINGS = (1, 2, 4, 8, 16)  # m = k·cores + 1 for each k
ROUNDS = 3  # each ring size is run this many times, alternating
TAU_STEPS = 41  # the τ grid: log-spaced from the shortest time away to the longest


def _ring_worker(step, steps: int, read_fd: int, write_fd: int, report_fd: int) -> None:
    """Take a token, run one step, hand it on; report CPU and time away per step (the first
    tenth left out as a start-up)."""
    skip = steps // 10
    cpu = away = 0.0
    left = time.perf_counter()
    for i in range(steps):
        os.read(read_fd, 1)
        woke, cpu0 = time.perf_counter(), time.process_time()
        step()
        if i >= skip:
            cpu += time.process_time() - cpu0
            away += woke - left
        left = time.perf_counter()
        os.write(write_fd, b"t")
    os.write(report_fd, f"{cpu / (steps - skip)} {away / (steps - skip)}\n".encode())


def ring(step, step_s: float, processes: int, cores: int) -> tuple[float, float]:
    """The median over ``processes`` forked workers of (CPU per step, time away per step)."""
    steps = max(20, round(RING_SECONDS / (processes / cores * step_s)))
    pipes = [os.pipe() for _ in range(processes)]
    report_r, report_w = os.pipe()
    children = []
    for i in range(processes):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - a child
            try:
                _ring_worker(step, steps, pipes[i][0], pipes[(i + 1) % processes][1], report_w)
            finally:
                os._exit(0)
        children.append(pid)
    for i in range(cores):  # the tokens
        os.write(pipes[i][1], b"t")
    for pid in children:
        os.waitpid(pid, 0)
    os.close(report_w)
    with os.fdopen(report_r) as reports:
        rows = [tuple(map(float, line.split())) for line in reports]
    for r, w in pipes:
        os.close(r)
        os.close(w)
    return statistics.median(c for c, _ in rows), statistics.median(a for _, a in rows)


def fit(points: list[tuple[float, float]]) -> dict:
    """The least-squares (base, cold, τ) of CPU = base + cold·(1 − exp(−away/τ)) over
    (away, CPU) ``points``, base and cold ≥ 0, τ within the times away measured: a refill
    that has not levelled off within them is not extrapolated, and one that would have
    levelled off before the shortest cannot be told from ``base`` (a model whose steps are
    all away longer than τ saw the whole refill at every ring size: a flat line, which a
    τ below them fits with any split of base and cold; one run of the CNN put 3.9 ms in cold)."""
    away = np.array([a for a, _ in points])
    cpu = np.array([c for _, c in points])
    best = None
    for tau in np.geomspace(away.min(), away.max(), TAU_STEPS):
        shape = 1 - np.exp(-away / tau)
        design = np.stack([np.ones_like(shape), shape], axis=1)
        (base, cold), *_ = np.linalg.lstsq(design, cpu, rcond=None)
        if cold < 0:
            base, cold = float(np.mean(cpu)), 0.0
        if base < 0:
            base, cold = 0.0, float(max(0.0, shape @ cpu / max(shape @ shape, 1e-30)))
        residual = float(np.sum((base + cold * shape - cpu) ** 2))
        if best is None or residual < best[0]:
            best = (residual, base, cold, tau)
    _, base, cold, tau = best
    return {"base_s": float(base), "cold_s": float(cold), "cold_tau_s": float(tau)}


def measure(model: str, dataset: str, batch_size: int, cores: int) -> dict:
    """The ring at every m of :data:`RINGS` (:data:`ROUNDS` times, alternating), and the fit."""
    import torch

    from rudra_async.learner import data as datasets
    from rudra_async.learner.evaluation import build_model

    torch.set_num_threads(1)
    data = datasets.load(dataset)
    x, y = torch.from_numpy(data.x_train[:batch_size]), torch.from_numpy(data.y_train[:batch_size])
    net = build_model(model, data, 0)

    def step() -> None:
        net.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()

    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(50):
        step()
    step_s = (time.perf_counter() - t0) / 50
    points = []
    for _ in range(ROUNDS):
        for k in RINGS:
            cpu, away = ring(step, step_s, k * cores + 1, cores)
            points.append((away, cpu))
    return {"points": points, **fit(points)}


def cold_costs(model: str, dataset: str, batch_size: int, cores: int) -> dict:
    """``{"cold_s", "cold_tau_s"}`` measured in a fresh process (it forks its ring's workers,
    which is only safe from a process that has started no threads)."""
    out = subprocess.run(
        [sys.executable, __file__, "--model", model, "--dataset", dataset, "--batch-size", str(batch_size),
         "--cores", str(cores), "--json"],
        check=True, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    found = json.loads(out.stdout)
    return {"cold_s": found["cold_s"], "cold_tau_s": found["cold_tau_s"]}


def main() -> None:
    from rudra_async.server.store import usable_cores

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--cores", type=int, default=0, help="default: the cores this process may use")
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()
    found = measure(args.model, args.dataset, args.batch_size, args.cores or usable_cores())
    if args.json:
        print(json.dumps(found))
        return
    print("| time away per step | CPU per step |\n| --- | --- |")
    for away, cpu in sorted(found["points"]):
        print(f"| {1e3 * away:.3f} ms | {1e3 * cpu:.3f} ms |")
    print(f"fit: base {1e3 * found['base_s']:.3f} ms + cold {1e3 * found['cold_s']:.3f} ms "
          f"× (1 − exp(−away / {1e3 * found['cold_tau_s']:.3f} ms))")  # fmt: skip


if __name__ == "__main__":
    main()

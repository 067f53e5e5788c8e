"""Candidate rules for asynchronous SGD with a one-process recipe: a screening model, and the
table of the real server's runs.

**Screening** (the default): a parameter server written here in a few lines of PyTorch, so
that a candidate rule is a few lines too: λ learners compute gradients on the weights they
pulled, each taking 1 ± 10% virtual time (homogeneous: σ ≈ λ − 1), each on its part of the
data (a per-epoch permutation, as rt.ShardSampler), and the server applies each gradient at
once with momentum SGD (torch.optim.SGD's convention). The recipe is the one-process one
(its rate α and momentum β). Rules (f: the gradient's factor; β': the update's momentum):

- ``constant``: f = 1. ``staleness``: f = 1/σ (1 at σ = 0; Zhang et al. 2016).
  ``staleness-plus-one``: f = 1/(σ + 1).
- ``mitliagkas``: β' = max(0, β − (1 − 1/λ)), asynchrony's implicit momentum taken off
  (Mitliagkas et al. 2016).
- ``per-learner``: one momentum buffer per learner ("shifted momentum", Giladi et al. 2020).
- ``dana``: per-learner buffers and pulls at the look-ahead θ − ηβ·Σv (Hakimi et al. 2019).
- ``dc-asgd``: f = 1/(σ + 1) and g + 0.04·g⊙g⊙(θ_now − θ_stamp) (Zheng et al. 2017).
- ``compensated``: β' = max(0, 1 − (1 − β)λ) with a warm-up over 64(λ − 1) updates: the
  server's default, modelled with σ = λ − 1.
- ``hardsync``: the average of λ gradients per update.

**Validation** (``--results FILE``): the table of a study's results.jsonl, e.g. of
examples/study_async_default.toml, whose points run through the real server.

    python benchmarks/async_rules.py [--workloads digits-mlp,mnist-mlp,mnist-bn-cnn]
        [--rules constant,...] [--lambdas 1,2,4,8] [--seeds 0,1]
    python benchmarks/async_rules.py --results study-async-default/results.jsonl
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

RULES = (
    "constant",
    "staleness",
    "staleness-plus-one",
    "mitliagkas",
    "per-learner",
    "dana",
    "dc-asgd",
    "compensated",
    "hardsync",
)


@dataclass(frozen=True)
class Workload:
    dataset: str
    model: str
    lr: float
    epochs: int
    momentum: float = 0.9
    batch: int = 32


WORKLOADS = {
    "digits-mlp": Workload("digits", "mlp", 0.03, 30),
    "mnist-mlp": Workload("mnist5k", "mlp", 0.05, 10),
    "mnist-bn-cnn": Workload("mnist5k", "bn_cnn", 0.02, 4),
    "digits-bn-cnn": Workload("digits", "bn_cnn", 0.05, 5),
}


class Server:
    """The update of every rule: weights θ, shared or per-learner momentum, the clock."""

    def __init__(self, weights: list, rule: str, lr: float, beta: float, lam: int) -> None:
        import torch

        self.torch = torch
        self.theta = [w.detach().clone() for w in weights]
        self.shared = [torch.zeros_like(w) for w in weights]
        self.own: dict[int, list] = {}
        self.rule, self.lr, self.beta, self.lam, self.clock = rule, lr, beta, lam, 0
        self.sigmas: list[int] = []

    def factor(self, sigma: int) -> float:
        if self.rule == "staleness":
            return 1.0 / sigma if sigma > 0 else 1.0
        if self.rule in ("staleness-plus-one", "dc-asgd"):
            return 1.0 / (sigma + 1)
        return 1.0

    def momentum(self) -> float:
        if self.rule == "mitliagkas":
            return max(0.0, self.beta - (1 - 1 / self.lam))
        if self.rule == "compensated":
            return max(0.0, 1 - (1 - self.beta) * self.lam)
        return self.beta

    def rate(self) -> float:
        warm = 64 * (self.lam - 1) if self.rule == "compensated" else 0
        return self.lr * (min(1.0, (self.clock + 1) / warm) if warm else 1.0)

    def pulled(self) -> list:
        """The weights a learner computes on next (DANA: its look-ahead)."""
        weights = [w.clone() for w in self.theta]
        if self.rule == "dana":
            for buffers in self.own.values():
                for w, v in zip(weights, buffers):
                    w.add_(v, alpha=-self.lr * self.beta)
        return weights

    def apply(self, grads: list[list], stamps: list[int], learner: int, stale: list | None = None) -> None:
        sigmas = [self.clock - s for s in stamps]
        self.sigmas += sigmas
        beta, rate, c = self.momentum(), self.rate(), len(grads)
        buffers = (
            self.own.setdefault(learner, [self.torch.zeros_like(w) for w in self.theta])
            if self.rule in ("per-learner", "dana")
            else self.shared
        )
        for k, w in enumerate(self.theta):
            g = sum(self.factor(s) / c * gs[k] for s, gs in zip(sigmas, grads))
            if self.rule == "dc-asgd" and stale is not None:
                g = g + 0.04 * g * g * (w - stale[k])
            if beta:
                buffers[k].mul_(beta).add_(g)
                w.add_(buffers[k], alpha=-rate)
            else:
                w.add_(g, alpha=-rate)
        self.clock += 1


def screen(name: str, rule: str, lam: int, seed: int, jitter: float = 0.1) -> dict:
    """One run of ``rule`` with λ learners on workload ``name``: test accuracy and ⟨σ⟩."""
    import torch
    from torch import nn

    from rudra_async.learner import data, models

    torch.set_num_threads(1)
    w = WORKLOADS[name]
    ds = data.load(w.dataset)
    x, y = torch.from_numpy(ds.x_train), torch.from_numpy(ds.y_train)
    torch.manual_seed(seed)
    model = models.resolve(w.model)(ds.n_features, ds.n_classes)
    params = list(model.parameters())
    server = Server(params, "constant" if rule == "hardsync" else rule, w.lr, w.momentum, lam)
    steps = w.epochs * len(y) // (lam * w.batch)
    batches = [data.minibatches(len(y), w.batch, i, lam, seed) for i in range(lam)]

    def gradient(weights: list, learner: int) -> list:
        with torch.no_grad():
            for p, v in zip(params, weights):
                p.copy_(v)
        model.zero_grad()
        rows = torch.from_numpy(next(batches[learner]))
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        return [p.grad.detach().clone() for p in params]

    model.train()
    rng = np.random.default_rng(seed)
    if rule == "hardsync":
        for _ in range(steps):
            weights = server.pulled()
            server.apply([gradient(weights, i) for i in range(lam)], [server.clock] * lam, 0)
    else:
        queue = [(1 + jitter * rng.standard_normal(), i) for i in range(lam)]
        heapq.heapify(queue)
        held = {i: (server.clock, server.pulled()) for i in range(lam)}
        done = [0] * lam
        while queue:
            now, i = heapq.heappop(queue)
            stamp, weights = held[i]
            server.apply([gradient(weights, i)], [stamp], i, stale=weights)
            done[i] += 1
            if done[i] < steps:
                held[i] = (server.clock, server.pulled())
                heapq.heappush(queue, (now + max(0.1, 1 + jitter * rng.standard_normal()), i))
    with torch.no_grad():
        for p, v in zip(params, server.theta):
            p.copy_(v)
        model.eval()
        correct = (model(torch.from_numpy(ds.x_test)).argmax(1) == torch.from_numpy(ds.y_test)).float().mean()
    finite = all(bool(torch.isfinite(v).all()) for v in server.theta)
    return {
        "accuracy": float(correct) if finite else 0.0,
        "staleness_mean": float(np.mean(server.sigmas)) if server.sigmas else 0.0,
    }


def table(cells: dict[tuple[str, str, int], list[float]], rules: list[str], lambdas: list[int]) -> None:
    """Mean test accuracy (min–max over seeds) per workload, rule and λ, as Markdown."""
    workloads = sorted({w for w, _, _ in cells})
    print("| workload | rule | " + " | ".join(f"λ = {lam}" for lam in lambdas) + " |")
    print("| --- | --- |" + " --- |" * len(lambdas))
    for workload in workloads:
        for rule in rules:
            row = []
            for lam in lambdas:
                got = cells.get((workload, rule, lam))
                row.append(f"{statistics.mean(got):.3f} ({min(got):.2f}–{max(got):.2f})" if got else "")
            if any(row):
                print(f"| {workload} | {rule} | " + " | ".join(row) + " |")


def from_results(path: str) -> None:
    cells: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    for r in rows:
        rule = "hardsync" if r["protocol"] == "hardsync" else r["lr_policy"]
        dc = r["point"].get("dc_lambda")
        rule += f" + dc {dc:g}" if dc else ""  # delay compensation (--dc-lambda)
        cells[(r["group"], rule, r["learners"])].append(1.0 - r["test_error"])
    lambdas = sorted({lam for _, _, lam in cells})
    found = list(dict.fromkeys(k[1] for k in cells))
    order = {rule: i for i, rule in enumerate(RULES)}  # then any other (a plugin's), by name
    table(cells, sorted(found, key=lambda rule: (order.get(rule.split(" +")[0], len(RULES)), rule)), lambdas)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="digits-mlp,mnist-mlp,mnist-bn-cnn")
    ap.add_argument("--rules", default=",".join(RULES))
    ap.add_argument("--lambdas", default="2,4,8")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--results", help="tabulate a study's results.jsonl instead of screening")
    args = ap.parse_args()
    if args.results:
        from_results(args.results)
        return
    rules, lambdas = args.rules.split(","), [int(v) for v in args.lambdas.split(",")]
    cells: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for workload in args.workloads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            cells[(workload, "one process", 1)].append(screen(workload, "constant", 1, seed)["accuracy"])
            for lam in lambdas:
                for rule in rules:
                    cells[(workload, rule, lam)].append(screen(workload, rule, lam, seed)["accuracy"])
    table(cells, ["one process", *rules], [1, *lambdas])


if __name__ == "__main__":
    main()

"""The study report: Markdown tables, PNG plots, and a verdict per finding of the paper.

Which group of runs answers which question is named in the spec's ``[report]`` table:

- ``staleness``: softsync runs over n (constant and staleness-aware LR, plus optionally a
  hardsync reference at the same λ, μ) → findings 1, 2 and 3;
- ``hardsync_batch`` / ``softsync_batch``: runs over μ and λ (and n) → finding 4;
- ``runtime``: real-process runs of hardsync and async over λ → finding 5.

Each verdict states its criterion and the numbers; a finding that does not reproduce is
reported as such. Numbers from simulated runs are accuracy and staleness only; times come
from runs in ``processes`` mode.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import platform
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def fmt(value: Any) -> str:
    """A number as the report shows it: floats to 3 decimals, None or NaN (not measured) as n/a,
    a :class:`Spread` as its mean ± its standard deviation (the mean alone for one run)."""
    if isinstance(value, Spread):
        return fmt(value.mean) if value.runs < 2 or math.isnan(value.mean) else f"{value.mean:.3f} ± {value.sd:.3f}"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


class Spread:
    """Test errors of the runs of one point over seeds: their mean, standard deviation
    (population, 0 for one run) and how many were measured (NaN mean: none)."""

    def __init__(self, xs: list[float | None]) -> None:
        measured = [x for x in xs if x is not None]
        self.runs = len(measured)
        self.mean = float(np.mean(measured)) if measured else float("nan")
        self.sd = float(np.std(measured)) if measured else float("nan")


def _mean(xs: list[float | None]) -> float:
    """The mean of the measured values (None: not measured, e.g. the test error of a run with
    its own data function); NaN if none is."""
    measured = [x for x in xs if x is not None]
    return float(np.mean(measured)) if measured else float("nan")


def _errors_by(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, float]:
    """The mean test error per ``key``, of the keys with at least one measured test error."""
    return {k: s.mean for k, s in _spreads_by(runs, key).items()}


def _spreads_by(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, Spread]:
    """The test errors per ``key`` over seeds, of the keys with at least one measured test error."""
    measured = [r for r in runs if r["test_error"] is not None]
    return {k: Spread([r["test_error"] for r in rs]) for k, rs in _by(measured, key).items()}


def _ranks(xs: list[float]) -> np.ndarray:
    """The ranks 1..len(xs) of ``xs``, tied values sharing the mean of their ranks."""
    _, inverse, counts = np.unique(np.asarray(xs, float), return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # the rank of the last of each group of equal values
    return (last - (counts - 1) / 2)[inverse]


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank); NaN where undefined: fewer
    than two values, or every x or every y the same."""
    if len(x) < 2:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _rho(rho: float) -> str:
    """ρ as a verdict states it."""
    return "ρ undefined: one of the two series is constant" if math.isnan(rho) else f"ρ = {rho:.2f}"


def _n(run: dict[str, Any]) -> int | None:
    """The n of a softsync run (softsync's default, 1, where the spec gives none); None otherwise."""
    return int(run["point"].get("n", 1)) if run["protocol"] == "softsync" else None


def _hist(runs: list[dict[str, Any]]) -> dict[int, int]:
    total: dict[int, int] = defaultdict(int)
    for r in runs:
        for s, c in r["staleness_histogram"].items():
            total[int(s)] += c
    return dict(total)


def _frac_at_most(hist: dict[int, int], bound: float) -> float:
    n = sum(hist.values())
    return sum(c for s, c in hist.items() if s <= bound) / n if n else float("nan")


def _by(runs: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[key(r)].append(r)
    return dict(sorted(out.items(), key=lambda kv: kv[0]))


def _verdict(ok: bool | None) -> str:
    return {True: "**reproduced**", False: "**not reproduced**", None: "**not measured**"}[ok]


class _Report:
    def __init__(self, out: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        self.plt = plt
        self.out = out
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.add("| " + " | ".join(header) + " |", "|" + "---|" * len(header))
        self.add(*("| " + " | ".join(fmt(v) for v in row) + " |" for row in rows))
        self.add("")

    def figure(self, name: str, draw: Callable[[Any], None]) -> None:
        fig, ax = self.plt.subplots(figsize=(6, 3.6), dpi=110)
        draw(ax)
        if ax.get_legend_handles_labels()[0]:  # something was drawn
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out / name)
        self.plt.close(fig)
        self.add(f"![{name}]({name})", "")


#: the LR policies findings 2 and 3 compare, by the name the report gives them
POLICIES = {"constant": "α0", "staleness": "α0/σ", "mean-staleness": "α0/⟨σ⟩"}


def _setting(run: dict[str, Any]) -> tuple[int, int]:
    """A run's learners and mini-batch size, (λ, μ): what findings 1-3 hold fixed while n varies."""
    return run["learners"], run["batch_size"]


def _staleness_section(rep: _Report, runs: list[dict[str, Any]]) -> None:
    """Findings 1-3 once per setting (λ, μ) of the group's softsync runs, each against the
    hardsync runs of that same setting, so that no table row, verdict, curve or reference mixes
    runs of different λ or μ. With one setting the headings and figure names are the plain ones;
    with several, each section's headings and titles name its λ and μ and its figures' file names
    end in ``_lambda<λ>_mu<μ>``. Hardsync runs of a setting with no softsync run are not used."""
    soft = [r for r in runs if r["protocol"] == "softsync"]
    if not soft:
        rep.add("No softsync runs in the staleness group.", "")
        return
    settings = _by(soft, _setting)
    for (lam, mu), rs in settings.items():
        hard = [r for r in runs if r["protocol"] == "hardsync" and _setting(r) == (lam, mu)]
        _staleness_findings(rep, rs, hard, lam, mu if len(settings) > 1 else None)


def _staleness_findings(
    rep: _Report, soft: list[dict[str, Any]], hard: list[dict[str, Any]], lam: int, mu: int | None
) -> None:
    """Findings 1-3 for softsync runs ``soft`` of λ = ``lam`` and one μ and hardsync runs ``hard``
    of the same λ and μ; ``mu`` (None: the group has no other setting) is named in every heading
    and plot title and ends every figure's file name stem."""
    tag = "" if mu is None else f" (λ = {lam}, μ = {mu})"
    note = "" if mu is None else f", μ = {mu}"
    suffix = "" if mu is None else f"_lambda{lam}_mu{mu}"
    by_n = _by(soft, _n)
    rep.add(f"## 1. n-softsync bounds staleness: ⟨σ⟩ ≈ n, σ ≤ 2n almost always{tag}", "")
    rows, ok = [], True
    for n, rs in by_n.items():
        h = _hist(rs)
        mean = sum(s * c for s, c in h.items()) / sum(h.values())
        frac = _frac_at_most(h, 2 * n)
        ok &= 0.5 <= mean / n <= 1.5 and frac >= 0.95
        rows.append([n, lam, mean, mean / n, max(h), frac])
    rep.add(f"Criterion: 0.5 ≤ ⟨σ⟩/n ≤ 1.5 and P(σ ≤ 2n) ≥ 0.95 for every n. Verdict: {_verdict(ok)}.", "")
    rep.table(["n", "λ", "⟨σ⟩", "⟨σ⟩/n", "max σ", "P(σ ≤ 2n)"], rows)

    def draw(ax: Any) -> None:
        for n, rs in by_n.items():
            h = _hist(rs)
            xs = np.arange(max(h) + 1)
            ys = np.array([h.get(int(x), 0) for x in xs], float)
            ax.plot(xs, ys / ys.sum(), marker=".", label=f"n={n}")
        ax.set_xlabel("staleness σ")
        ax.set_ylabel("fraction of gradients")
        ax.set_title(f"Staleness distribution, {lam}-learner n-softsync{note}")

    rep.figure(f"staleness_distribution{suffix}.png", draw)

    policies = _by(soft, lambda r: r["lr_policy"])
    hard_spread = Spread([r["test_error"] for r in hard])
    hard_err = hard_spread.mean  # NaN: no hardsync run measured one
    spreads = {name: _spreads_by(policies.get(policy, []), _n) for policy, name in POLICIES.items()}
    const = {n: s.mean for n, s in spreads["α0"].items()}
    aware = {name: {n: s.mean for n, s in spreads[name].items()} for name in ("α0/σ", "α0/⟨σ⟩") if spreads[name]}
    rep.add(f"## 2. With a fixed α0, error rises with n and the largest n fails{tag}", "")
    if len(const) >= 2:
        ns = sorted(const)
        rho = spearman(ns, [const[n] for n in ns])
        ok2 = rho > 0 and (const[ns[-1]] >= 0.5 or const[ns[-1]] - const[ns[0]] >= 0.05)
        rep.add(
            f"Criterion: error increases with n (Spearman ρ > 0; here {_rho(rho)}) and the largest n has error "
            f"≥ 0.5 or at least 5 points worse than the smallest (here {const[ns[-1]]:.3f} vs {const[ns[0]]:.3f}). "
            f"Verdict: {_verdict(ok2)}.",
            "",
        )
    else:
        rep.add(f"Verdict: {_verdict(None)} (needs constant-α runs for at least two n).", "")
    rep.add(f"## 3. With {' and '.join(aware) or 'α0/σ'} every n lands close to hardsync's error{tag}", "")
    if aware and not math.isnan(hard_err):
        for name, errs in aware.items():
            worst = max(errs.values()) - hard_err
            rep.add(
                f"Criterion: every n with {name} within 3 points of hardsync's error ({hard_err:.3f}); the largest "
                f"gap is {worst:+.3f}. Verdict: {_verdict(worst <= 0.03)}.",
                "",
            )
    else:
        rep.add(f"Verdict: {_verdict(None)} (needs α0/σ runs and a hardsync reference with test errors).", "")
    shown = [name for name in POLICIES.values() if name == "α0/σ" or spreads[name]]  # α0/σ's column always
    ns = sorted({n for name in shown for n in spreads[name]})
    rep.table(
        ["n", *(f"test error, {name}" for name in shown)] + (["hardsync"] if hard else []),
        [[n, *(spreads[name].get(n, float("nan")) for name in shown)] + ([hard_spread] if hard else []) for n in ns],
    )

    def draw_err(ax: Any) -> None:
        for name in shown:
            errs = spreads[name]
            if errs:
                label = "fixed α0" if name == "α0" else name
                ax.errorbar(list(errs), [s.mean for s in errs.values()], yerr=[s.sd for s in errs.values()],
                            marker="o", capsize=3, label=label)  # fmt: skip
        if not math.isnan(hard_err):
            ax.axhline(hard_err, color="gray", linestyle="--", label="hardsync")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (softsync)")
        ax.set_ylabel("test error")
        ax.set_title(f"Test error per n, λ = {lam}{note}")

    rep.figure(f"error_per_n{suffix}.png", draw_err)


def _batch_section(rep: _Report, hard: list[dict[str, Any]], soft: list[dict[str, Any]]) -> None:
    rep.add("## 4. Hardsync behaves like SGD with batch μλ; for softsync μ⟨σ⟩ plays that role", "")
    hard_pts = _errors_by(hard, lambda r: r["batch_size"] * r["learners"])
    soft_pts = sorted(
        (r["batch_size"] * max(r["staleness_mean"], 1e-9), r["test_error"], r["batch_size"], _n(r))
        for r in soft
        if r["test_error"] is not None
    )
    rho_h = spearman(list(hard_pts), list(hard_pts.values())) if hard_pts else float("nan")
    rho_s = spearman([p[0] for p in soft_pts], [p[1] for p in soft_pts]) if soft_pts else float("nan")
    # "tracks" also means: runs with about the same μ⟨σ⟩ (within ×1.25) have about the same error
    spread = max(
        (abs(a[1] - b[1]) for a in soft_pts for b in soft_pts if b[0] <= a[0] * 1.25 and a[0] <= b[0] * 1.25),
        default=float("nan"),
    )
    soft_ok = bool(rho_s > 0 and spread <= 0.1) if soft_pts else None
    rep.add("Softsync runs with a constant α0 only (the rate modulation is meant to undo this effect).", "")
    rep.add(
        f"Criterion: error grows with μλ for hardsync (Spearman {_rho(rho_h)}) — "
        f"{_verdict(bool(rho_h > 0) if hard_pts else None)}; for softsync, error grows with μ⟨σ⟩ ({_rho(rho_s)}) "
        f"and runs with about the same μ⟨σ⟩ (within ×1.25) differ by at most 0.1 in error (largest difference "
        f"{fmt(spread)}) — {_verdict(soft_ok)}.",
        "",
    )
    if hard_pts:
        rep.table(["μλ (hardsync)", "test error"], [[k, v] for k, v in hard_pts.items()])
    if soft_pts:
        rep.table(["μ", "n", "μ⟨σ⟩ (softsync)", "test error"], [[p[2], p[3], p[0], p[1]] for p in soft_pts])

    def draw(ax: Any) -> None:
        if hard_pts:
            ax.plot(list(hard_pts), list(hard_pts.values()), marker="o", label="hardsync: x = μλ")
        if soft_pts:
            ax.scatter([p[0] for p in soft_pts], [p[1] for p in soft_pts], color="C1", label="softsync: x = μ⟨σ⟩")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("μλ (hardsync) or μ⟨σ⟩ (softsync)")
        ax.set_ylabel("test error")
        ax.set_title("Effective batch and test error")

    rep.figure("error_vs_effective_batch.png", draw)


def _runtime_section(rep: _Report, runs: list[dict[str, Any]]) -> None:
    rep.add("## 5. Asynchronous protocols run faster than hardsync; speedup grows with λ", "")
    real = [r for r in runs if r.get("mode") == "processes"]
    if not real:
        rep.add(f"Verdict: {_verdict(None)} (no runs in processes mode).", "")
        return
    by_proto = _by(real, lambda r: r["protocol"])
    rates = {
        p: {lam: _mean([r["samples_per_s"] for r in rs]) for lam, rs in _by(v, lambda r: r["learners"]).items()}
        for p, v in by_proto.items()
    }
    lams = sorted({lam for v in rates.values() for lam in v})
    rows = []
    for lam in lams:
        row = [lam]
        for p in sorted(rates):
            base = rates[p].get(min(rates[p]))
            rate = rates[p].get(lam, float("nan"))
            row += [rate, rate / base if base else float("nan")]
        rows.append(row)
    header = ["λ"] + [x for p in sorted(rates) for x in (f"{p} samples/s", f"{p} speedup")]
    faster = None
    if "async" in rates and "hardsync" in rates:
        common = [lam for lam in lams if lam > 1 and lam in rates["async"] and lam in rates["hardsync"]]
        faster = bool(common) and all(rates["async"][lam] > rates["hardsync"][lam] for lam in common)
    growing = None
    if "async" in rates and len(rates["async"]) >= 2:
        growing = all(rates["async"][b] > rates["async"][a] for a, b in itertools.pairwise(sorted(rates["async"])))
    rep.add(
        f"Measured with real learner processes on this machine ({os.cpu_count()} cores), training time only "
        "(from the first to the last update). Criterion: async processes more samples per second than "
        f"hardsync at every λ > 1 — {_verdict(faster)}; async throughput grows with every added learner — "
        f"{_verdict(growing)}.",
        "",
    )
    rep.table(header, rows)

    def draw(ax: Any) -> None:
        for p in sorted(rates):
            ax.plot(list(rates[p]), list(rates[p].values()), marker="o", label=p)
        ax.set_xlabel("learners λ (processes)")
        ax.set_ylabel("samples / s")
        ax.set_title(f"Throughput on {os.cpu_count()} cores")

    rep.figure("runtime_vs_learners.png", draw)


def write_report(spec: dict[str, Any], spec_path: str, results: list[dict[str, Any]], out: Path) -> Path:
    rep = _Report(out)
    meta = spec.get("study", {})
    cfg = spec.get("report", {})
    groups = _by(results, lambda r: r["group"])
    modes = sorted({r.get("mode", "?") for r in results})
    rep.add(
        f"# {meta.get('name', 'rudra-async study')}",
        "",
        f"Produced by `rudra-async study {spec_path}` ({len(results)} runs; modes: {', '.join(modes)}) on "
        f"{datetime.date.today().isoformat()}, Python {platform.python_version()}, {os.cpu_count()} CPU cores. "
        "Raw results: `results.jsonl` beside this file (one JSON line per run).",
        "",
    )
    if meta.get("description"):
        rep.add(str(meta["description"]).strip(), "")
    rep.add(
        "Simulated runs (λ learners as tasks in one process, deterministic scheduler, homogeneous speeds "
        "unless stated) give accuracy and staleness; only runs in `processes` mode give times.",
        "",
    )
    _staleness_section(rep, groups.get(cfg.get("staleness", ""), []))
    hard_batch = [r for r in groups.get(cfg.get("hardsync_batch", ""), []) if r["protocol"] == "hardsync"]
    soft_batch = [
        r
        for r in groups.get(cfg.get("softsync_batch", ""), [])
        if r["protocol"] == "softsync" and r["lr_policy"] == "constant"
    ]
    _batch_section(rep, hard_batch, soft_batch)
    _runtime_section(rep, groups.get(cfg.get("runtime", ""), []))
    rep.add("## All runs", "")
    rep.table(
        ["group", "mode", "protocol", "n", "λ", "μ", "LR policy", "α0", "updates", "⟨σ⟩", "max σ", "test error"],
        [
            [
                r["group"],
                r.get("mode"),
                r["protocol"],
                _n(r) or "",
                r["learners"],
                r["batch_size"],
                r["lr_policy"],
                r["lr"],
                r["updates"],
                r["staleness_mean"],
                r["staleness_max"],
                r["test_error"],
            ]
            for r in results
        ],
    )
    if cfg.get("notes"):
        rep.add("## Notes", "", str(cfg["notes"]).strip(), "")
    path = out / "report.md"
    path.write_text("\n".join(rep.lines))
    return path

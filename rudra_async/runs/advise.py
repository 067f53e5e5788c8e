"""``rudra-async advise``: which protocol, n, μ and learning-rate policy to train with
(docs/study/advise.md).

The user states the run they intend (train's settings: data, model, λ, rate, momentum,
epochs) and what they want: the lowest error, or the fastest run within ``tolerance`` of it
(the default), or the fastest under a ``target_error``, or the lowest error within a
``budget_s``. Every candidate (protocol × n × μ × policy) is

1. screened by the rule behind the start-up warnings (:func:`rudra_async.advice.risks`):
   a candidate they would warn about is never recommended;
2. timed by the runtime model (:mod:`.runtime_model`) from measured costs
   (``benchmarks/runtime_model.py --json``; a learner's compute scales with μ, the rest
   does not) on ``cores`` cores: samples/s, and the run's time for its samples;
3. given its accuracy evidence: the test errors of the recorded runs (study results, or a
   quick simulated sweep advise runs itself) whose settings are the intended run's with the
   candidate's (seeds and settings that only processes use aside).

Nothing is recommended without evidence. With ``overlap`` every protocol but hardsync is a
candidate with ``--overlap`` too (its evidence comes from runs of processes: a simulation
cannot overlap). Adaptive softsync is not a candidate: the runtime model does not know it.
"""

from __future__ import annotations

import json
import shlex
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import registry
from ..advice import risks
from ..config import TrainConfig
from ..errors import ConfigError
from ..options import command_line, to_flat
from .runtime_model import Costs, simulate
from .study import POINT_KEYS, load_results, run_id, run_point, to_config

#: the knobs advise chooses; the rest of a record's settings must equal the intended run's
CHOSEN = ("protocol", "n", "lr_policy", "batch_size")
#: the recorded settings a comparison ignores: repeats, and what only learner processes use
IGNORED = ("seed", "transport", "threads", "timeout", "reconnect", "tensorboard", "run_timeout", "shards")
POLICIES = ("compensated", "staleness", "mean-staleness", "constant")
#: predicted times closer than this (relative) count as equal: the runtime model's
#: validation error on this project's machines is 5–25% (docs/study/runtime_model.md)
SAME_TIME = 0.05
OBJECTIVES = ("best", "target_error", "budget_s")


@dataclass(frozen=True)
class Candidate:
    protocol: str
    n: int | None
    lr_policy: str
    batch_size: int
    overlap: bool = False

    def label(self) -> str:
        proto = f"softsync n={self.n}" if self.protocol == "softsync" else self.protocol
        return f"{proto}, μ={self.batch_size}, {self.lr_policy}" + (", overlap" if self.overlap else "")


@dataclass
class Row:
    """A candidate's verdict: why it is excluded (empty: it is not), its predicted rates and
    time, and the errors of the runs it matched (their ids)."""

    candidate: Candidate
    excluded: list[str] = field(default_factory=list)
    samples_per_s: float | None = None
    staleness: float | None = None
    runtime_s: float | None = None
    errors: list[float] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)

    @property
    def error(self) -> float | None:
        return statistics.fmean(self.errors) if self.errors else None

    def as_dict(self) -> dict[str, Any]:
        spread = statistics.stdev(self.errors) if len(self.errors) > 1 else None
        return {**vars(self.candidate), "excluded": self.excluded, "predicted_samples_per_s": self.samples_per_s,
                "predicted_staleness": self.staleness, "predicted_runtime_s": self.runtime_s,
                "test_error": self.error, "test_error_sd": spread, "runs": len(self.errors),
                "evidence": self.evidence}  # fmt: skip


def candidates(
    learners: int, batch_sizes: Iterable[int], policies: Iterable[str], overlap: bool = False
) -> list[Candidate]:
    """hardsync, n-softsync for every n dividing λ (c = λ/n gradients an update, as the
    paper's n ∈ {1, 2, 5, 10, 15, 30} at λ = 30; n = λ is async's c = 1 with softsync's replies), and async, each with every μ and policy."""
    protocols: list[tuple[str, int | None]] = [("hardsync", None)]
    protocols += [("softsync", n) for n in range(1, learners + 1) if learners % n == 0]
    protocols.append(("async", None))
    found = [Candidate(p, n, policy, mu) for mu in batch_sizes for p, n in protocols for policy in policies]
    if overlap:  # hardsync drops an overlapping learner's gradients: not a candidate
        found += [replace(c, overlap=True) for c in found if c.protocol != "hardsync"]
    return found


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without what a comparison ignores, and without n where it means nothing."""
    out = {k: v for k, v in settings.items() if k not in IGNORED}
    if out.get("protocol") != "softsync":
        out.pop("n", None)
    return out


def point_of(intended: TrainConfig, candidate: Candidate, seed: int | None = None) -> dict[str, Any]:
    """The study point (train's settings) of ``candidate`` in the intended run."""
    names = set(TrainConfig.settings())
    flat = {k: v for k, v in to_flat(intended).items() if k in names}
    flat.update(
        protocol=candidate.protocol,
        lr_policy=candidate.lr_policy,
        batch_size=candidate.batch_size,
        overlap=candidate.overlap,
    )
    flat["n"] = candidate.n if candidate.protocol == "softsync" else flat["n"]
    if seed is not None:
        flat["seed"] = seed
    return flat


def recorded(records: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each record with a test error, beside its settings (records of settings this version
    does not know are left out)."""
    out = []
    for record in records:
        point = record.get("point")
        if not isinstance(point, dict) or record.get("test_error") is None:
            continue
        try:
            out.append(
                (record, to_flat(to_config({k: v for k, v in point.items() if k not in POINT_KEYS}, validate=False)))
            )
        except ConfigError:
            continue
    return out


def match(point: dict[str, Any], known: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """The records (of :func:`recorded`) of a candidate's ``point`` (:func:`point_of`), any seed, any mode."""
    want = _comparable(point)
    return [record for record, settings in known if _comparable({k: settings[k] for k in want}) == want]


def load_costs(path: str) -> tuple[Costs, int]:
    """The costs ``benchmarks/runtime_model.py --json`` wrote, and the μ they were measured at."""
    try:
        data = json.loads(Path(path).read_text())
        costs = Costs(**data["costs"])
        batch = int(data["batch_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: not the costs of benchmarks/runtime_model.py --json ({exc}); "
            "measure them with: python benchmarks/runtime_model.py --no-validate --json FILE"
        ) from None
    if batch < 1:
        raise ConfigError(f"{path}: batch_size must be >= 1, got {batch}")
    return costs, batch


def at_batch(costs: Costs, measured_at: int, batch_size: int) -> Costs:
    """The costs at mini-batch ``batch_size``: the compute in proportion, the rest as measured."""
    return replace(costs, compute_s=costs.compute_s * batch_size / measured_at)


def command(intended: TrainConfig, candidate: Candidate) -> str:
    """The ``rudra-async train`` command of ``candidate`` in the intended run: λ and the
    candidate's settings, then the intended run's other settings that are not train's defaults."""
    cfg = to_config(point_of(intended, candidate), validate=False)
    chosen = ["--learners", str(intended.learners), "--protocol", candidate.protocol]
    chosen += ["--n", str(candidate.n)] if candidate.protocol == "softsync" else []
    chosen += ["--batch-size", str(candidate.batch_size), "--lr-policy", candidate.lr_policy]
    chosen += ["--overlap"] if candidate.overlap else []
    rest = command_line(cfg, exclude=(*TrainConfig.SET_BY_RUN, *CHOSEN, "learners", "overlap"))
    return shlex.join(["rudra-async", "train", *chosen, *rest])


def train_samples(intended: TrainConfig) -> int | None:
    """Samples a run of the intended settings processes (epochs × training set), None for
    --data or --updates."""
    if intended.learner.data or intended.updates is not None:
        return None
    from ..learner import data as datasets

    return round(intended.epochs * len(datasets.load(intended.learner.dataset).y_train))


def assess(
    intended: TrainConfig,
    cands: list[Candidate],
    records: list[dict[str, Any]],
    costs: tuple[Costs, int] | None,
    cores: float,
) -> list[Row]:
    """Every candidate's :class:`Row`."""
    samples = train_samples(intended)
    known = recorded(records)
    rows = []
    for c in cands:
        row = Row(c)
        point = point_of(intended, c)
        row.excluded = risks(to_config(point, validate=False).server, intended.learners, c.overlap)
        found = match(point, known)
        row.errors = [r["test_error"] for r in found]
        row.evidence = [r["id"] for r in found]
        if costs is not None:
            pred = simulate(at_batch(costs[0], costs[1], c.batch_size), intended.learners, c.protocol,
                            cores=cores, batch_size=c.batch_size, n=c.n, updates=max(1000, 40 * intended.learners),
                            overlap=c.overlap)  # fmt: skip
            row.samples_per_s, row.staleness = pred.samples_per_s, pred.staleness_mean
            if intended.updates is not None:
                row.runtime_s = intended.updates / pred.updates_per_s
            elif samples is not None:
                row.runtime_s = samples / pred.samples_per_s
        rows.append(row)
    return rows


def choose(
    rows: list[Row], objective: str = "best", value: float | None = None, tolerance: float = 0.01
) -> tuple[Row | None, str]:
    """The recommended row and why (None and the reason when none qualifies). Only rows that
    are not excluded and have evidence qualify. ``best``: the fastest (predicted) of those
    within ``tolerance`` of the lowest error; ``target_error``: the fastest with error <=
    ``value``; ``budget_s``: the lowest error with a predicted time <= ``value``. "The
    fastest": the lowest error among those predicted within :data:`SAME_TIME` of the
    fastest time."""
    usable = [r for r in rows if not r.excluded and r.error is not None]
    if not usable:
        return None, "no candidate that the start-up rule allows has accuracy evidence (give --evidence or --sweep)"

    def time_of(r: Row) -> float:
        return r.runtime_s if r.runtime_s is not None else (1 / r.samples_per_s if r.samples_per_s else float("inf"))

    def err(r: Row) -> float:
        assert r.error is not None
        return r.error

    def fastest(pool: list[Row]) -> Row:
        quickest = min(time_of(r) for r in pool)
        return min((r for r in pool if time_of(r) <= quickest * (1 + SAME_TIME)), key=lambda r: (err(r), time_of(r)))

    if objective == "budget_s":
        assert value is not None
        pool = [r for r in usable if r.runtime_s is not None and r.runtime_s <= value]
        if not pool:
            return None, f"no candidate with evidence is predicted to finish within {value:g} s"
        best = min(pool, key=lambda r: (err(r), time_of(r)))
        return best, f"the lowest error ({err(best):.4f}) predicted to finish within {value:g} s"
    if objective == "target_error":
        assert value is not None
        pool = [r for r in usable if err(r) <= value]
        if not pool:
            lowest = min(err(r) for r in usable)
            return None, f"no candidate's evidence reaches test error <= {value:g} (the lowest is {lowest:.4f})"
        return fastest(pool), f"the fastest predicted with test error <= {value:g}"
    lowest = min(err(r) for r in usable)
    pool = [r for r in usable if err(r) <= lowest + tolerance]
    return fastest(pool), f"the fastest predicted within {tolerance:g} of the lowest test error ({lowest:.4f})"


def sweep(
    intended: TrainConfig,
    rows: list[Row],
    directory: str,
    seeds: int,
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run every candidate that is not excluded and has no evidence, with seeds 0 …
    ``seeds``−1: simulated (one process, as the study's simulated mode), or as processes
    (``train``) where it overlaps, which a simulation cannot; results go to
    ``directory``/results.jsonl (resumed: runs already there are not run again). Returns
    every record in that file."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    done = {r["id"] for r in load_results(path, progress)}
    todo = [r.candidate for r in rows if not r.excluded and not r.errors]
    for k, c in enumerate(todo, 1):
        for seed in range(seeds):
            mode = "processes" if c.overlap else "simulated"
            point = {**point_of(intended, c, seed), "mode": mode, "group": "advise"}
            point_id = run_id(point)
            if point_id in done:
                continue
            result = run_point(point)
            with open(path, "a") as fh:
                fh.write(json.dumps({"id": point_id, "group": "advise", "point": point, **result}) + "\n")
            progress(f"[{k}/{len(todo)}] {c.label()} seed {seed}: test error {result['test_error']:.4f}")
    return load_results(path, progress)


def table(rows: list[Row], chosen: Row | None) -> str:
    """The candidates as a markdown table: allowed ones by error, then the excluded."""
    order = sorted(rows, key=lambda r: (bool(r.excluded), r.error is None, r.error or 0.0, r.runtime_s or 0.0))
    lines = [
        "| candidate | predicted samples/s | predicted σ | predicted time | test error (runs) | verdict |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in order:
        d = r.as_dict()
        error = (
            "—"
            if r.error is None
            else f"{r.error:.4f}" + (f" ± {d['test_error_sd']:.4f}" if d["test_error_sd"] is not None else "")
        )
        verdict = (
            "**recommended**"
            if r is chosen
            else ("excluded: start-up warning" if r.excluded else ("no evidence" if r.error is None else ""))
        )
        lines.append(
            f"| {r.candidate.label()} | {_num(r.samples_per_s, '{:,.0f}')} | {_num(r.staleness, '{:.2f}')} "
            f"| {_num(r.runtime_s, '{:,.1f} s')} | {error} ({len(r.errors)}) | {verdict} |"
        )  # fmt: skip
    return "\n".join(lines)


def _num(value: float | None, form: str) -> str:
    return "—" if value is None else form.format(value)


def advise(
    intended: TrainConfig,
    *,
    batch_sizes: list[int] | None = None,
    policies: Iterable[str] = POLICIES,
    objective: str = "best",
    value: float | None = None,
    tolerance: float = 0.01,
    costs_path: str | None = None,
    cores: float | None = None,
    evidence: Iterable[str] = (),
    sweep_dir: str | None = None,
    seeds: int = 1,
    overlap: bool = False,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The advice as JSON-ready data: ``recommendation`` (a candidate's row, with the ``command``
    that runs it; None when none qualifies), ``reason``, ``candidates`` (every row), ``costs``
    and ``cores``. Without ``costs_path`` nothing is timed (``budget_s`` then refuses)."""
    from ..server.store import usable_cores

    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective != "best" and (value is None or not value > 0):
        raise ConfigError(f"--{objective.replace('_', '-')} must be > 0")
    if objective == "budget_s" and costs_path is None:
        raise ConfigError("--budget-s needs --costs: without measured costs nothing is timed")
    if not tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {tolerance}")
    intended.validate()
    costs = load_costs(costs_path) if costs_path else None
    cores = cores or usable_cores()
    policies = list(policies)
    names = registry.known("lr policy")
    unknown = [p for p in policies if p not in names]
    if unknown or not policies:
        raise ConfigError(f"--policies: unknown {unknown or 'none given'}; known: {', '.join(names)}")
    if batch_sizes is not None and (not batch_sizes or min(batch_sizes) < 1):
        raise ConfigError(f"--batch-sizes must be integers >= 1, got {batch_sizes}")
    cands = candidates(intended.learners, batch_sizes or [intended.learner.batch_size], policies, overlap)
    records = [r for path in evidence for r in load_results(Path(path), progress)]
    rows = assess(intended, cands, records, costs, cores)
    if sweep_dir is not None:
        records += sweep(intended, rows, sweep_dir, seeds, progress)
        rows = assess(intended, cands, records, costs, cores)
    chosen, reason = choose(rows, objective, value, tolerance)
    recommendation = None
    if chosen is not None:
        recommendation = {**chosen.as_dict(), "command": command(intended, chosen.candidate)}
    return {
        "recommendation": recommendation,
        "reason": reason,
        "table": table(rows, chosen),
        "candidates": [r.as_dict() for r in rows],
        "costs": None if costs is None else {**vars(costs[0]), "batch_size": costs[1]},
        "cores": cores,
    }

"""The systematic study: a TOML spec → many runs → one JSON line each → a report.

Spec::

    [study]
    name = "..."
    output = "docs/study"            # results.jsonl, report.md and PNGs go here

    [defaults]                       # any run key (below), for every run
    dataset = "digits"
    mode = "simulated"               # or "processes" (real server + learner processes)

    [[runs]]                         # a group of runs: fixed keys plus a grid
    group = "softsync-n"
    protocol = "softsync"
    grid = { n = [1, 4, 16], lr_policy = ["constant", "staleness"] }

    [report]                         # which group answers which question (see report.py)
    staleness = "softsync-n"

Every combination of the grid's lists is one run. A run's id is a hash of its settings;
finished ids found in ``results.jsonl`` are skipped, so an interrupted sweep resumes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..errors import ConfigError
from ..eventloop import run as run_loop
from ..options import check_known, from_flat, load_toml

#: what a point may set besides a run's settings (TrainConfig.settings(), i.e. train's flags)
SIM_KEYS = ("jitter", "heterogeneity")
POINT_KEYS = ("mode", "group", *SIM_KEYS)


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run of a spec, defaults and grids applied, in order."""
    defaults = spec.get("defaults", {})
    points = []
    for i, group in enumerate(spec.get("runs", [])):
        fixed = {k: v for k, v in group.items() if k != "grid"}
        grid = group.get("grid", {})
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            raise ConfigError(f"runs[{i}].grid must map keys to non-empty lists")
        for combo in itertools.product(*grid.values()):
            point = {**defaults, **fixed, **dict(zip(grid, combo))}
            check_known(point, [*TrainConfig.settings(), *POINT_KEYS], f"runs[{i}]")
            point.setdefault("mode", "simulated")
            point.setdefault("group", f"runs{i}")
            if point["mode"] not in ("simulated", "processes"):
                raise ConfigError(f"runs[{i}]: mode must be 'simulated' or 'processes', got {point['mode']!r}")
            if point["mode"] == "simulated" and point.get("shards", 1) != 1:
                raise ConfigError(f"runs[{i}]: shards need mode = 'processes' (the simulation runs one server)")
            to_config(point)  # validate now, not an hour into the sweep
            points.append(point)
    if not points:
        raise ConfigError("the spec has no [[runs]]")
    return points


def run_id(point: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(point, sort_keys=True).encode()).hexdigest()[:12]


def to_config(point: dict[str, Any]) -> TrainConfig:
    """The run a point describes (its settings are those of ``rudra-async train``)."""
    settings = {k: v for k, v in point.items() if k not in POINT_KEYS}
    cfg: TrainConfig = from_flat(TrainConfig, settings, exclude=TrainConfig.SET_BY_RUN, where="study point")
    return cfg.validate()


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    cfg = to_config(point)
    if point["mode"] == "processes":
        from .train import train

        return run_loop(train(cfg))
    from .simulate import simulate

    return run_loop(simulate(cfg, point.get("jitter", 0.05), point.get("heterogeneity", 0.0)))


def load_results(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_study(
    spec_path: str, output: str | None = None, progress: Callable[[str], None] = print, report: bool = True
) -> Path:
    """Run every unfinished point of the spec, append results, write the report. Returns the output dir."""
    spec = load_toml(spec_path, "study spec")
    points = expand(spec)
    out = Path(output or spec.get("study", {}).get("output", "study-output"))
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    ids = [run_id(p) for p in points]
    done = {r["id"] for r in load_results(results_path)}
    todo = [(i, p) for i, p in zip(ids, points) if i not in done]
    progress(f"{len(points)} runs in the spec, {len(points) - len(todo)} already done, {len(todo)} to run")
    for k, (point_id, point) in enumerate(todo, 1):
        started = time.monotonic()
        result = run_point(point)
        line = {"id": point_id, "group": point["group"], "point": point, **result}
        with open(results_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        settings = " ".join(f"{key}={point[key]}" for key in sorted(point) if key not in ("group", "mode"))
        progress(
            f"[{k}/{len(todo)}] {point['group']} ({point['mode']}) {settings}: test error "
            f"{result['test_error']:.3f}, ⟨σ⟩ {result['staleness_mean']:.2f}, {time.monotonic() - started:.1f} s"
        )
    if report:
        from .report import write_report

        write_report(spec, spec_path, [r for r in load_results(results_path) if r["id"] in set(ids)], out)
        progress(f"report: {out / 'report.md'}")
    return out

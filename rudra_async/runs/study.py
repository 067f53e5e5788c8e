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
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..errors import ConfigError
from ..eventloop import run as run_loop
from ..options import check_known, from_flat, load_toml
from .report import fmt, write_report

#: what a point may set besides a run's settings (TrainConfig.settings(), i.e. train's flags)
SIM_KEYS = ("jitter", "heterogeneity")
POINT_KEYS = ("mode", "group", *SIM_KEYS)
MODES = ("simulated", "processes")


def expand(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every run of a spec, defaults and grids applied, in order; each checked (ConfigError)."""
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
            try:
                _check_point(point)  # now, not an hour into the sweep
            except ConfigError as exc:
                raise ConfigError(f"runs[{i}]: {exc}") from None
            points.append(point)
    if not points:
        raise ConfigError("the spec has no [[runs]]")
    return points


def _check_point(point: dict[str, Any]) -> None:
    """Refuse a point that would fail once running, or whose mode would ignore some of its keys."""
    mode = point["mode"]
    if mode not in MODES:
        raise ConfigError(f"mode must be 'simulated' or 'processes', got {mode!r}")
    cfg = to_config(point, validate=False)
    if mode == "processes":
        given = [key for key in SIM_KEYS if key in point]
        if given:
            raise ConfigError(f"mode = 'processes' ignores {', '.join(given)} (settings of the simulation's schedule)")
        cfg.validate()
        return
    for key in SIM_KEYS:
        _check_spread(key, point.get(key, 0.0))
    from .simulate import check_simulated

    check_simulated(cfg)  # first: what a simulation ignores is the error to name
    cfg.validate()


def _check_spread(key: str, value: Any) -> None:
    """``jitter`` and ``heterogeneity`` are finite numbers >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{key} must be a finite number >= 0, got {value!r}")


def run_id(point: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(point, sort_keys=True).encode()).hexdigest()[:12]


def to_config(point: dict[str, Any], validate: bool = True) -> TrainConfig:
    """The run a point describes (its settings are those of ``rudra-async train``), validated
    unless ``validate`` is False."""
    settings = {k: v for k, v in point.items() if k not in POINT_KEYS}
    cfg: TrainConfig = from_flat(TrainConfig, settings, exclude=TrainConfig.SET_BY_RUN, where="study point")
    return cfg.validate() if validate else cfg


def run_point(point: dict[str, Any]) -> dict[str, Any]:
    cfg = to_config(point)
    if point["mode"] == "processes":
        from .train import train

        return run_loop(train(cfg))
    from .simulate import simulate

    return run_loop(simulate(cfg, point.get("jitter", 0.05), point.get("heterogeneity", 0.0)))


def load_results(path: Path, warn: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The results recorded in ``path`` (none if it does not exist). A last line that is not
    a result (a run killed while writing it) is cut off the file, with a warning, so that its
    point runs again; a bad line before it is a ConfigError naming the file and the line."""
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    results = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        result = _parse(line)
        if result is not None:
            results.append(result)
        elif any(rest.strip() for rest in lines[number:]):
            raise ConfigError(f"{path}, line {number}: not the result of a run; repair or delete that line")
        else:
            warn(f"warning: {path}, line {number} is incomplete (a run stopped while writing it); it runs again")
            os.truncate(path, sum(len(before) + 1 for before in lines[: number - 1]))
    return results


def _parse(line: bytes) -> dict[str, Any] | None:
    """The result on one line of results.jsonl, or None if it holds none."""
    try:
        result = json.loads(line)
    except ValueError:
        return None
    return result if isinstance(result, dict) and isinstance(result.get("id"), str) else None


def run_study(
    spec_path: str, output: str | None = None, progress: Callable[[str], None] = print, report: bool = True
) -> Path:
    """Run every unfinished point of the spec, append results, write the report. Returns the output dir."""
    spec = load_toml(spec_path, "study spec")
    points = expand(spec)
    out = Path(output or spec.get("study", {}).get("output", "study-output"))
    results_path = _results_file(out)
    ids = [run_id(p) for p in points]
    done = {r["id"] for r in load_results(results_path, progress)}
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
            f"{fmt(result['test_error'])}, ⟨σ⟩ {result['staleness_mean']:.2f}, {time.monotonic() - started:.1f} s"
        )
    if report:
        write_report(spec, spec_path, [r for r in load_results(results_path, progress) if r["id"] in set(ids)], out)
        progress(f"report: {out / 'report.md'}")
    return out


def _results_file(out: Path) -> Path:
    """``out``/results.jsonl, the directory created and the file opened once for appending
    now, so that an unusable output directory is a ConfigError before anything runs."""
    path = out / "results.jsonl"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write the study's results in {out}: {exc.strerror or exc}") from None
    return path

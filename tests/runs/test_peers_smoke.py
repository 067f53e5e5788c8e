"""The peer benchmark's driver (benchmarks/peers): its rudra-async and DDP paths on a tiny
model, and the targets and table it writes. MXNet (its own environment) stays out."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ is not an installed package
from benchmarks.peers import driver

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.torch
@pytest.mark.long
def test_quick_tiny_run_measures_rudra_with_and_without_overlap_ddp_and_references(tmp_path):
    md, js = tmp_path / "t.md", tmp_path / "t.json"
    systems = "rudra:async:tcp,rudra:async-overlap:tcp,ddp,reference"
    cmd = [sys.executable, "-m", "benchmarks.peers", "--quick", "--tiny", "--only", systems]
    cmd += ["--workloads", "a", "--lambdas", "2", "--md", str(md), "--json", str(js)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(js.read_text())
    by_system = {r["system"]: r for r in report["results"]}
    assert set(by_system) == {"rudra:async:tcp", "rudra:async-overlap:tcp", "ddp", "reference"}
    assert {r["learners"] for r in report["results"] if r["system"] == "reference"} == {1, 2}
    for r in report["results"]:
        assert "error" not in r, r
        assert r["samples_per_s"] > 0 and r["updates_per_s"] > 0
    assert by_system["rudra:async:tcp"]["server_peak_rss_mb"] > 0
    assert by_system["rudra:async:tcp"]["latency_ms"] > 0
    assert "| rudra:async:tcp | 2 |" in md.read_text()


def _result(system, workload, lam, samples=None, updates=None, latency=None, rep=0):
    return {
        "system": system,
        "workload": workload,
        "learners": lam,
        "rep": rep,
        "samples_per_s": samples,
        "updates_per_s": updates,
        "latency_ms": latency,
    }


def _cpu(learners, server, learner_share, server_share=None):
    return {
        "learners_cpu_s_per_gradient": learners,
        "server_cpu_s_per_gradient": server,
        "learner_cpu_share": learner_share,
        "server_cpu_share": server_share,
    }


def test_targets_are_ratios_of_medians_and_failures_are_reported():
    results = []
    for rep, noise in enumerate((1.0, 1.1, 0.9)):
        for lam in (1, 2, 4):
            results.append(_result("rudra:async:tcp", "a0", lam, updates=10 * noise, rep=rep))
            results.append(_result("rudra:async:shm", "a0", lam, updates=20 * noise, rep=rep))
            results.append(_result("mxnet:dist_async", "a0", lam, updates=4.0, rep=rep))
        results.append(_result("rudra:async:tcp", "small", 1, latency=0.1, rep=rep))
        results.append(_result("rudra:async:shm", "small", 1, latency=0.2, rep=rep))
        results.append(_result("mxnet:dist_async", "small", 1, latency=0.5, rep=rep))
        results.append(_result("rudra:async:tcp", "a", 2, samples=120, rep=rep))
        results.append(_result("ddp", "a", 2, samples=100, rep=rep))
        results.append({**_result("rpc:async", "a", 2, rep=rep), "error": "boom\ndetails"})
        results.append({**_result("reference", "b", 1, samples=50, rep=rep), **_cpu(0.02 * noise, None, 1.0)})
        results.append(_result("reference", "b", 2, samples=90, rep=rep))
        results.append({**_result("rudra:async:shm", "b", 2, samples=99, rep=rep), **_cpu(0.021, 0.001, 0.95, 0.05)})
        results.append({**_result("ddp", "b", 2, samples=70, rep=rep), **_cpu(0.04, None, 0.9)})
        results.append(_result("rudra:async-overlap:tcp", "b", 2, samples=81, rep=rep))
    summary = driver.summarize(results)
    assert summary["rudra:async:tcp", "a0", 2]["updates_per_s"] == {"median": 10.0, "min": 9.0, "max": 11.0}
    rows = {t["target"]: t for t in driver.targets(summary, [1, 2, 4])}
    tcp_a0 = rows["(a0) updates/s, rudra async tcp:// ÷ MXNet dist_async, λ=2"]
    assert tcp_a0["ratio"] == pytest.approx(2.5) and tcp_a0["met"] is False
    assert rows["(a0) updates/s, rudra async shm:// ÷ MXNet dist_async, λ=4"]["met"] is False  # 5 < 6
    assert rows["(small) 1,000-float push+pull, MXNet dist_async ÷ rudra tcp://"]["ratio"] == pytest.approx(5)
    assert rows["(a) samples/s at λ=2, rudra async tcp:// ÷ best peer (ddp)"]["ratio"] == pytest.approx(1.2)
    assert rows["(a) samples/s at λ=2, rudra async shm:// ÷ best peer (ddp)"]["met"] is None  # not measured
    b_shm = rows["(b) samples/s at λ=2, rudra async shm:// ÷ compute limit (2 × single process)"]
    assert b_shm["ratio"] == pytest.approx(0.99) and b_shm["met"] is True
    b_overlap = rows["(b) samples/s at λ=2, rudra async-overlap tcp:// ÷ compute limit (2 × single process)"]
    assert b_overlap["ratio"] == pytest.approx(0.81) and b_overlap["met"] is False
    report = {
        "command": "python -m benchmarks.peers",
        "date": "today",
        "reps": 3,
        "workloads": ["a0", "small", "a", "b"],
        "machine": {
            "cpu": "CPU",
            "cores": 2,
            "memory_gb": 24,
            "kernel": "6",
            "python": "3.11",
            "torch": "2",
            "mxnet": "1.9.1",
            "load_before": "0",
            "load_after": "0",
        },
        "summary": {json.dumps(list(k)): v for k, v in summary.items()},
        "targets": list(rows.values()),
    }
    md = driver.markdown(report)
    assert "| rudra:async:tcp | 2 | — | 10 (9–11) |" in md
    assert "| rpc:async | 2 | failed: boom | | | | | |" in md
    assert "- rpc:async, a, λ=2: boom ⏎ details" in md
    # λ references side by side: the host's own limit for λ trainings, next to λ × one process
    assert "| (b) | 2 | async | shm | 99 | 1.41× ddp | 0.99× | 1.10× |" in md
    assert "| (b) | 2 | async-overlap | tcp | 81 | 1.16× ddp | 0.81× | 0.90× |" in md
    # where the CPU goes: per gradient, over the reference's CPU per step (median 20 ms), and
    # the samples/s two cores allow at that cost (2 × batch 32 ÷ CPU per gradient)
    assert "compute, update and nothing else: (b) 20 ms)" in md
    assert "| (b) | rudra:async:shm | 2 | 21 | 1 | 22 | 1.10× | 1.95 | 99 | 2,909 |" in md
    assert "| (b) | ddp | 2 | 40 | — | 40 | 2.00× | 1.8 | 70 | 1,600 |" in md


def test_matrix_runs_references_side_by_side_and_overlap_only_where_there_is_compute():
    args = driver.parse_args(["--only", "rudra:async-overlap:shm,reference", "--lambdas", "2,4"])
    assert driver.matrix(args) == [
        ("rudra:async-overlap:shm", "a", 2),
        ("rudra:async-overlap:shm", "a", 4),
        ("reference", "a", 1),
        ("reference", "a", 2),
        ("reference", "a", 4),
        ("rudra:async-overlap:shm", "b", 2),
        ("rudra:async-overlap:shm", "b", 4),
        ("reference", "b", 1),
        ("reference", "b", 2),
        ("reference", "b", 4),
    ]


def test_a_point_that_fails_before_any_step_is_launched_again_up_to_three_times(monkeypatch):
    hang = "timed out after 60 s waiting for every learner's first step (steps per learner: [0, 0])"
    outcomes: list[list[dict]] = []

    def run_once(system, workload, lam, rep, args):
        result = outcomes.pop(0)
        return [
            {**r, "system": system, "workload": workload, "learners": lam, "rep": rep, "wall_s": 1.0} for r in result
        ]

    monkeypatch.setattr(driver, "run_once", run_once)
    ok = [{"window": 0, "updates_per_s": 5.0}, {"window": 1, "updates_per_s": 6.0}]
    outcomes[:] = [[{"error": hang, "logs": {"w": "x"}}], [{"error": hang}], ok]
    results = driver.run_point("mxnet:dist_sync", "b", 2, 0, None)
    assert [r["updates_per_s"] for r in results] == [5.0, 6.0] and not outcomes
    assert [e["error"] for e in results[0]["earlier_tries"]] == [hang, hang]
    assert results[0]["earlier_tries"][0]["logs"] == {"w": "x"} and results[0]["wall_s"] == 3.0
    assert driver.summarize(results)[("mxnet:dist_sync", "b", 2)]["retried"] == [hang, hang]  # once per launch
    point = {"system": "mxnet:dist_sync", "workload": "b", "learners": 2, "first_try": {"error": "x"}}  # older files'
    kept = [{**point, "window": w} for w in range(3)]
    assert driver.summarize(kept)[("mxnet:dist_sync", "b", 2)]["retried"] == ["x"]

    outcomes[:] = [[{"error": hang}]] * 4
    results = driver.run_point("mxnet:dist_sync", "b", 2, 0, None)
    assert results[0]["error"] == hang and len(results[0]["earlier_tries"]) == 2 and len(outcomes) == 1

    outcomes[:] = [[{"error": "the server exited with 1"}], ok]
    results = driver.run_point("mxnet:dist_sync", "b", 2, 0, None)
    assert results[0]["error"] == "the server exited with 1" and "earlier_tries" not in results[0]


def test_ceiling_reads_a_driver_run_and_bounds_training_by_cores_and_by_steps(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # ceiling.py imports its sibling timing.py
    import ceiling

    results = []
    for lam, mx in ((1, 3.0), (2, 5.0)):
        results.append(_result("mxnet:dist_async", "a0", lam, updates=mx))
    results.append({**_result("reference", "b", 1, samples=1000, updates=1000 / 32), **_cpu(0.032, None, 1.0)})
    results += [_result("ddp", "a", 2, samples=75), _result("mxnet:dist_async", "a", 2, samples=60)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"summary": {json.dumps(list(k)): v for k, v in driver.summarize(results).items()}}))
    summary = ceiling.load_summary(str(path))
    assert ceiling.mxnet_targets(summary) == {1: 3.0, 2: 5.0}
    assert ceiling.training_target(summary, "a", 2) == (pytest.approx(90.0), "1.2 × ddp 75.0")
    assert ceiling.training_target(summary, "b", 2)[0] == pytest.approx(1900.0)
    assert ceiling.training_target(summary, "b", 4)[0] == pytest.approx(3800.0)
    assert math.isnan(ceiling.training_target(summary, "a", 4)[0])  # no peer measured there
    # cores-bound: 2 cores × 32 ÷ (32 ms + 3 ms); steps-bound: 2 × 32 ÷ (32 ms − 1 ms); the smaller wins
    assert ceiling.training_bound(0.032, 1000, 32, 0.003, 0.001, 2, 2) == pytest.approx(64 / 0.035)
    assert ceiling.training_bound(0.032, 1000, 32, 0.003, 0.001, 16, 2) == pytest.approx(64 / 0.031)

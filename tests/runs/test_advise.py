"""``rudra-async advise``: candidates screened by the start-up warnings' rule, timed by the
runtime model, judged by recorded runs' errors; the objectives; the command it prints."""

import json
import shlex

import pytest
from helpers import run_cli

from rudra_async.advice import risks
from rudra_async.config import TrainConfig
from rudra_async.errors import ConfigError
from rudra_async.learner.data import load
from rudra_async.options import from_flat
from rudra_async.runs import advise as adv
from rudra_async.runs.runtime_model import Costs, simulate

COSTS = Costs(compute_s=0.002, client_s=0.0005, server_s=0.0005, update_s=0.0001, switch_s=0.0001)


def intended(**settings) -> TrainConfig:
    base = {"learners": 4, "epochs": 2.0, "batch_size": 16, "lr": 0.05, "momentum": 0.9}
    return from_flat(TrainConfig, {**base, **settings}, exclude=TrainConfig.SET_BY_RUN)


def record(point_id: str, error: float, **settings) -> dict:
    """A results.jsonl line as the study writes it."""
    point = {"learners": 4, "epochs": 2.0, "batch_size": 16, "lr": 0.05, "momentum": 0.9, "mode": "simulated",
             "group": "g", **settings}  # fmt: skip
    return {"id": point_id, "point": point, "test_error": error}


def test_candidates_are_hardsync_every_n_dividing_lambda_and_async():
    got = adv.candidates(4, [8, 16], ["compensated", "constant"])
    protocols = {(c.protocol, c.n) for c in got}
    assert protocols == {("hardsync", None), ("softsync", 1), ("softsync", 2), ("softsync", 4), ("async", None)}
    assert len(got) == 5 * 2 * 2


def test_a_candidate_the_startup_rule_warns_about_is_excluded_with_its_reason():
    cfg = intended()
    rows = adv.assess(cfg, adv.candidates(4, [16], adv.POLICIES), [], None, 2)
    for row in rows:
        server = adv.to_config(adv.point_of(cfg, row.candidate), validate=False).server
        assert row.excluded == risks(server, 4)  # one rule for the warnings and advise
    excluded = {(r.candidate.protocol, r.candidate.lr_policy) for r in rows if r.excluded}
    assert ("async", "constant") in excluded and ("hardsync", "constant") not in excluded
    without_momentum = adv.assess(intended(momentum=0.0), adv.candidates(4, [16], adv.POLICIES), [], None, 2)
    assert not any(r.excluded for r in without_momentum)


def test_evidence_matches_the_intended_run_with_the_candidates_settings_only():
    cfg = intended()
    records = [
        record("a", 0.10, protocol="softsync", n=2, lr_policy="compensated", seed=0),
        record("b", 0.20, protocol="softsync", n=2, lr_policy="compensated", seed=1, transport="shm"),
        record("c", 0.90, protocol="softsync", n=4, lr_policy="compensated"),  # another n
        record("d", 0.90, protocol="softsync", n=2, lr_policy="compensated", lr=0.01),  # another rate
        record("e", 0.05, protocol="async", n=3, lr_policy="compensated"),  # n means nothing to async
        {"id": "f", "point": {"no_such_setting": 1}, "test_error": 0.0},  # another version's record
    ]
    rows = {r.candidate: r for r in adv.assess(cfg, adv.candidates(4, [16], ["compensated"]), records, None, 2)}
    soft2 = rows[adv.Candidate("softsync", 2, "compensated", 16)]
    assert soft2.evidence == ["a", "b"] and soft2.error == pytest.approx(0.15)
    assert rows[adv.Candidate("async", None, "compensated", 16)].evidence == ["e"]
    assert rows[adv.Candidate("hardsync", None, "compensated", 16)].error is None


def test_times_come_from_the_runtime_model_with_the_compute_scaled_to_the_batch():
    cfg = intended()
    rows = adv.assess(cfg, [adv.Candidate("async", None, "compensated", 32)], [], (COSTS, 16), 2)
    pred = simulate(Costs(**{**vars(COSTS), "compute_s": 0.004}), 4, "async", cores=2, batch_size=32, updates=1000)
    assert rows[0].samples_per_s == pytest.approx(pred.samples_per_s)
    samples = round(2.0 * len(load("digits").y_train))  # epochs × the training set
    assert rows[0].runtime_s == pytest.approx(samples / pred.samples_per_s)
    by_updates = adv.assess(intended(updates=500), [rows[0].candidate], [], (COSTS, 16), 2)
    assert by_updates[0].runtime_s == pytest.approx(500 / pred.updates_per_s)  # --updates: the updates' time


def row(error, runtime, excluded=()):
    r = adv.Row(adv.Candidate("async", None, "compensated", 16), list(excluded), 1.0, 0.0, runtime)
    r.errors = [] if error is None else [error]
    return r


def test_the_objectives_choose_as_documented():
    fast_bad, slow_good, mid, warned, unknown = (
        row(0.20, 10),
        row(0.05, 100),
        row(0.055, 50),
        row(0.01, 1, ["x"]),
        row(None, 1),
    )
    rows = [fast_bad, slow_good, mid, warned, unknown]
    assert adv.choose(rows, "best", tolerance=0.01)[0] is mid  # the fastest within 0.01 of 0.05
    assert adv.choose(rows, "best", tolerance=0.0)[0] is slow_good
    assert adv.choose(rows, "target_error", 0.3)[0] is fast_bad
    assert adv.choose(rows, "budget_s", 60)[0] is mid
    assert adv.choose(rows, "budget_s", 5) == (None, "no candidate with evidence is predicted to finish within 5 s")
    none, why = adv.choose(rows, "target_error", 0.01)
    assert none is None and "the lowest is 0.0500" in why  # the warned 0.01 never counts
    assert adv.choose([warned, unknown])[0] is None
    near = row(0.051, 50 * (1 + adv.SAME_TIME))  # as fast as mid, within the model's resolution
    assert adv.choose([*rows, near])[0] is near  # then the lower error decides
    assert adv.choose([*rows, row(0.051, 50 * (1 + 2 * adv.SAME_TIME))])[0] is mid


def test_bad_input_is_a_clear_error(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"costs": vars(COSTS)}))  # no batch_size
    with pytest.raises(ConfigError, match=r"benchmarks/runtime_model\.py --no-validate --json"):
        adv.advise(intended(), costs_path=str(bad))
    with pytest.raises(ConfigError, match="--budget-s needs --costs"):
        adv.advise(intended(), objective="budget_s", value=10)
    with pytest.raises(ConfigError, match="unknown \\['sgd'\\]"):
        adv.advise(intended(), policies=["sgd"])


def test_advise_sweeps_recommends_and_prints_a_command_train_accepts(tmp_path):
    """The command line end to end: a quick simulated sweep of the allowed candidates (λ = 2
    digits, one epoch), timed with measured-style costs; the recommendation rests on the
    sweep's records and its command is train's own flags for it."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"costs": vars(COSTS), "batch_size": 16}))
    sweep = tmp_path / "sweep"
    args = ["advise", "-l", "2", "--epochs", "1", "--lr", "0.05", "--policies", "compensated,constant",
            "--costs", str(costs), "--sweep", str(sweep), "--json"]  # fmt: skip
    proc = run_cli(*args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = out["candidates"]
    assert len(rows) == 4 * 2  # hardsync, softsync n = 1 and 2, async; two policies
    swept = [json.loads(line) for line in (sweep / "results.jsonl").read_text().splitlines()]
    allowed = [r for r in rows if not r["excluded"]]
    assert len(swept) == len(allowed) and all(r["runs"] == 1 for r in allowed)  # each ran once, the warned never
    rec = out["recommendation"]
    assert rec is not None and not rec["excluded"] and rec["evidence"][0] in {r["id"] for r in swept}
    best = min(r["test_error"] for r in allowed)
    assert rec["test_error"] <= best + 0.01
    assert rec["predicted_runtime_s"] == pytest.approx(len(load("digits").y_train) / rec["predicted_samples_per_s"])
    command = shlex.split(rec["command"])
    assert command[:2] == ["rudra-async", "train"]
    shown = run_cli(*command[1:], "--show-config")
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)
    assert (settings["protocol"], settings["lr_policy"], settings["learners"]) == (rec["protocol"], rec["lr_policy"], 2)
    assert settings["lr"] == 0.05 and settings["epochs"] == 1
    again = run_cli(*args)  # resumed: nothing runs twice
    assert again.returncode == 0 and json.loads(again.stdout)["recommendation"] == rec
    assert len((sweep / "results.jsonl").read_text().splitlines()) == len(swept)

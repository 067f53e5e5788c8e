"""What a study refuses up front, and how it treats its own files: keys a mode ignores,
the simulation's settings, an unusable output directory, a results file cut short."""

import json
import re

import pytest
from helpers import run_cli

from rudra_async import ConfigError
from rudra_async.config import LearnerOptions, TrainConfig
from rudra_async.eventloop import run
from rudra_async.runs.simulate import simulate
from rudra_async.runs.study import expand, run_study

TINY = '[defaults]\nmodel = "linear"\nupdates = 3\nlearners = 1\nbatch_size = 8\n'
DATA_MODULE = """
import torch

def data(index, learners, batch_size, seed):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(index))
    y = (x.sum(1) > 0).long()
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, 32, batch_size)]

def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)
"""


def write_spec(tmp_path, body):
    spec = tmp_path / "spec.toml"
    spec.write_text(TINY + body)
    return str(spec)


def test_a_run_with_its_own_data_has_no_test_error_and_the_study_goes_on(tmp_path):
    (tmp_path / "studydata.py").write_text(DATA_MODULE)
    own = 'model = "studydata:model"\ndata = "studydata:data"\nmode = "processes"\n'
    spec = write_spec(tmp_path, "[[runs]]\n" + own + "grid = { seed = [0, 1] }\n")
    proc = run_cli("study", spec, "-o", str(tmp_path / "out"), timeout=240, env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("test error n/a") == 2  # both points ran, the first did not stop the sweep
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r["test_error"] for r in results] == [None, None]
    assert "| n/a |" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    "settings, names",
    [
        ({"data": "m:data", "loss": "m:loss", "model": "m:model"}, "data, loss"),
        ({"overlap": True, "transport": "shm"}, "transport, overlap"),
        ({"device": "cuda", "threads": 2}, "device, threads"),
        ({"shards": 2}, "shards"),
    ],
)
def test_simulated_points_refuse_what_only_processes_use(settings, names):
    with pytest.raises(ConfigError, match=f"runs\\[1\\]: a simulation ignores {names} .*use mode = 'processes'"):
        expand({"runs": [{}, settings]})
    assert expand({"runs": [{**settings, "mode": "processes"}]})[0]["mode"] == "processes"


def test_default_values_of_process_settings_are_accepted_and_simulate_checks_too():
    assert len(expand({"defaults": {"transport": "tcp", "reconnect": 0.0, "device": "cpu"}, "runs": [{}]})) == 1
    cfg = TrainConfig(learners=1, updates=2, learner=LearnerOptions(model="linear", loss="mse"))
    with pytest.raises(ConfigError, match="a simulation ignores loss"):
        run(simulate(cfg))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"jitter": "high"}, "jitter must be a finite number >= 0, got 'high'"),
        ({"heterogeneity": -0.5}, "heterogeneity must be a finite number >= 0, got -0.5"),
        ({"jitter": True}, "jitter must be a finite number >= 0, got True"),
        ({"heterogeneity": float("nan")}, "heterogeneity must be a finite number >= 0, got nan"),
        ({"mode": "processes", "jitter": 0.1}, "mode = 'processes' ignores jitter"),
    ],
)
def test_simulation_settings_are_checked_before_anything_runs(settings, message):
    with pytest.raises(ConfigError, match=f"runs\\[1\\]: {message}"):
        expand({"runs": [{}, settings]})
    assert [p.get("jitter") for p in expand({"runs": [{"jitter": 0}, {"heterogeneity": 1}]})] == [0, None]


def test_a_result_cut_short_runs_again_and_a_bad_line_before_the_end_is_refused(tmp_path):
    spec = write_spec(tmp_path, "[[runs]]\ngrid = { seed = [0, 1] }\n")
    results = tmp_path / "out" / "results.jsonl"
    run_study(spec, str(tmp_path / "out"), progress=lambda _: None, report=False)
    first, second = results.read_text().splitlines()
    results.write_text(first + "\n" + second[: len(second) // 2])  # killed while writing the second
    said = []
    run_study(spec, str(tmp_path / "out"), progress=said.append, report=False)
    assert any("line 2 is incomplete" in line for line in said)
    assert "2 runs in the spec, 1 already done, 1 to run" in said
    lines = results.read_text().splitlines()
    assert lines[0] == first and json.loads(lines[1])["id"] == json.loads(second)["id"] and len(lines) == 2
    results.write_text(first[:20] + "\n" + second + "\n")
    with pytest.raises(ConfigError, match=f"{re.escape(str(results))}, line 1: not the result of a run"):
        run_study(spec, str(tmp_path / "out"), progress=lambda _: None, report=False)


def test_an_output_directory_that_cannot_be_made_is_a_config_error(tmp_path):
    spec = write_spec(tmp_path, "[[runs]]\n")
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "out")
    with pytest.raises(ConfigError, match=f"cannot write the study's results in {re.escape(out)}: Not a directory"):
        run_study(spec, out, progress=lambda _: None)
    proc = run_cli("study", spec, "-o", out)
    assert proc.returncode != 0 and proc.stderr.startswith("error: cannot write the study's results in")
    assert "Traceback" not in proc.stderr

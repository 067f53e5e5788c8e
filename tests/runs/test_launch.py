"""`rudra-async launch`: every task of a cluster job takes its role from its rank."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
from helpers import free_port, free_port_run, last_json, reap, run_cli, start_cli, subprocess_env

from rudra_async import ConfigError
from rudra_async.config import LaunchConfig, ServerConfig
from rudra_async.runs.launch import rank_from_env, resolve


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, (3, 8, "slurm")),
        ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}, (1, 4, "openmpi")),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, (0, 2, "pmi")),
        ({"RANK": "5", "WORLD_SIZE": "6"}, (5, 6, "torchrun")),
        # torchrun (or mpirun) started by srun: every task of a node inherits the node's SLURM_PROCID
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "RANK": "5", "WORLD_SIZE": "8"}, (5, 8, "torchrun")),
    ],
)
def test_rank_comes_from_the_cluster_engine(env, expected):
    assert rank_from_env(env) == expected


def test_bad_launch_settings_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no cluster rank in the environment"):
        rank_from_env({"SLURM_PROCID": "1"})
    with pytest.raises(ConfigError, match="not integers"):
        rank_from_env({"RANK": "x", "WORLD_SIZE": "2"})
    ok = dict(rendezvous=str(tmp_path), rank=0, world_size=3)
    with pytest.raises(ConfigError, match="need 1 <= servers < world size"):
        resolve(LaunchConfig(**{**ok, "servers": 3}), {})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(LaunchConfig(**{**ok, "rendezvous": str(tmp_path / "nope")}), {})
    with pytest.raises(ConfigError, match=r"put \{shard\} in --checkpoint"):
        resolve(LaunchConfig(**ok, servers=2, server=ServerConfig(checkpoint=str(tmp_path / "c.ckpt"))), {})
    with pytest.raises(ConfigError, match="both --rank and --world-size"):
        resolve(LaunchConfig(rendezvous=str(tmp_path), rank=1), {"RANK": "0", "WORLD_SIZE": "3"})
    assert resolve(LaunchConfig(**ok), {"SLURM_JOB_ID": "77"}).job_id == "77"


def run_job(tmp_path, world, servers, *extra, engine=("SLURM_PROCID", "SLURM_NTASKS"), env=None):
    """Start ``world`` tasks as a cluster engine would (same command, rank in the environment;
    ``env`` adds variables)."""
    rank_var, size_var = engine
    procs = [
        start_cli(
            "launch",
            "--rendezvous",
            str(tmp_path),
            "--servers",
            str(servers),
            "--advertise",
            "127.0.0.1",
            "--listen-host",
            "127.0.0.1",
            *extra,
            env={rank_var: str(rank), size_var: str(world), "SLURM_JOB_ID": "4242", **(env or {})},
        )
        for rank in range(world)
    ]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err
            results.append(last_json(out))
    finally:
        reap(*procs)
    return results


def test_a_slurm_job_of_two_shard_servers_and_two_learners_trains_and_ends(tmp_path):
    checkpoint = str(tmp_path / "ckpt-{shard}")
    (tmp_path / "4242.shard0.url").write_text(f"tcp://127.0.0.1:{free_port()}\n")  # left by a dead server
    port = free_port_run(2)  # shard I listens on port + I: ranks 0 and 1 share this host (both must bind)
    results = run_job(tmp_path, 4, 2, "--max-updates", "200", "--checkpoint", checkpoint, "--port", str(port))
    servers, learners = results[:2], results[2:]
    assert [r["role"] for r in results] == ["server", "server", "learner", "learner"]
    assert [s["shard"] for s in servers] == ["0/2", "1/2"] and all(s["updates"] == 200 for s in servers)
    assert sorted(r["index"] for r in learners) == [0, 1]
    assert 198 <= sum(r["steps"] for r in learners) <= 200  # a push racing the stop may count on one shard only
    print("learners' test accuracy:", [r["test_accuracy"] for r in learners])
    assert all(r["test_accuracy"] > 0.5 for r in learners), json.dumps(learners)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0", "ckpt-1"]  # addresses unpublished, checkpoints written
    run = run_cli("evaluate", str(tmp_path / "ckpt-0"), str(tmp_path / "ckpt-1"), "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["clocks"] == [200, 200], run.stderr


def test_a_torchrun_job_with_one_server_and_learners_for_some_epochs(tmp_path):
    """``--epochs`` counts passes over the data by all learners together, as train's does."""
    from rudra_async.learner import data

    steps = math.ceil(0.5 * len(data.load("digits").y_train) / (2 * 32))
    results = run_job(tmp_path, 3, 1, "--epochs", "0.5", engine=("RANK", "WORLD_SIZE"))
    assert results[0]["role"] == "server" and results[0]["updates"] == 2 * steps  # async: one update a push
    assert [r["steps"] for r in results[1:]] == [steps, steps]


def test_launch_settings_are_checked_before_anything_starts(tmp_path):
    """A learner rank's bad settings used to show once the servers were up (~5 s), a TOML
    ``learners`` key suggested 'learner_history'."""
    started = time.monotonic()
    run = run_cli("launch", "--rendezvous", str(tmp_path), "--rank", "1", "--world-size", "2", "--data", "m:f")
    assert run.returncode == 2 and "with --data give --model module:function" in run.stderr, run.stderr
    (tmp_path / "job.toml").write_text("learners = 3\n")
    run = run_cli("launch", "--config", str(tmp_path / "job.toml"), "--rendezvous", str(tmp_path))
    assert run.returncode == 2 and "tasks beyond --servers" in run.stderr, run.stderr
    assert time.monotonic() - started < 20


SHARDED_DATA = """
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

def model():
    return nn.Linear(4, 1)

def data(index, learners, batch_size):
    with open(os.path.join(os.environ["SHARD_LOG"], f"learner-{index}"), "w") as f:
        f.write(str(learners))
    x = torch.ones(8, 4)
    return DataLoader(TensorDataset(x, x[:, :1]), batch_size=batch_size)
"""


def test_a_learners_data_is_told_how_many_learners_the_job_has(tmp_path):
    """``--data`` functions shard by ``index`` and ``learners``: every learner of a job of
    three tasks (one server) is told there are two."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "sharded.py").write_text(SHARDED_DATA)
    extra = ["--steps", "3", "--model", "sharded:model", "--data", "sharded:data", "--loss", "mse", "-b", "4"]
    env = {"PYTHONPATH": str(tmp_path / "code"), "SHARD_LOG": str(tmp_path / "code")}
    (tmp_path / "rdv").mkdir()
    results = run_job(tmp_path / "rdv", 3, 1, *extra, engine=("RANK", "WORLD_SIZE"), env=env)
    assert results[0]["updates"] == 6
    assert [(tmp_path / "code" / f"learner-{i}").read_text() for i in (0, 1)] == ["2", "2"]


def test_a_learner_gives_up_when_no_server_appears(tmp_path):
    (tmp_path / "job.shard0.url").write_text(f"tcp://127.0.0.1:{free_port()}\n")  # nobody listens there
    run = run_cli("launch", "--rendezvous", str(tmp_path), "--wait", "1", env={"RANK": "1", "WORLD_SIZE": "2"})
    assert run.returncode == 2 and "did not publish their addresses within 1 s" in run.stderr


def test_a_server_whose_learners_never_come_ends_after_the_wait(tmp_path):
    run = run_cli(
        "launch",
        "--rendezvous",
        str(tmp_path),
        "--wait",
        "1",
        "--listen-host",
        "127.0.0.1",
        env={"RANK": "0", "WORLD_SIZE": "3"},
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["updates"] == 0 and "0 of 2 learners came" in run.stderr
    assert os.listdir(tmp_path) == []


def test_torchrun_runs_a_job_as_the_readme_shows(tmp_path):
    """`torchrun --no-python rudra-async launch ...` (the README's form: torchrun otherwise runs
    its argument as a Python file, and rudra-async is a console script)."""
    bindir = os.path.dirname(sys.executable)
    command = [os.path.join(bindir, "torchrun"), "--standalone", "--nproc-per-node", "3", "--no-python"]
    command += ["rudra-async", "launch", "--rendezvous", str(tmp_path), "--servers", "1", "--steps", "20"]
    command += ["--advertise", "127.0.0.1", "--listen-host", "127.0.0.1"]
    env = {**subprocess_env(), "PATH": bindir + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    roles = sorted(r["role"] for r in results)
    assert roles == ["learner", "learner", "server"], proc.stdout
    assert next(r for r in results if r["role"] == "server")["updates"] == 40

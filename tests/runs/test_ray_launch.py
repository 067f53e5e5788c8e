"""``rudra-async launch --ray``: a job's servers and learners as actors of a real Ray cluster
(one started here with ``ray start --head`` on the loopback address), found with ``auto``."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import run_cli, subprocess_env

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'rudra-async[ray]')")
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


@pytest.fixture
def ray_cluster():
    """A one-node Ray cluster on 127.0.0.1 with 4 logical CPUs, stopped after the test."""
    env = subprocess_env()
    start = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--num-cpus", "4", "--num-gpus", "0",
             "--include-dashboard", "false", "--disable-usage-stats"]  # fmt: skip
    proc = subprocess.run(start, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    try:
        yield env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)


def test_a_ray_job_trains_with_actors_placed_by_resources_and_returns_everything_to_the_driver(ray_cluster):
    assert shutil.which(RAY), "the ray extra installs the ray command"
    job = ["launch", "--ray", "auto", "--world-size", "3", "--servers", "1", "--listen-host", "127.0.0.1",
           "--advertise", "127.0.0.1", "--epochs", "3", "--batch-size", "16", "--lr", "0.05"]  # fmt: skip
    too_big = run_cli(*job, "--learner-cpus", "3", env=ray_cluster, timeout=120)
    assert too_big.returncode == 2 and "too small for 1 servers and 2 learners" in too_big.stderr, too_big.stderr
    assert "reserve 7 CPUs (it has 4)" in too_big.stderr

    proc = run_cli(*job, "--learner-cpus", "1.5", env=ray_cluster, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (server,), learners = result["servers"], result["learners"]
    assert server["role"] == "server" and sorted(x["index"] for x in learners) == [0, 1]
    assert server["updates"] == sum(x["steps"] for x in learners) > 0  # async: every gradient an update
    # (the servers require the job's secret: the learners' training proves Ray carried it to them)
    assert all(x["test_accuracy"] > 0.9 for x in learners), learners

"""Beyond one host: a job's shard servers on one host and its learners on others, the hosts
network namespaces joined by shaped links (tests/netns.py), every task a real
``rudra-async launch`` with a rendezvous directory they all see and a shared secret (and
once TLS). A link
cut mid-run and restored within ``--reconnect``: the learner resumes; cut for longer: it
stops with a clear error while the others finish, and the checkpoints are intact."""

import json
import subprocess
import time

import pytest
from helpers import CLI_ARGS, make_pki, reap, run_cli, subprocess_env
from netns import SERVER_ADDRESS, Hosts, unavailable

from rudra_async import checkpoint
from rudra_async.transports.base import LINK_TIMEOUT_S

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.long,
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}"),
]


def start_job(hosts: Hosts, tmp_path, learner_args: dict[int, list[str]], *common: str) -> list[subprocess.Popen]:
    """Two shard servers on the server host, one learner on each learner host."""
    secret = tmp_path / "secret"
    if not secret.exists():
        assert run_cli("secret", str(secret)).returncode == 0
    job = ["launch", "--rendezvous", str(tmp_path), "--world-size", str(2 + len(hosts.learners)), "--servers", "2",
           "--listen-host", SERVER_ADDRESS, "--advertise", SERVER_ADDRESS, "--secret-file", str(secret),
           "--checkpoint", str(tmp_path / "ckpt-{shard}"), "--progress-every", "1", *common]  # fmt: skip
    where = [hosts.server, hosts.server, *hosts.learners]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": subprocess_env()}
    return [
        subprocess.Popen(hosts.on(host, *CLI_ARGS, *job, "--rank", str(rank), *learner_args.get(rank - 2, [])), **pipes)
        for rank, host in enumerate(where)
    ]


def wait_for_training(hosts: Hosts, procs, timeout: float = 90) -> None:
    """Until every learner host has held a connection to each of the two servers for a second."""
    deadline = time.monotonic() + timeout
    held = 0  # checks in a row that found them (a learner's probes of the servers come and go at once)
    while held < 3:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the learners did not connect"
        held = held + 1 if all(hosts.connections(i) >= 2 for i in range(len(hosts.learners))) else 0
        time.sleep(0.5)


def finish(procs, timeout: float = 180) -> list[tuple[int, dict | None, str]]:
    """Each task's (exit code, JSON result or None, stderr)."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            lines = stdout.strip().splitlines()
            out.append((p.returncode, json.loads(lines[-1]) if p.returncode == 0 and lines else None, stderr))
    finally:
        reap(*procs)
    return out


def test_a_sharded_job_on_other_hosts_trains_over_1_gbit_links_and_a_cut_link_within_reconnect_resumes(tmp_path):
    """The cut outlasts TCP's dead-link detection (LINK_TIMEOUT_S), so learner 0's connections
    break and it reconnects once the link is back; learner 1 trains on meanwhile."""
    with Hosts(2, rate="1gbit") as hosts:
        procs = start_job(hosts, tmp_path, {}, "--epochs", "40", "--batch-size", "32", "--reconnect", "120")
        wait_for_training(hosts, procs)
        hosts.cut(0)
        time.sleep(LINK_TIMEOUT_S + 5)
        hosts.restore(0)
        results = finish(procs)
    (rc0, server0, _), (rc1, server1, _), (rc2, learner0, err0), (rc3, learner1, _) = results
    assert [rc0, rc1, rc2, rc3] == [0, 0, 0, 0], [r[2][-2000:] for r in results]
    assert learner0["reconnects"] >= 1 and "lost the server" in err0  # its connection broke, and it came back
    assert learner1["reconnects"] == 0
    assert learner0["test_accuracy"] > 0.9 and learner1["test_accuracy"] > 0.9
    for i, stats in enumerate((server0, server1)):  # nothing but the gradients in flight is lost
        assert stats["updates"] >= learner0["steps"] + learner1["steps"] - 2, stats
        assert checkpoint.load(str(tmp_path / f"ckpt-{i}")).clock == stats["updates"]


def test_a_link_cut_for_longer_than_reconnect_stops_that_learner_with_a_clear_error_over_tls(tmp_path):
    """The servers speak TLS (a certificate for their host's address). The others finish; the
    servers end once every learner came and went; the checkpoints hold every update made."""
    pki = make_pki(tmp_path, SERVER_ADDRESS)
    tls = ["--tls-cert", pki["host.pem"], "--tls-key", pki["host.key"], "--tls-ca", pki["ca.pem"]]
    with Hosts(2, rate="10gbit") as hosts:
        procs = start_job(hosts, tmp_path, {0: ["--reconnect", "3"]}, "--epochs", "60", "--batch-size", "32", *tls)
        wait_for_training(hosts, procs)
        hosts.cut(0)
        started = time.monotonic()
        rc = procs[2].wait(timeout=LINK_TIMEOUT_S + 30)
        stopped_after = time.monotonic() - started
        hosts.restore(0)
        results = finish(procs)
    (rc0, server0, _), (rc1, server1, _), (_, _, err0), (rc3, learner1, _) = results
    assert rc != 0 and stopped_after < LINK_TIMEOUT_S + 20, stopped_after
    assert "lost the server" in err0 and "3 s" in err0, err0[-2000:]
    assert [rc0, rc1, rc3] == [0, 0, 0] and learner1["test_accuracy"] > 0.9
    for i, stats in enumerate((server0, server1)):
        assert checkpoint.load(str(tmp_path / f"ckpt-{i}")).clock == stats["updates"] > 0

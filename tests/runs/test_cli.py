"""The command line with real processes: train, server + learners, fast and clear failures."""

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import CLI_ARGS, free_port, last_json, reap, run_cli, start_cli, start_server, subprocess_env

from rudra_async import checkpoint


def test_train_writes_results_json(tmp_path):
    out = tmp_path / "r.json"
    proc = run_cli("train", "--learners", "2", "--epochs", "1", "--batch-size", "16", "--quiet", "--results", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    for key in [
        "protocol",
        "learners",
        "batch_size",
        "updates",
        "wall_s",
        "test_accuracy",
        "staleness_mean",
        "staleness_max",
    ]:
        assert key in res
    assert res["protocol"] == "async" and res["learners"] == 2 and res["batch_size"] == 16
    steps = -(-1437 // (2 * 16))  # each learner does epochs·N/(λμ) steps (N = 1,437 training digits)
    assert res["updates"] == 2 * steps  # async: one update per gradient
    assert sum(res["staleness_histogram"].values()) == res["gradients"] == 2 * steps
    assert set(res["per_learner"]) == {"0", "1"}
    assert all(v["gradients"] == steps for v in res["per_learner"].values())  # both processes really pushed
    assert 0.0 <= res["test_accuracy"] <= 1.0 and res["wall_s"] > 0
    assert "test accuracy" in proc.stdout


def test_default_train_reaches_target_accuracy_and_its_checkpoint_evaluates_the_same(tmp_path):
    out, weights = tmp_path / "r.json", tmp_path / "model.ckpt"
    proc = run_cli("train", "--quiet", "--results", str(out), "--checkpoint", str(weights), timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["learners"] == 4
    assert res["test_accuracy"] >= 0.93, res
    assert res["staleness_max"] >= 1  # four concurrent learners really do overlap
    proc = run_cli("evaluate", str(weights), "--json")
    assert proc.returncode == 0, proc.stderr
    evaluated = json.loads(proc.stdout)
    assert evaluated["clock"] == res["updates"] and evaluated["test_accuracy"] == res["test_accuracy"]
    proc = run_cli("evaluate", str(weights), "--model", "linear")
    assert proc.returncode == 2 and "are not those of model 'linear'" in proc.stderr


def test_server_and_learners_in_separate_processes():
    port = free_port()
    server = start_server(port, "--max-updates", "40")
    learners = []
    try:
        learners = [
            start_cli("learner", "--connect", f"tcp://127.0.0.1:{port}", "--index", str(i), "--json",
                      "--progress-every", "0.001")
            for i in range(2)
        ]  # fmt: skip
        summaries = []
        for i, p in enumerate(learners):
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            assert re.search(rf"learner {i}: step \d+, server update \d+, loss \d", err), err  # progress lines
            summaries.append(last_json(out))
        assert sorted(s["learner_id"] for s in summaries) == [0, 1]
        assert sum(s["steps"] for s in summaries) == 40  # the server said stop at 40 updates
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=30)
        assert server.returncode == 0, err
        stats = last_json(err)
        assert stats["updates"] == 40
    finally:
        reap(server, *learners)


def test_wrong_address_fails_at_once():
    started = time.monotonic()
    proc = run_cli("learner", "--connect", f"tcp://127.0.0.1:{free_port()}")
    assert proc.returncode == 2
    assert "cannot connect to tcp://127.0.0.1:" in proc.stderr
    assert time.monotonic() - started < 30  # includes interpreter and torch start-up


def test_port_in_use_fails_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("server", "--listen", f"tcp://127.0.0.1:{port}", timeout=30)
    assert proc.returncode == 2
    assert f"cannot listen on tcp://127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["server", "--lr", "-1"], "--lr must be > 0, got -1"),
        (["server", "--lr", "inf"], "--lr must be a finite number"),
        (["server", "--weight-decay", "nan"], "--weight-decay must be a finite number"),
        (["server", "--momentum", "1"], "--momentum must be < 1"),
        (["server", "--shard", "2/2"], "shard must be I/N with 0 <= I < N"),
        (["server", "--listen", "127.0.0.1:7000"], "has no scheme"),
        (["server", "--listen", "carrier-pigeon://x:1"], "no transport for scheme"),
        (["server", "--listen", "tcp://[::1:7000"], "address 'tcp://[::1:7000' is not a URL"),
        (["server", "--listen", "tcp://127.0.0.1:7000/x"], "has more than a host and a port"),
        (["train", "--learners", "0"], "--learners must be >= 1, got 0"),
        (["launch", "--rendezvous", "/tmp", "--servers", "0", "--show-config"], "--servers must be >= 1, got 0"),
        (["train", "--results", "/nonexistent-dir/r.json"], "cannot write results to /nonexistent-dir/r.json"),
        (["train", "--transport", "memory"], "cannot reach learner processes"),
        (["train", "--transport", "pigeon"], "no transport for scheme"),
        (["train", "--protocol", "softsync", "--n", "8", "--learners", "4"], "n <= λ"),
        (["learner", "--connect", "tcp://127.0.0.1:1", "--model", "nope"], "unknown model"),
    ],
)
def test_bad_configuration_is_a_clear_error(args, message):
    proc = run_cli(*args, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (children, theirs, …), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("group", [False, True], ids=["SIGTERM to train", "Ctrl-C to the process group"])
def test_a_stopped_train_writes_its_checkpoint_and_leaves_no_process(tmp_path, group):
    """SIGTERM (a scheduler's time limit, ``docker stop``) or Ctrl-C stops a run in order: its
    learners are stopped, the final checkpoint is written, nothing is left running and no
    learner prints a traceback."""
    ckpt, results = tmp_path / "run.ckpt", tmp_path / "results.json"
    args = ["train", "-l", "2", "--epochs", "10000", "--checkpoint", str(ckpt), "--results", str(results)]
    with subprocess.Popen(
        [*CLI_ARGS, *args], stderr=subprocess.PIPE, text=True, env=subprocess_env(), start_new_session=True
    ) as proc:
        try:
            for line in proc.stderr:  # progress lines, one a second: wait for updates to come
                clock = re.search(r"updates +(\d+)", line)
                if clock and int(clock[1]) > 0:
                    break
            below = _descendants(proc.pid)
            assert len(below) >= 3, below  # the fork server and two learners at least
            if group:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            err = proc.stderr.read()
            assert proc.wait(timeout=60) == 2
        finally:
            reap(proc)
    name = "SIGINT" if group else "SIGTERM"
    assert f"error: the run was stopped by {name}; the results so far are in {results}" in err, err
    assert "Traceback" not in err and "without a bye" not in err, err  # an orderly stop, not crashes
    reached = json.loads(results.read_text())
    assert reached["stopped_by"] == name and reached["updates"] > 0 and reached["test_accuracy"] is not None
    assert checkpoint.load(ckpt).clock >= reached["updates"]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in below if _alive(pid)]


def test_a_signal_after_the_learners_ended_still_writes_the_checkpoint_and_says_so(tmp_path, monkeypatch):
    """SIGTERM while the run evaluates its model (its learners are done) is not lost and does
    not cut the shutdown short: the servers close, writing the final checkpoint, and the run
    ends with the error naming the signal."""
    import dataclasses

    from rudra_async.config import TrainConfig
    from rudra_async.errors import RudraError
    from rudra_async.eventloop import run
    from rudra_async.runs import train

    evaluate = train.summarize

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the run's loop once this returns
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(train, "summarize", interrupted)
    ckpt = tmp_path / "run.ckpt"
    base = TrainConfig()
    cfg = dataclasses.replace(
        base, learners=1, updates=10, server=dataclasses.replace(base.server, checkpoint=str(ckpt))
    )
    with pytest.raises(RudraError, match="the run was stopped by SIGTERM"):
        run(train.train(cfg))
    assert checkpoint.load(ckpt).clock == 10


@pytest.mark.parametrize("owner_cancels", [False, True], ids=["signal", "signal and the owner's cancel"])
async def test_a_signal_ends_the_learners_run_but_an_owners_cancel_stays_one(owner_cancels):
    """A signal cancels the learners' run, which then ends quietly (the run stops in order);
    if the run's owner cancels it too, that cancellation is not swallowed."""
    import asyncio

    from rudra_async.runs.train import _SignalStop

    stop = _SignalStop()  # not entered: no handler installed, the signal is handed in below
    learners_run = asyncio.ensure_future(stop.interruptible(asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    stop._on_signal(signal.SIGTERM)
    if owner_cancels:
        learners_run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await learners_run
    else:
        assert await learners_run is None
    assert learners_run.done() and stop.received == [signal.SIGTERM]


def test_a_misspelt_variable_is_named_in_a_warning_and_the_real_ones_are_not():
    """A RUDRA_ASYNC_* name that nothing reads used to be ignored without a word, so a typo
    silently ran with the default. Real settings, the variables read by name and a
    transport's own (RUDRA_ASYNC_<SCHEME>_*) pass without a warning."""
    env = {
        "RUDRA_ASYNC_SERVER_LRR": "0.5",
        "RUDRA_ASYNC_SERVER_MOMENTUM": "0.5",
        "RUDRA_ASYNC_BUSY_POLL_US": "100",
        "RUDRA_ASYNC_UCX_PROGRESS": "thread",
    }
    proc = run_cli("server", "--show-config", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["momentum"] == 0.5 and json.loads(proc.stdout)["lr"] == 0.03  # LRR: ignored
    warned = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warned) == 1, proc.stderr
    assert (
        "RUDRA_ASYNC_SERVER_LRR is not a variable rudra-async reads (did you mean 'RUDRA_ASYNC_SERVER_LR'?)"
        in warned[0]
    )


def test_every_variable_the_package_reads_by_name_is_known():
    """Each RUDRA_ASYNC_* name written in the package's source is one the warning above knows."""
    from rudra_async import cli

    source = Path(cli.__file__).parent
    names = {m for path in source.rglob("*.py") for m in re.findall(r'"(RUDRA_ASYNC_[A-Z0-9_]+)"', path.read_text())}
    assert "RUDRA_ASYNC_SECRET" in names and "RUDRA_ASYNC_BUSY_POLL_US" in names  # the scan finds them
    assert cli.unknown_variables({name: "" for name in names}) == []

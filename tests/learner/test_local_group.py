"""Learner groups (the paper's "adv", rudra_async.learner.local_group): G learner processes
on one host add their gradients and meet the server as one learner."""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import free_port, reap, run_cli, start_server, subprocess_env
from torch import nn

from rudra_async.client import SyncClient
from rudra_async.config import LaunchConfig, LearnerOptions
from rudra_async.errors import ConfigError, LearnerError
from rudra_async.layout import Layout
from rudra_async.learner.local_group import GroupClient, LocalGroup

pytestmark = pytest.mark.torch
LAYOUT = Layout.from_shapes([("weight", (3, 5)), ("bias", (3,))])  # MEMBER's model

#: one member of a group: its own fixed mini-batch, ``steps`` steps, then its final weights
MEMBER = """
import json, sys, torch
from torch import nn
import rudra_async.torch as rt
from rudra_async.learner.local_group import LocalGroup
url, group_index, rank, size, address, steps = sys.argv[1:7]
ROWS = [4, 12, 8, 8]  # unequal mini-batches: a group's gradient is weighted by its members' samples
torch.manual_seed(0)
model = nn.Linear(5, 3)
k = int(group_index) * int(size) + int(rank)
x = torch.randn(ROWS[k], 5, generator=torch.Generator().manual_seed(100 + k))
y = torch.arange(ROWS[k]) % 3
group = LocalGroup(int(rank), int(size), address, timeout=60)
opt = rt.DistributedOptimizer(model, url, index=int(group_index), group=group, threads=1)
taken = 0
for _ in range(int(steps)):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    taken += 1
    if not opt.step(loss=loss, samples=len(x)):
        break
print(json.dumps({"weights": [p.tolist() for p in model.parameters()], "stamp": opt.timestamp, "taken": taken,
                  "index": opt.index, "learners": opt.learners}), flush=True)
opt.close()
"""


def run_groups(tmp_path, protocol, steps_of, groups=2, size=2):
    """``groups`` groups of ``size`` member processes on a server; ``steps_of(k)`` the steps
    learner k (group k // size, rank k % size) takes. Returns each member's report, in k order,
    and the server's clock at the end."""
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    port = free_port()
    server = start_server(port, "--protocol", protocol, "--expected-learners", str(groups), "--lr", "0.1",
                          "--momentum", "0.9")  # fmt: skip
    members = []
    try:
        for g in range(groups):
            address = f"127.0.0.1:{free_port()}"
            for r in range(size):
                k = g * size + r
                args = [f"tcp://127.0.0.1:{port}", str(g), str(r), str(size), address, str(steps_of(k))]
                members.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=subprocess_env(),
                    )
                )
        reports = []
        for p in members:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
        with SyncClient(f"tcp://127.0.0.1:{port}", LAYOUT) as client:
            return reports, client.pull().timestamp
    finally:
        reap(server, *members)


def test_hardsync_over_groups_is_sgd_on_the_concatenated_batch(tmp_path):
    steps = 6
    reports, clock = run_groups(tmp_path, "hardsync", lambda k: steps)
    assert clock == steps
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    rows = [4, 12, 8, 8]  # MEMBER's: each group has 16 samples, so the server's mean over groups is theirs
    x = torch.cat([torch.randn(rows[k], 5, generator=torch.Generator().manual_seed(100 + k)) for k in range(4)])
    y = torch.cat([torch.arange(n) % 3 for n in rows])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        sgd.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        sgd.step()
    expected = [p.detach() for p in model.parameters()]
    for k, report in enumerate(reports):
        assert report["stamp"] == steps  # one update per round of the 2 groups' gradients
        assert (report["index"], report["learners"]) == (k, 4)  # each member its own part of 4
        for got, want in zip(report["weights"], expected):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_a_group_ends_with_its_first_member_and_the_server_counts_one_gradient_per_group(tmp_path):
    # learner 1 stops after 3 steps: its group's other member (who would take 10) stops there too;
    # the other group goes on alone (async) to its 10
    reports, clock = run_groups(tmp_path, "async", lambda k: 3 if k == 1 else 10)
    assert [r["taken"] for r in reports] == [4, 3, 10, 10]  # member 0's 4th step found the group ended
    assert clock == 3 + 10  # one gradient per group step: 3 of group 0, 10 of group 1
    assert reports[2]["stamp"] == reports[3]["stamp"]
    assert reports[0]["weights"] == reports[1]["weights"]


@pytest.mark.long
def test_train_with_groups_trains_and_refuses_what_groups_cannot_do(tmp_path):
    out = tmp_path / "r.json"
    proc = run_cli("train", "-q", "-l", "4", "--group-size", "2", "--epochs", "10", "--results", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["test_accuracy"] > 0.9
    assert results["group_size"] == 2 and results["per_learner"] and len(results["per_learner"]) == 2
    bad = run_cli("train", "-l", "3", "--group-size", "2")
    assert bad.returncode != 0 and "--group-size 2 must divide" in bad.stderr
    bad = run_cli("train", "-l", "4", "--group-size", "2", "--overlap")
    assert bad.returncode != 0 and "overlap" in bad.stderr


def test_members_with_different_models_are_refused_by_every_member():
    port = free_port()
    server = start_server(port, "--expected-learners", "1")
    address = f"127.0.0.1:{free_port()}"
    layouts = [LAYOUT, Layout.from_shapes([("weight", (3, 5)), ("bias", (4,))])]
    errors = [None, None]

    def member(rank):
        def connect():
            return SyncClient(f"tcp://127.0.0.1:{port}", layouts[rank], np.zeros(layouts[rank].size, np.float32))

        try:
            GroupClient(LocalGroup(rank, 2, address, timeout=30), connect, layouts[rank])
        except Exception as exc:
            errors[rank] = f"{type(exc).__name__}: {exc}"

    try:
        threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors[0].startswith("LearnerError") and "a member's differs from this leader's" in errors[0], errors
        assert errors[1].startswith("LearnerError") and "this learner's differs from the leader's" in errors[1], errors
    finally:
        reap(server)


def test_a_group_needs_its_address_and_launch_refuses_groups():
    bad = run_cli("learner", "--connect", "tcp://127.0.0.1:1", "--group-size", "2")
    assert bad.returncode != 0 and "--group-size needs --group-address" in bad.stderr
    bad = run_cli("learner", "--connect", "tcp://127.0.0.1:1", "--group-size", "2", "--group-rank", "2",
                  "--group-address", "127.0.0.1:1")  # fmt: skip
    assert bad.returncode != 0 and "--group-rank 2 is not a rank of a group of 2" in bad.stderr
    with pytest.raises(ConfigError, match="launch does not form learner groups yet"):
        LaunchConfig(learner=LearnerOptions(group_size=2)).validate()
    with pytest.raises(LearnerError, match="host:port"):
        LocalGroup(0, 2, "nowhere")

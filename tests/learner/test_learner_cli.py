"""The learner CLI with the user's own parts (--model/--data/--loss module:function, imported
from the current directory), overlapped learners, and bad parts as one-line errors while the
server goes on."""

import json
import signal
import subprocess
import textwrap

import pytest
from helpers import CLI_ARGS, free_port, last_json, reap, run_cli, start_server, subprocess_env

pytestmark = pytest.mark.torch

USER_MODULE = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = model(), nn.Linear(2, 2)   # head is never called

        def forward(self, x):
            return self.body(x)

    def unused():
        return Unused()

    def data(index, learners, batch_size):
        g = torch.Generator().manual_seed(index)
        x = torch.randn(48, 5, generator=g)
        return DataLoader(TensorDataset(x, x[:, :2] * 2.0), batch_size=batch_size)

    def broken_data():
        raise ValueError("the bucket is empty")

    def per_sample(output, target):
        return ((output - target) ** 2).sum(1)   # not reduced: a vector, not a scalar
""")


def run_in(directory, *args, timeout=180):
    return subprocess.run([*CLI_ARGS, *args], cwd=directory, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env())  # fmt: skip


def test_train_runs_the_users_model_data_and_loss(tmp_path):
    (tmp_path / "mine.py").write_text(USER_MODULE)
    out = tmp_path / "r.json"
    proc = run_in(tmp_path, "train", "-q", "--learners", "2", "--epochs", "3", "--batch-size", "16", "--loss", "mse",
                  "--model", "mine:model", "--data", "mine:data", "--lr", "0.05", "--results", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["updates"] == 2 * 3 * 3  # 2 learners × 3 passes × 3 batches of 16 of their 48 samples
    assert all(s["steps"] == 9 for s in result["learner_summaries"])
    losses = [loss for _, loss in result["loss_curve"]]
    assert losses[-1] < losses[0]  # the regression trains


BAD_PARTS = [
    (["--model", "mine:model", "--data", "mine:broken_data"],
     "data function 'mine:broken_data' raised ValueError: the bucket is empty"),
    (["--model", "mine:model", "--data", "mine:data", "--loss", "mine:per_sample"],
     "loss 'mine:per_sample' returned [16], expected a scalar tensor"),
    (["--model", "nowhere:model", "--data", "mine:data"],
     "--model 'nowhere:model': cannot import module 'nowhere' from the current directory or PYTHONPATH"),
    (["--model", "mine:nothing", "--data", "mine:data"], "--model 'mine:nothing': module 'mine' has no 'nothing'"),
    (["--model", "mlp", "--data", "mine:data"], "with --data give --model module:function"),
]  # fmt: skip


def test_bad_parts_are_one_line_errors_and_the_server_goes_on(tmp_path):
    """Each bad part, one after the other against the same server: a one-line error, and the
    server serves the learner after it as if nothing had happened."""
    (tmp_path / "mine.py").write_text(USER_MODULE)
    port = free_port()
    server = start_server(port, "--protocol", "async", "--max-updates", "3")
    good = ["learner", "--connect", f"tcp://127.0.0.1:{port}", "--json", "--model", "mine:model", "--data",
            "mine:data", "--loss", "mse", "--batch-size", "16"]  # fmt: skip
    try:
        assert run_in(tmp_path, *good, "--steps", "1").returncode == 0  # the model the server holds
        for args, message in BAD_PARTS:
            bad = run_in(tmp_path, "learner", "--connect", f"tcp://127.0.0.1:{port}", "--batch-size", "16", *args)
            assert bad.returncode == 2, bad.stderr
            assert message in bad.stderr and "Traceback" not in bad.stderr, (message, bad.stderr)
            assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        after = run_in(tmp_path, *good)
        assert after.returncode == 0, after.stderr
        assert last_json(after.stdout)["steps"] == 2  # the server's run ends at 3 updates
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        assert server.returncode == 0 and last_json(err)["updates"] == 3
    finally:
        reap(server)


def test_a_layer_without_gradient_is_named_and_the_server_keeps_its_weights(tmp_path):
    (tmp_path / "mine.py").write_text(USER_MODULE)
    port = free_port()
    server = start_server(port, "--protocol", "async")
    try:
        bad = run_in(tmp_path, "learner", "--connect", f"tcp://127.0.0.1:{port}", "--model", "mine:unused",
                     "--data", "mine:data", "--loss", "mse", "--batch-size", "16")  # fmt: skip
        assert bad.returncode == 2 and "Traceback" not in bad.stderr
        assert "no gradient for parameter(s) head.weight, head.bias in this step" in bad.stderr
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
        assert server.returncode == 0 and last_json(err)["updates"] == 0  # nothing was pushed
    finally:
        reap(server)


@pytest.mark.long
def test_overlap_adds_one_step_of_staleness_and_digits_still_train(tmp_path):
    """--overlap computes each gradient on weights one learner step older: with one learner
    (async) σ goes from 0 to exactly 1; with two, by about one step of each learner (~2
    updates). Accuracy on digits stays at the target."""
    results = {}
    for learners, overlap in ((1, False), (1, True), (2, True)):
        out = tmp_path / f"{learners}-{overlap}.json"
        args = ["train", "-q", "-l", str(learners), "--results", str(out), *(["--overlap"] if overlap else [])]
        proc = run_cli(*args, timeout=300)
        assert proc.returncode == 0, proc.stderr
        results[learners, overlap] = json.loads(out.read_text())
    assert results[1, False]["staleness_histogram"] == {"0": results[1, False]["updates"]}
    alone = results[1, True]
    assert alone["staleness_histogram"] == {"0": 1, "1": alone["updates"] - 1}  # all but the first: one step old
    for result in (alone, results[2, True]):
        assert result["test_accuracy"] >= 0.93, result
    assert 1.5 <= results[2, True]["staleness_mean"] <= 4.5, results[2, True]["staleness_histogram"]

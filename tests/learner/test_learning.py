"""The paper's central finding on digits with real learner processes (λ = 8, μ = 8):
with a fixed α0 (``--lr-policy constant``), 8-softsync (⟨σ⟩ ≈ 6) fails to train; with
α0/σ it matches hardsync."""

import json

import pytest
from helpers import run_cli


def train(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    proc = run_cli("train", "-q", "-l", "8", "-b", "8", "--results", str(out), *args, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


@pytest.mark.long
def test_staleness_aware_lr_rescues_8_softsync(tmp_path):
    hard = train(tmp_path, "hard", "--protocol", "hardsync")
    soft_const = train(tmp_path, "const", "--protocol", "softsync", "--n", "8", "--lr-policy", "constant")
    soft_stale = train(tmp_path, "stale", "--protocol", "softsync", "--n", "8", "--lr-policy", "staleness")
    summary = {
        k: (round(r["test_accuracy"], 4), round(r["staleness_mean"], 2))
        for k, r in [("hardsync", hard), ("8-softsync α0", soft_const), ("8-softsync α0/σ", soft_stale)]
    }
    print(summary)
    assert hard["staleness_max"] == 0
    assert 4 <= soft_stale["staleness_mean"] <= 12  # ⟨σ⟩ ≈ n
    assert soft_const["test_accuracy"] < 0.5, summary  # fixed α0 does not train
    # α0/σ reaches hardsync's accuracy. One run is one draw of the learners' interleaving: seed 0
    # measured 0.930, 0.969, 0.975 for α0/σ and 0.967, 0.969 for hardsync (one draw in a full
    # suite's run: 0.886); the mean over 4 seeds was 0.975 vs 0.958. So a run is held to
    # hardsync − 0.05, far above fixed α0's ≈ 0.1; a draw below it is judged with a second
    # seed, by the mean of the two.
    accuracy = soft_stale["test_accuracy"]
    if accuracy < max(hard["test_accuracy"] - 0.05, 0.9):
        again = train(tmp_path, "stale-again", "--protocol", "softsync", "--n", "8", "--lr-policy", "staleness",
                      "--seed", "1")  # fmt: skip
        accuracy = (accuracy + again["test_accuracy"]) / 2
    assert accuracy >= hard["test_accuracy"] - 0.05, summary
    assert accuracy >= 0.9, summary

"""The learners' --tensorboard scalars: written by TrainingLog, read back as TensorBoard reads them."""

import pytest

from rudra_async.errors import ConfigError

pytestmark = pytest.mark.torch


def scalars(directory) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_training_log_writes_loss_staleness_and_throughput_by_step(tmp_path):
    from rudra_async.learner.tensorboard import open_log, updates_between

    log = open_log(str(tmp_path), "learner-3")
    for step in range(1, 4):
        log.record(step, loss=1.0 / step, staleness=step - 1, samples_per_s=100.0 * step)
    log.record(4, loss=0.2, lr=0.05, accuracy=0.9)  # only what is given
    log.close()
    found = scalars(tmp_path / "learner-3")
    assert [s for s, _ in found["train/loss"]] == [1, 2, 3, 4]
    assert found["train/loss"][1][1] == pytest.approx(0.5)
    assert [v for _, v in found["train/staleness"]] == [0, 1, 2]
    assert [v for _, v in found["train/samples_per_s"]] == [100, 200, 300]
    assert found["train/lr"] == [(4, pytest.approx(0.05))] and found["test/accuracy"] == [(4, pytest.approx(0.9))]
    assert open_log(None, "x").record(1, loss=1.0) is None  # no directory: nothing written
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"--tensorboard .*a-file/x: cannot write there"):
        open_log(str(tmp_path / "a-file"), "x")
    assert updates_between(5, 6) == 0 and updates_between(5, 9) == 3 and updates_between((2, 2), (4, 5)) == 1


def test_train_with_tensorboard_writes_one_run_per_learner(tmp_path):
    from helpers import run_cli

    proc = run_cli(
        "train", "--learners", "2", "--updates", "30", "--quiet", "--tensorboard", str(tmp_path), "--kernel", "numpy"
    )
    assert proc.returncode == 0, proc.stderr
    runs = sorted(p.name for p in tmp_path.iterdir())
    assert runs == ["learner-0", "learner-1"]
    found = [scalars(tmp_path / run) for run in runs]  # a learner started late may have had no step
    assert sum(len(f.get("train/loss", [])) for f in found) >= 30  # a step per gradient the server took
    assert all(v >= 0 for f in found for _, v in f.get("train/staleness", []))
    steps = sorted(s for f in found for s, _ in f.get("train/loss", []))
    assert steps[0] >= 0 and steps[-1] < 30 and len(set(steps)) > 15  # the server's clock, shared by both runs
    assert all(v == pytest.approx(0.03) for f in found for _, v in f.get("train/lr", []))  # train's default α0
    assert all(0 < v <= 1 for f in found for _, v in f.get("test/accuracy", []))


def test_train_refuses_a_directory_it_cannot_write_before_any_learner_starts(tmp_path):
    """The directory used to be checked only by each learner, after the server and λ
    processes had started (λ errors, seconds later); the settings' check refuses it now."""
    from helpers import run_cli

    (tmp_path / "a-file").write_text("")
    proc = run_cli(
        "train", "--learners", "3", "--updates", "10", "--quiet", "--tensorboard", str(tmp_path / "a-file/x")
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: --tensorboard {tmp_path / 'a-file/x'}: cannot write there ({tmp_path / 'a-file'} is not a directory)"
    ]


def test_a_missing_tensorboard_package_is_refused_with_the_settings(monkeypatch):
    import importlib.util

    from rudra_async.config import LearnerOptions

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs the tensorboard package: pip install 'rudra-async\[tensorboard\]'"):
        LearnerOptions(tensorboard="runs").validate()
    LearnerOptions().validate()  # without --tensorboard, nothing is needed

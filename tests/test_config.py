"""One source of truth: flags, environment variables, study keys and checks all come from
the configuration dataclasses."""

import dataclasses

import click
import pytest
from click.testing import CliRunner

from rudra_async.cli import main
from rudra_async.config import LaunchConfig, LearnerConfig, ServerConfig, TrainConfig
from rudra_async.errors import ConfigError
from rudra_async.layout import Shard
from rudra_async.options import flat_fields, from_flat
from rudra_async.runs.study import POINT_KEYS, expand

COMMANDS = {
    "server": (ServerConfig, ()),
    "learner": (LearnerConfig, ()),
    "train": (TrainConfig, TrainConfig.SET_BY_RUN),
    "launch": (LaunchConfig, LaunchConfig.SET_BY_RUN),
}


def params(command: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in main.commands[command].params}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_setting_is_a_flag_with_the_fields_default_and_help(command):
    cls, exclude = COMMANDS[command]
    flags = params(command)
    for name, (_, field, _) in flat_fields(cls, exclude).items():
        if not field.metadata["cli"]:
            assert name not in flags
            continue
        flag = flags[name]
        assert flag.help == field.metadata["help"], name
        if field.default is not dataclasses.MISSING and field.metadata["parse"] is None:
            assert flag.default == field.default, name


def test_study_keys_are_the_settings_of_train():
    assert set(TrainConfig.settings()) == set(params("train")) - {"results", "quiet"}  # those two only print
    with pytest.raises(ConfigError, match="unknown setting 'host'"):  # set by the run itself, not a flag
        expand({"runs": [{"host": "0.0.0.0"}]})
    assert set(POINT_KEYS) == {"mode", "group", "jitter", "heterogeneity"}


def test_environment_variables_reach_the_same_checks():
    runner = CliRunner()
    result = runner.invoke(main, ["server"], env={"RUDRA_ASYNC_SERVER_LR": "inf"})
    assert result.exit_code == 2 and "--lr must be a finite number" in result.output
    result = runner.invoke(main, ["train"], env={"RUDRA_ASYNC_TRAIN_LEARNERS": "0"})
    assert result.exit_code == 2 and "--learners must be >= 1, got 0" in result.output


def test_values_are_type_checked_and_unknown_keys_name_the_nearest():
    with pytest.raises(ConfigError, match="lr must be float, got 'fast'"):
        from_flat(ServerConfig, {"lr": "fast"})
    with pytest.raises(ConfigError, match=r"n must be int, got 2\.5"):
        from_flat(ServerConfig, {"n": 2.5})
    with pytest.raises(ConfigError, match="unknown setting 'momentun' \\(did you mean 'momentum'\\?\\)"):
        from_flat(ServerConfig, {"momentun": 0.5})
    cfg = from_flat(ServerConfig, {"shard": "1/2", "lr_decay_at": [10, 20], "lr": 1})
    assert cfg.shard == Shard(1, 2) and cfg.lr_decay_at == (10.0, 20.0) and cfg.lr == 1.0


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"lr": 0.0}, "--lr must be > 0"),
        ({"momentum": 1.0}, "--momentum must be < 1"),
        ({"weight_decay": float("nan")}, "--weight-decay must be a finite number"),
        ({"lr_decay": 0.0}, "--lr-decay must be > 0"),
        ({"max_frame": 10}, "--max-frame must be >= 1024"),
        ({"warmup": -1}, "--warmup must be >= 0"),
        ({"lr_decay_at": (float("inf"),)}, "--lr-decay-at milestones must be finite"),
    ],
)
def test_every_numeric_setting_is_checked_for_finiteness_and_range(setting, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**setting).validate()

"""One source of truth: flags, environment variables, study keys and checks all come from
the configuration dataclasses."""

import dataclasses
import json

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
    not_settings = {"results", "quiet", "config", "show_config"}  # what to print, and where settings come from
    assert set(TrainConfig.settings()) == set(params("train")) - not_settings
    with pytest.raises(ConfigError, match="unknown setting 'host'"):  # set by the run itself, not a flag
        expand({"runs": [{"host": "0.0.0.0"}]})
    assert set(POINT_KEYS) == {"mode", "group", "jitter", "heterogeneity"}


def test_environment_variables_reach_the_same_checks():
    runner = CliRunner()
    result = runner.invoke(main, ["server"], env={"RUDRA_ASYNC_SERVER_LR": "inf"})
    assert result.exit_code == 2 and "--lr must be a finite number" in result.output
    result = runner.invoke(main, ["train"], env={"RUDRA_ASYNC_TRAIN_LEARNERS": "0"})
    assert result.exit_code == 2 and "--learners must be >= 1, got 0" in result.output


def test_a_bad_value_from_a_variable_names_the_variable_and_minus_v_is_the_version():
    runner = CliRunner()
    result = runner.invoke(main, ["train"], env={"RUDRA_ASYNC_TRAIN_LEARNERS": "abc"})
    assert result.exit_code == 2 and "the environment variable RUDRA_ASYNC_TRAIN_LEARNERS" in result.output
    assert "'--learners'" not in result.output, result.output  # the user never typed the flag
    result = runner.invoke(main, ["train", "-l", "abc"])
    assert result.exit_code == 2 and "'--learners'" in result.output
    result = runner.invoke(main, ["-V"])
    assert result.exit_code == 0 and result.output.startswith("rudra-async, version ")


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
        # a longer window would not fit in a checkpoint; an int bound is shown exactly
        ({"mean_staleness_window": (1 << 23) + 1}, "--mean-staleness-window must be <= 8388608, got 8388609"),
    ],
)
def test_every_numeric_setting_is_checked_for_finiteness_and_range(setting, message):
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**setting).validate()


def show_config(*args: str, env: dict | None = None) -> dict:
    result = CliRunner().invoke(main, [*args, "--show-config"], env=env or {})
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_config_file_ranks_below_environment_variables_and_flags(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text('lr = 0.5\nmomentum = 0.5\nprotocol = "softsync"\nn = 2\nlisten = ["tcp://127.0.0.1:0"]\n')
    cfg = show_config("server", "--config", str(path))
    assert (cfg["lr"], cfg["momentum"], cfg["protocol"], cfg["n"]) == (0.5, 0.5, "softsync", 2)
    assert cfg["listen"] == ["tcp://127.0.0.1:0"] and cfg["weight_decay"] == 0.0  # file, then the defaults
    cfg = show_config("server", "--config", str(path), env={"RUDRA_ASYNC_SERVER_LR": "0.2"})
    assert (cfg["lr"], cfg["momentum"]) == (0.2, 0.5)  # environment over file
    cfg = show_config(
        "server", "--config", str(path), "--lr", "0.1", "--momentum", "0.9", env={"RUDRA_ASYNC_SERVER_LR": "0.2"}
    )
    assert (cfg["lr"], cfg["momentum"]) == (0.1, 0.9)  # flags over both, even one equal to the default
    cfg = show_config("server", env={"RUDRA_ASYNC_SERVER_CONFIG": str(path)})  # the file named by a variable
    assert cfg["lr"] == 0.5


def test_config_files_for_train_learner_and_launch_use_the_flat_setting_names(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text('learners = 2\nprotocol = "hardsync"\nlr = 0.1\nbatch_size = 8\nmodel = "linear"\ntimeout = 60\n')
    cfg = show_config("train", "--config", str(path), "--lr", "0.2")
    assert (cfg["learners"], cfg["protocol"], cfg["lr"], cfg["batch_size"], cfg["model"], cfg["timeout"]) == (
        2,
        "hardsync",
        0.2,
        8,
        "linear",
        60.0,
    )
    path.write_text('connect = "tcp://127.0.0.1:7000"\nbatch_size = 16\nreconnect = 5\n')
    cfg = show_config("learner", "--config", str(path))
    assert (cfg["connect"], cfg["batch_size"], cfg["reconnect"]) == ("tcp://127.0.0.1:7000", 16, 5.0)
    path.write_text('rendezvous = "/tmp/rdv"\nservers = 2\nmax_updates = 100\nmetrics = "9100"\n')
    cfg = show_config("launch", "--config", str(path))
    assert (cfg["rendezvous"], cfg["servers"], cfg["max_updates"], cfg["metrics"]) == ("/tmp/rdv", 2, 100, "9100")
    result = CliRunner().invoke(main, ["learner", "--show-config"])
    assert result.exit_code == 2 and "missing setting 'connect' (--connect)" in result.output


@pytest.mark.parametrize(
    "command, text, message",
    [
        ("server", "momentun = 0.5", "unknown setting 'momentun' (did you mean 'momentum'?)"),
        ("train", "learner = 4", "unknown setting 'learner' (did you mean 'learners'?)"),
        ("train", 'listen = ["tcp://127.0.0.1:1"]', "unknown setting 'listen'"),  # set by the run itself
        ("learner", "steps = 'many'", "steps must be int, got 'many'"),
        ("server", "lr = ", "Invalid value"),
        ("server", "lr = 0", "--lr must be > 0, got 0"),
    ],
)
def test_a_config_files_errors_name_the_file_and_the_key(tmp_path, command, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text + "\n")
    result = CliRunner().invoke(main, [command, "--config", str(path), "--show-config"])
    assert result.exit_code == 2 and message in result.output, result.output
    if "unknown" in message or "must be int" in message:
        assert f"config file {path}" in result.output


def test_each_shard_of_a_group_serves_its_metrics_on_its_own_port():
    cfg = ServerConfig(metrics="127.0.0.1:9100")
    ports = [cfg.for_shard(Shard(i, 3), "tcp://127.0.0.1:0").metrics for i in range(3)]
    assert ports == ["127.0.0.1:9100", "127.0.0.1:9101", "127.0.0.1:9102"]
    assert ServerConfig(metrics="0").for_shard(Shard(1, 2), "tcp://127.0.0.1:0").metrics == "0"  # any free port
    assert ServerConfig().for_shard(Shard(1, 2), "tcp://127.0.0.1:0").metrics is None


@pytest.mark.parametrize("command", ["train", "launch"])
def test_overlap_with_a_protocol_that_drops_stale_gradients_is_refused_up_front(command):
    """--overlap makes every gradient one exchange stale: under hardsync (or backup, or bounded
    with s = 0) each would be dropped, so train and launch refuse the pair before starting."""
    base = ["--overlap", *(["--rendezvous", "/tmp/x"] if command == "launch" else []), "--protocol"]
    for protocol in (["hardsync"], ["backup", "--backup", "1"], ["bounded", "--staleness-bound", "0"]):
        result = CliRunner().invoke(main, [command, *base, *protocol, "--show-config"])
        assert result.exit_code != 0 and f"--overlap cannot train with --protocol {protocol[0]}" in result.output
    assert show_config(command, *base, "bounded", "--staleness-bound", "1")["overlap"] is True

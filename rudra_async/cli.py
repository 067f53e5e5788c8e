"""The ``rudra-async`` command: a thin map from flags (and RUDRA_ASYNC_* variables) to configs."""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

import click
from click.core import ParameterSource

from . import __version__, advice
from .config import LaunchConfig, LearnerConfig, LogOptions, ServerConfig, TrainConfig
from .errors import ConfigError, RudraError, RunStopped
from .eventloop import run as run_loop
from .options import click_options, from_flat, nearest, read_file, to_flat

#: how the command logs (``--log-format``): its own stderr lines follow it
_log_format = "text"


def _say(text: str, level: int = logging.INFO, **fields: Any) -> None:
    """A line for stderr: as it is, or with ``--log-format json`` a log record (``fields``
    become its keys), so that every stderr line of a command is then one JSON object."""
    if _log_format == "json":
        logging.getLogger("rudra_async.cli").log(level, "%s", text, extra=fields)
    else:
        click.echo(text, err=True)


def _fail(exc: BaseException) -> None:
    _say(f"error: {exc}", logging.ERROR, code=getattr(exc, "code", None))
    sys.exit(2)


@click.group(context_settings={"auto_envvar_prefix": "RUDRA_ASYNC", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="rudra-async")
@click_options(LogOptions)
def main(log_level: str, log_format: str) -> None:
    """rudra-async: an asyncio parameter server for distributed deep learning."""
    from .logs import configure

    global _log_format
    _log_format = log_format
    configure(log_level, log_format)
    os.environ["RUDRA_ASYNC_LOG_FORMAT"] = log_format  # learner processes a run starts log alike
    for name in unknown_variables(os.environ):
        logging.getLogger(__name__).warning(
            "%s is not a variable rudra-async reads%s; it is ignored", name, nearest(name, known_variables())
        )


def _accuracy(result: dict[str, Any]) -> str:
    """The test accuracy, or why there is none (a --data run has no built-in test set)."""
    value = result.get("test_accuracy")
    return "n/a (--data)" if value is None else f"{value:.4f}"


def _report(result: dict[str, Any], as_json: bool, line: str) -> None:
    """A command's result: one JSON line with --json, else one line for people."""
    click.echo(json.dumps(result) if as_json else line)


def config_file_options(func: Any) -> Any:
    """``--config FILE.toml`` and ``--show-config`` for a command whose settings are a configuration class."""
    func = click.option(
        "--show-config", is_flag=True, help="Print the settings this command would run with (one JSON line) and exit."
    )(func)
    return click.option(
        "--config",
        type=click.Path(dir_okay=False),
        default=None,
        help="Read settings from this TOML file (keys: the setting names, e.g. lr = 0.1); "
        "flags and RUDRA_ASYNC_* variables take precedence over it.",
    )(func)


def _config(cls: type, kwargs: dict[str, Any], exclude: tuple[str, ...] = ()) -> Any:
    """A configuration from a command's flags, its RUDRA_ASYNC_* variables, its --config file
    and the defaults, in that order of precedence (all readers of the same fields). With
    --show-config, print it and exit."""
    kwargs = dict(kwargs)
    path, show = kwargs.pop("config", None), kwargs.pop("show_config", False)
    ctx = click.get_current_context()
    given = {k: v for k, v in kwargs.items() if ctx.get_parameter_source(k) not in (None, ParameterSource.DEFAULT)}
    from_file = read_file(cls, path, exclude=exclude) if path else {}
    cfg = from_flat(cls, {**kwargs, **from_file, **given}, exclude=exclude, where="command line")
    if show:
        if hasattr(cfg, "validate"):
            cfg.validate()
        flat = {k: v for k, v in to_flat(cfg).items() if k in kwargs}
        click.echo(json.dumps(flat, default=str))
        sys.exit(0)
    return cfg


@main.command()
@click_options(ServerConfig)
@config_file_options
def server(**kwargs: Any) -> None:
    """Run a parameter server until interrupted. Weights come from the first learner's hello."""
    from .server import ParameterServer

    async def serve(cfg: ServerConfig) -> None:
        async with ParameterServer(cfg) as ps:
            ps.close_on_signals()
            _say(f"listening on {' '.join(ps.addresses)}", addresses=ps.addresses)
            await ps.serve()
        stats = ps.stats()  # after close: includes the final checkpoint
        if _log_format == "json":
            _say("final statistics", statistics=stats)
        else:
            _say(json.dumps(stats))

    try:
        cfg = _config(ServerConfig, kwargs)
        advice.warn(cfg.validate())
        run_loop(serve(cfg))
    except RudraError as exc:
        _fail(exc)


@main.command()
@click_options(LearnerConfig)
@config_file_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON line.")
def learner(as_json: bool, **kwargs: Any) -> None:
    """Run one PyTorch learner against a server."""
    try:
        cfg = _config(LearnerConfig, kwargs).validate()
        from .learner.loop import run_learner

        summary = run_learner(cfg)
    except RudraError as exc:
        _fail(exc)
    _report(
        summary,
        as_json,
        f"learner {summary['learner_id']}: {summary['steps']} steps, test accuracy {_accuracy(summary)}",
    )


@main.command()
@click_options(TrainConfig, exclude=TrainConfig.SET_BY_RUN)
@config_file_options
@click.option(
    "--results", type=click.Path(dir_okay=False, writable=True), default=None, help="Write results JSON here."
)
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
def train(results: str | None, quiet: bool, **kwargs: Any) -> None:
    """Start a server and λ learner processes here, train, and report accuracy, time and staleness."""
    from .runs.train import train as run_train

    progress = None if quiet else _say
    if logging.getLogger().level > logging.DEBUG:  # joins and leaves are noise in a local run
        logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        if results:
            _check_writable(results)  # now, not after the run
        out = run_loop(run_train(_config(TrainConfig, kwargs, TrainConfig.SET_BY_RUN), progress))
    except RunStopped as exc:  # what the run reached is worth keeping
        if results and exc.results is not None:
            _write_results(results, exc.results)
            _fail(RunStopped(f"{exc}; the results so far are in {results}"))
        _fail(exc)
    except RudraError as exc:
        _fail(exc)
    click.echo(
        f"protocol {out['protocol']} {out['protocol_options'] or ''}  lr policy {out['lr_policy']}  "
        f"learners {out['learners']}  batch {out['batch_size']}  updates {out['updates']}  dropped {out['dropped']}\n"
        f"test accuracy {_accuracy(out)}  wall {out['wall_s']:.1f} s (training {out['train_s']:.1f} s)\n"
        f"staleness mean {out['staleness_mean']:.2f}  max {out['staleness_max']}  histogram {out['staleness_histogram']}"
    )
    if out["learners_failed"]:
        _say(
            f"warning: learners {out['learners_failed']} failed; the run finished with the others",
            logging.WARNING,
            learners_failed=out["learners_failed"],
        )
    if results:
        _write_results(results, out)


def _write_results(path: str, results: dict[str, Any]) -> None:
    try:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=2)
    except OSError as exc:
        _fail(ConfigError(f"cannot write results to {path}: {exc.strerror}"))


def _check_writable(path: str) -> None:
    """Raise ConfigError unless a file can be written at ``path`` (its directory exists and is writable)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write results to {path}: {folder} is not a writable directory")


@main.command()
@click_options(LaunchConfig, exclude=LaunchConfig.SET_BY_RUN)
@config_file_options
def launch(**kwargs: Any) -> None:
    """Run one task of a job started by a cluster engine (srun, mpirun, torchrun, Kubernetes):
    by its rank, a shard server or a learner; or, with --ray, the whole job on a Ray cluster.
    Prints its result as one JSON line."""
    from .runs.launch import launch as run_launch
    from .runs.ray_launch import launch_ray

    try:
        cfg = _config(LaunchConfig, kwargs, LaunchConfig.SET_BY_RUN)
        result = launch_ray(cfg) if cfg.ray is not None else run_launch(cfg)
    except RudraError as exc:
        _fail(exc)
    click.echo(json.dumps(result))


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
def secret(path: str) -> None:
    """Write a new random shared secret to PATH (mode 0600), for --secret-file."""
    from .security import write_secret

    try:
        write_secret(path)
    except RudraError as exc:
        _fail(exc)
    _say(f"wrote a new secret to {path} (readable by you only); give it with --secret-file {path}")


@main.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--model",
    default="mlp",
    show_default=True,
    help="The model the checkpoint was trained with: a built-in name (built for --dataset) or module:function "
    "returning an nn.Module.",
)
@click.option("--dataset", default="digits", show_default=True, help="Built-in data set whose test split to use.")
@click.option(
    "--data",
    default=None,
    help="module:function returning the test batches (a DataLoader or any iterable of (input, target)), "
    "instead of --dataset; needs --model module:function.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
def evaluate(checkpoints: tuple[str, ...], model: str, dataset: str, data: str | None, as_json: bool) -> None:
    """Test accuracy of the model in a checkpoint (written with --checkpoint: the trained
    weights, and the frozen parameters and buffers such as BatchNorm's statistics); for a
    sharded group, give every shard's checkpoint."""
    from .learner.evaluation import evaluate_checkpoint

    try:
        out = evaluate_checkpoint(checkpoints, model, dataset, data)
    except RudraError as exc:
        _fail(exc)
    _report(
        out, as_json, f"update {out['clock']}: test accuracy {out['test_accuracy']:.4f}, loss {out['test_loss']:.4f}"
    )


@main.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--output",
    "-o",
    default=None,
    help="Directory for results.jsonl and the report (default: the spec's [study] output, "
    "else study-output in the current directory).",
)
@click.option("--no-report", is_flag=True, help="Only run the points.")
def study(spec: str, output: str | None, no_report: bool) -> None:
    """Run a study spec (TOML): every point as a run, resumable, then a Markdown report with plots."""
    from .runs.study import run_study

    logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        out = run_study(spec, output, progress=_say, report=not no_report)
    except RudraError as exc:
        _fail(exc)
    click.echo(str(out / "report.md") if not no_report else str(out / "results.jsonl"))


#: what ``advise`` chooses: train's flags for them are not advise's; and what it cannot model
#: (learner groups: neither its runtime model nor a simulated sweep has them)
ADVISED = ("protocol", "n", "lr_policy", "staleness_target", "overlap", "group_size")


@main.command()
@click_options(TrainConfig, exclude=(*TrainConfig.SET_BY_RUN, *ADVISED))
@click.option("--batch-sizes", default=None, help="μ to choose among, comma-separated (default: --batch-size).")
@click.option(
    "--policies",
    default="compensated,staleness,mean-staleness,constant",
    show_default=True,
    help="LR policies to choose among, comma-separated.",
)
@click.option("--target-error", type=float, default=None, help="Want: the fastest run with at most this test error.")
@click.option("--budget-s", type=float, default=None, help="Want: the lowest error predicted within this many seconds.")
@click.option(
    "--tolerance",
    type=float,
    default=0.01,
    show_default=True,
    help="Without a target or budget: the fastest run within this of the lowest test error.",
)
@click.option(
    "--costs",
    "costs_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Measured costs (JSON of benchmarks/runtime_model.py --json); without them nothing is timed.",
)
@click.option(
    "--cores",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Cores the run will have (default: this host's).",
)
@click.option(
    "--evidence", multiple=True, type=click.Path(dir_okay=False), help="A study's results.jsonl (repeatable)."
)
@click.option(
    "--sweep",
    "sweep_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Simulate the allowed candidates with no evidence; results go to DIR/results.jsonl (resumed).",
)
@click.option(
    "--seeds", type=click.IntRange(min=1), default=1, show_default=True, help="Seeds per candidate in --sweep."
)
@click.option(
    "--with-overlap",
    is_flag=True,
    help="Candidates with --overlap too (their --sweep runs are real processes: a simulation cannot overlap).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise(
    batch_sizes: str | None,
    policies: str,
    target_error: float | None,
    budget_s: float | None,
    tolerance: float,
    costs_path: str | None,
    cores: float | None,
    evidence: tuple[str, ...],
    sweep_dir: str | None,
    seeds: int,
    with_overlap: bool,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Recommend protocol, n, μ and LR policy for the run these flags describe: every candidate
    screened by the start-up warnings' rule, timed by the runtime model, and judged by the test
    errors of recorded (or swept) runs (docs/study/advise.md)."""
    from .runs.advise import advise as run_advise

    logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        if target_error is not None and budget_s is not None:
            raise ConfigError("give --target-error or --budget-s, not both")
        objective, value = ("target_error", target_error) if target_error is not None else ("budget_s", budget_s)
        out = run_advise(
            _config(TrainConfig, kwargs, (*TrainConfig.SET_BY_RUN, *ADVISED)),
            batch_sizes=_integers(batch_sizes, "--batch-sizes") if batch_sizes else None,
            policies=[p.strip() for p in policies.split(",") if p.strip()],
            objective=objective if value is not None else "best",
            value=value,
            tolerance=tolerance,
            costs_path=costs_path,
            cores=cores,
            evidence=evidence,
            sweep_dir=sweep_dir,
            seeds=seeds,
            overlap=with_overlap,
            progress=_say,
        )
    except RudraError as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps({k: v for k, v in out.items() if k != "table"}, indent=1))
        return
    click.echo(out["table"])
    rec = out["recommendation"]
    if rec is None:
        click.echo(f"\nno recommendation: {out['reason']}")
        return
    timed = f", predicted {rec['predicted_runtime_s']:.1f} s" if rec["predicted_runtime_s"] is not None else ""
    click.echo(
        f"\nrecommended ({out['reason']}): test error {rec['test_error']:.4f} over {rec['runs']} runs{timed}\n"
        f"  {rec['command']}"
    )


def _integers(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None


@main.command()
@click.argument("address")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.option(
    "--interval", default=1.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds between redraws."
)
@click.option("--count", type=click.IntRange(min=1), default=None, help="Redraw this many times, then exit.")
@click.option("--token-file", default=None, type=click.Path(dir_okay=False), help="The server's --metrics-token-file.")
def status(address: str, as_json: bool, interval: float, count: int | None, token_file: str | None) -> None:
    """Watch a running server: a live table of its clock, updates/s, learners and staleness.
    ADDRESS is its --metrics address (HOST:PORT, PORT, or the URL an application serves it under)."""
    from .monitor.view import fetch, status_url, watch
    from .security import load_token

    try:
        token = load_token(token_file) if token_file else None
        if as_json:
            click.echo(json.dumps(fetch(status_url(address), token=token)))
        else:
            watch(address, interval, count, token)
    except RudraError as exc:
        _fail(exc)


#: the variables read by name rather than as a command's setting; besides these, names that
#: begin with ``RUDRA_ASYNC_<SCHEME>_`` belong to the transport of that URL scheme (e.g.
#: ``RUDRA_ASYNC_UCX_PROGRESS``)
OTHER_VARIABLES = ("RUDRA_ASYNC_SECRET", "RUDRA_ASYNC_BUSY_POLL_US", "RUDRA_ASYNC_SEND_THREAD_BYTES")
PREFIX = "RUDRA_ASYNC_"


def known_variables() -> list[str]:
    """Every ``RUDRA_ASYNC_*`` name a command reads: the settings' variables (as click's
    ``auto_envvar_prefix`` names them: ``RUDRA_ASYNC_[COMMAND_]OPTION``) and :data:`OTHER_VARIABLES`."""
    return [*_option_variables(main, PREFIX), *OTHER_VARIABLES]


def _option_variables(command: click.Command, prefix: str) -> list[str]:
    """The variables of ``command``'s options and, for a group, of its commands'."""
    names = [prefix + p.name.upper() for p in command.params if isinstance(p, click.Option) and p.name]
    for name, sub in getattr(command, "commands", {}).items():
        names += _option_variables(sub, prefix + name.upper().replace("-", "_") + "_")
    return names


def unknown_variables(environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """The ``RUDRA_ASYNC_*`` names in ``environ`` that nothing reads (a misspelt one would
    otherwise be ignored without a word), sorted."""
    candidates = {name for name in environ if name.startswith(PREFIX)} - set(known_variables())
    if not candidates:
        return []
    from .transports import known_schemes  # only now: most runs have nothing to look up

    owned = tuple(PREFIX + scheme.upper() + "_" for scheme in known_schemes())
    return sorted(name for name in candidates if not name.startswith(owned))

"""The ``rudra-async`` command: a thin map from flags (and RUDRA_ASYNC_* variables) to configs."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any

import click

from . import __version__
from .config import DEFAULT_LISTEN, ServerConfig
from .layout import Shard
from .errors import ConfigError, RudraError
from .eventloop import run as run_loop


def _fail(exc: BaseException) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


@click.group(context_settings={"auto_envvar_prefix": "RUDRA_ASYNC", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rudra-async")
@click.option("--log-level", default="INFO", show_default=True, type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def main(log_level: str) -> None:
    """rudra-async: an asyncio parameter server for distributed deep learning."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _parse_option(ctx: Any, param: Any, values: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _parse_shard(ctx: Any, param: Any, value: str) -> Shard:
    try:
        return Shard.parse(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def _parse_milestones(ctx: Any, param: Any, value: str | None) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(",")) if value else ()
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


SERVER_FLAGS = [
    click.option("--protocol", default="async", show_default=True,
                 help="hardsync | softsync | async | bounded | backup | a plugin's name | module:Class."),
    click.option("--n", "n", type=int, default=None, help="softsync: c = ⌊λ/n⌋ gradients per update (1 ≤ n ≤ λ)."),
    click.option("--staleness-bound", type=int, default=None, help="bounded: no gradient applied with σ > this."),
    click.option("--backup", type=int, default=None, help="backup: update after λ − b gradients, drop the late b."),
    click.option("--protocol-option", "protocol_options", multiple=True, callback=_parse_option,
                 help="KEY=VALUE passed to a plugin protocol (repeatable)."),
    click.option("--lr", type=float, default=0.03, show_default=True, help="Base learning rate α0."),
    click.option("--momentum", type=float, default=0.9, show_default=True),
    click.option("--weight-decay", type=float, default=0.0, show_default=True),
    click.option("--nesterov", is_flag=True),
    click.option("--lr-policy", default="constant", show_default=True,
                 help="constant | staleness (α0/σ) | staleness-plus-one (α0/(σ+1)) | mean-staleness (α0/⟨σ⟩) | plugin."),
    click.option("--mean-staleness-window", type=int, default=0, show_default=True,
                 help="mean-staleness: gradients in the window (0: the whole run)."),
    click.option("--lr-option", "lr_policy_options", multiple=True, callback=_parse_option,
                 help="KEY=VALUE passed to a plugin LR policy (repeatable)."),
    click.option("--lr-decay-at", callback=_parse_milestones, default=None, help="Milestones, e.g. 120,130."),
    click.option("--lr-decay", type=float, default=0.1, show_default=True, help="Factor at each milestone."),
    click.option("--lr-decay-unit", type=click.Choice(["updates", "epochs"]), default="updates", show_default=True),
    click.option("--warmup", type=int, default=0, show_default=True, help="Linear warm-up over this many updates."),
    click.option("--kernel", type=click.Choice(["auto", "numpy", "torch", "cupy"]), default="auto", show_default=True,
                 help="Update kernel backend; auto: cupy where a GPU is visible, else torch, else numpy."),
    click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True),
    click.option("--lr-scale-ref-batch", type=int, default=None,
                 help="Linear scaling rule: α × (samples per update)/this, e.g. μλ/μ_ref for hardsync."),
    click.option("--checkpoint", type=click.Path(dir_okay=False), default=None,
                 help="Write weights, momentum and clock here (atomically) when the server stops."),
    click.option("--checkpoint-every", type=int, default=None, help="Also write the checkpoint every this many updates."),
]


def server_options(f: Any) -> Any:
    for opt in reversed(SERVER_FLAGS):
        f = opt(f)
    return f


def pop_server_config(kwargs: dict[str, Any]) -> ServerConfig:
    """Move the server's flags (every keyword named like a ServerConfig field) out of a
    command's keyword arguments into a ServerConfig."""
    names = {f.name for f in dataclasses.fields(ServerConfig)} & kwargs.keys()
    return ServerConfig(**{k: kwargs.pop(k) for k in names})


#: the learner's training flags, shared by `learner` and `launch` (LearnerConfig fields)
LEARNER_FLAGS = [
    click.option("--model", default="mlp", show_default=True, help="Built-in model name or module:function."),
    click.option("--dataset", default="digits", show_default=True),
    click.option("--batch-size", "-b", type=int, default=32, show_default=True, help="Mini-batch size μ."),
    click.option("--steps", type=int, default=None, help="Gradients to push (default: until the server stops)."),
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--threads", type=int, default=1, show_default=True, help="torch threads for this learner."),
    click.option("--reconnect", type=float, default=0.0, show_default=True,
                 help="If the server is lost, keep trying to reach it (e.g. restarted with --resume) for this many seconds."),
]
LEARNER_KEYS = ("model", "dataset", "batch_size", "steps", "seed", "threads", "reconnect")


def learner_options(f: Any) -> Any:
    for opt in reversed(LEARNER_FLAGS):
        f = opt(f)
    return f


@main.command()
@click.option("--listen", "listen", multiple=True, default=[DEFAULT_LISTEN], show_default=True,
              help="Address to listen on (repeatable).")
@server_options
@click.option("--samples-per-epoch", type=int, default=None, help="Training-set size, for epoch-based LR decay.")
@click.option("--max-updates", type=int, default=None, help="End the run after this many updates.")
@click.option("--resume", type=click.Path(dir_okay=False), default=None,
              help="Start from this checkpoint (weights, momentum, clock) instead of the first learner's weights.")
@click.option("--shard", callback=_parse_shard, default="0/1", show_default=True,
              help="I/N: hold the I-th of N parts of the parameters (learners connect to all N, in order).")
def server(listen: tuple[str, ...], **kwargs: Any) -> None:
    """Run a parameter server until interrupted. Weights come from the first learner's hello."""
    from .server import ParameterServer

    async def serve() -> None:
        cfg = ServerConfig(listen=list(listen), **kwargs)
        async with ParameterServer(cfg) as ps:
            ps.close_on_signals()
            click.echo(f"listening on {' '.join(ps.addresses)}", err=True)
            await ps.serve()
        click.echo(json.dumps(ps.stats()), err=True)  # after close: includes the final checkpoint

    try:
        run_loop(serve())
    except RudraError as exc:
        _fail(exc)


@main.command()
@click.option("--connect", required=True,
              help="Server address, e.g. tcp://127.0.0.1:7000; for a sharded group, every shard's, comma-separated, in order.")
@learner_options
@click.option("--index", type=int, default=0, show_default=True, help="Learner index (seeds its sampling).")
@click.option("--name", default=None)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Connect timeout in seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON line.")
def learner(as_json: bool, **kwargs: Any) -> None:
    """Run one PyTorch learner against a server."""
    from .learner.training import LearnerConfig, run_learner

    try:
        summary = run_learner(LearnerConfig(**kwargs))
    except RudraError as exc:
        _fail(exc)
    click.echo(json.dumps(summary) if as_json else
               f"learner {summary['learner_id']}: {summary['steps']} steps, test accuracy {summary['test_accuracy']:.4f}")


@main.command()
@click.option("--learners", "-l", type=int, default=4, show_default=True, help="Number of learner processes λ.")
@click.option("--batch-size", "-b", type=int, default=32, show_default=True, help="Mini-batch size μ per learner.")
@server_options
@click.option("--epochs", type=float, default=30.0, show_default=True, help="Passes over the training set, all learners together.")
@click.option("--updates", type=int, default=None, help="Stop after this many server updates (overrides --epochs).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default="mlp", show_default=True)
@click.option("--dataset", default="digits", show_default=True)
@click.option("--transport", default="tcp", show_default=True, help="tcp, shm (same host), or a plugin's scheme (ucx).")
@click.option("--shards", type=int, default=1, show_default=True,
              help="Shard servers (in this process), each holding one part of the parameters.")
@click.option("--results", type=click.Path(dir_okay=False, writable=True), default=None, help="Write results JSON here.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
def train(results: str | None, quiet: bool, **kwargs: Any) -> None:
    """Start a server and λ learner processes here, train, and report accuracy, time and staleness."""
    from .runs.train import TrainConfig, train as run_train

    progress = None if quiet else (lambda line: click.echo(line, err=True))
    if logging.getLogger().level > logging.DEBUG:  # joins and leaves are noise in a local run
        logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        cfg = TrainConfig(server=pop_server_config(kwargs), **kwargs)
        out = run_loop(run_train(cfg, progress))
    except RudraError as exc:
        _fail(exc)
    click.echo(
        f"protocol {out['protocol']} {out['protocol_options'] or ''}  lr policy {out['lr_policy']}  learners {out['learners']}  batch {out['batch_size']}  updates {out['updates']}  dropped {out['dropped']}\n"
        f"test accuracy {out['test_accuracy']:.4f}  wall {out['wall_s']:.1f} s (training {out['train_s']:.1f} s)\n"
        f"staleness mean {out['staleness_mean']:.2f}  max {out['staleness_max']}  histogram {out['staleness_histogram']}"
    )
    if out["learners_failed"]:
        click.echo(f"warning: learners {out['learners_failed']} failed; the run finished with the others", err=True)
    if results:
        with open(results, "w") as fh:
            json.dump(out, fh, indent=2)


@main.command()
@click.option("--rendezvous", required=True, type=click.Path(file_okay=False),
              help="A directory every task of the job can read and write (shared filesystem).")
@click.option("--servers", type=int, default=1, show_default=True, help="Ranks 0..S-1 serve the S shards; the rest learn.")
@server_options
@click.option("--max-updates", type=int, default=None, help="End the run after this many updates.")
@click.option("--rank", type=int, default=None, help="This task's rank (default: from Slurm, MPI, torchrun, …).")
@click.option("--world-size", type=int, default=None, help="Tasks in the job (default: from the environment).")
@click.option("--job-id", default=None, help="Names this job's files in the rendezvous directory (default: from the environment).")
@click.option("--advertise", default=None, help="Host name or address learners use to reach this server (default: hostname).")
@click.option("--listen-host", default="0.0.0.0", show_default=True)
@click.option("--port", type=int, default=0, show_default=True, help="Server port (0: any free port, published).")
@click.option("--wait", type=float, default=300.0, show_default=True, help="Seconds a learner waits for the servers.")
@learner_options
def launch(**kwargs: Any) -> None:
    """Run one task of a job started by a cluster engine (srun, mpirun, torchrun, Kubernetes):
    by its rank, a shard server or a learner. Prints its result as one JSON line."""
    from .runs.launch import LaunchConfig, launch as run_launch

    server = pop_server_config(kwargs)
    learner = {k: kwargs.pop(k) for k in LEARNER_KEYS}
    try:
        result = run_launch(LaunchConfig(server=server.validate(), learner=learner, **kwargs))
    except RudraError as exc:
        _fail(exc)
    click.echo(json.dumps(result))


@main.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--model", default="mlp", show_default=True, help="The model the checkpoint was trained with.")
@click.option("--dataset", default="digits", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line.")
def evaluate(checkpoints: tuple[str, ...], model: str, dataset: str, as_json: bool) -> None:
    """Test accuracy of the weights in a checkpoint (written with --checkpoint); for a sharded
    group, give every shard's checkpoint."""
    from .learner.training import evaluate_checkpoint

    try:
        out = evaluate_checkpoint(checkpoints, model, dataset)
    except RudraError as exc:
        _fail(exc)
    click.echo(json.dumps(out) if as_json else
               f"update {out['clock']}: test accuracy {out['test_accuracy']:.4f}, loss {out['test_loss']:.4f}")


@main.command()
@click.argument("spec", type=click.Path(exists=True, dir_okay=False))
@click.option("--output", "-o", default=None, help="Directory for results.jsonl and the report (default: the spec's).")
@click.option("--no-report", is_flag=True, help="Only run the points.")
def study(spec: str, output: str | None, no_report: bool) -> None:
    """Run a study spec (TOML): every point as a run, resumable, then a Markdown report with plots."""
    from .runs.study import run_study

    logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        out = run_study(spec, output, progress=lambda line: click.echo(line, err=True), report=not no_report)
    except RudraError as exc:
        _fail(exc)
    click.echo(str(out / "report.md") if not no_report else str(out / "results.jsonl"))

"""The ``rudra-async`` command: a thin map from flags (and RUDRA_ASYNC_* variables) to configs."""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Any

import click

from . import __version__
from .config import DEFAULT_LISTEN, ServerConfig
from .errors import RudraError
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


def sgd_options(f: Any) -> Any:
    for opt in reversed([
        click.option("--protocol", default="async", show_default=True, help="Synchronization protocol."),
        click.option("--lr", type=float, default=0.03, show_default=True, help="Learning rate α0."),
        click.option("--momentum", type=float, default=0.9, show_default=True),
        click.option("--weight-decay", type=float, default=0.0, show_default=True),
    ]):
        f = opt(f)
    return f


@main.command()
@click.option("--listen", "listen", multiple=True, default=[DEFAULT_LISTEN], show_default=True,
              help="Address to listen on (repeatable).")
@sgd_options
@click.option("--nesterov", is_flag=True)
@click.option("--max-updates", type=int, default=None, help="End the run after this many updates.")
def server(listen: tuple[str, ...], protocol: str, lr: float, momentum: float, weight_decay: float,
           nesterov: bool, max_updates: int | None) -> None:
    """Run a parameter server until interrupted. Weights come from the first learner's hello."""
    from .server import ParameterServer

    async def serve() -> None:
        cfg = ServerConfig(listen=list(listen), protocol=protocol, lr=lr, momentum=momentum,
                           weight_decay=weight_decay, nesterov=nesterov, max_updates=max_updates)
        async with ParameterServer(cfg) as ps:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(ps.close()))
            click.echo(f"listening on {' '.join(ps.addresses)}", err=True)
            await ps.serve()
            click.echo(json.dumps(ps.stats()), err=True)

    try:
        run_loop(serve())
    except RudraError as exc:
        _fail(exc)


@main.command()
@click.option("--connect", required=True, help="Server address, e.g. tcp://127.0.0.1:7000.")
@click.option("--model", default="mlp", show_default=True, help="Built-in model name or module:function.")
@click.option("--dataset", default="digits", show_default=True)
@click.option("--batch-size", "-b", type=int, default=32, show_default=True, help="Mini-batch size μ.")
@click.option("--steps", type=int, default=None, help="Gradients to push (default: until the server stops).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--index", type=int, default=0, show_default=True, help="Learner index (seeds its sampling).")
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads for this learner.")
@click.option("--name", default=None)
@click.option("--timeout", type=float, default=10.0, show_default=True, help="Connect timeout in seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON line.")
def learner(as_json: bool, **kwargs: Any) -> None:
    """Run one PyTorch learner against a server."""
    from .learner import LearnerConfig, run_learner

    try:
        summary = run_learner(LearnerConfig(**kwargs))
    except RudraError as exc:
        _fail(exc)
    click.echo(json.dumps(summary) if as_json else
               f"learner {summary['learner_id']}: {summary['steps']} steps, test accuracy {summary['test_accuracy']:.4f}")


@main.command()
@click.option("--learners", "-l", type=int, default=4, show_default=True, help="Number of learner processes λ.")
@click.option("--batch-size", "-b", type=int, default=32, show_default=True, help="Mini-batch size μ per learner.")
@sgd_options
@click.option("--epochs", type=float, default=30.0, show_default=True, help="Passes over the training set, all learners together.")
@click.option("--updates", type=int, default=None, help="Stop after this many server updates (overrides --epochs).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--model", default="mlp", show_default=True)
@click.option("--dataset", default="digits", show_default=True)
@click.option("--results", type=click.Path(dir_okay=False, writable=True), default=None, help="Write results JSON here.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
def train(results: str | None, quiet: bool, **kwargs: Any) -> None:
    """Start a server and λ learner processes here, train, and report accuracy, time and staleness."""
    from .train import TrainConfig, train as run_train

    progress = None if quiet else (lambda line: click.echo(line, err=True))
    if logging.getLogger().level > logging.DEBUG:  # joins and leaves are noise in a local run
        logging.getLogger("rudra_async.server").setLevel(logging.WARNING)
    try:
        out = run_loop(run_train(TrainConfig(**kwargs), progress))
    except RudraError as exc:
        _fail(exc)
    click.echo(
        f"protocol {out['protocol']}  learners {out['learners']}  batch {out['batch_size']}  updates {out['updates']}\n"
        f"test accuracy {out['test_accuracy']:.4f}  wall {out['wall_s']:.1f} s (training {out['train_s']:.1f} s)\n"
        f"staleness mean {out['staleness_mean']:.2f}  max {out['staleness_max']}  histogram {out['staleness_histogram']}"
    )
    if out["learners_failed"]:
        click.echo(f"warning: learners {out['learners_failed']} failed; the run finished with the others", err=True)
    if results:
        with open(results, "w") as fh:
            json.dump(out, fh, indent=2)

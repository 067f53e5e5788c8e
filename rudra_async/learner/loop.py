"""The learner process (``rudra-async learner``): the paper's loop on the PyTorch API.

Loop: take a mini-batch → forward, loss, backward on the weights stamped j → push the
gradient with stamp j and receive the next weights (one round trip, or in the background
with ``--overlap``) → repeat, until ``--steps`` or until the server says stop.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from .. import security
from ..config import LearnerConfig
from ..errors import LearnerError
from .api import DistributedOptimizer, share_of_cores
from .evaluation import evaluate
from .local_group import DEFAULT_GROUP_TIMEOUT, LocalGroup
from .parts import load_parts, scalar_loss
from .tensorboard import open_log, server_step, updates_between

log = logging.getLogger(__name__)


def run_learner(cfg: LearnerConfig) -> dict[str, Any]:
    """Train against the server at ``cfg.connect``; returns a summary of this learner's run."""
    opts = cfg.options
    threads: int | str = opts.threads or (share_of_cores(cfg.host_learners) if cfg.host_learners else "auto")
    if threads != "auto":
        torch.set_num_threads(int(threads))  # before the model and data are made
    parts = load_parts(opts, cfg.index, cfg.learners)
    model = parts.model
    limit = opts.steps
    if cfg.passes is not None:
        if parts.batches_per_pass is None:
            raise LearnerError(f"data {opts.data!r} has no length, so passes cannot be counted: give --steps")
        limit = math.ceil(cfg.passes * parts.batches_per_pass)
    started = tick = said = time.monotonic()
    last_loss = float("nan")
    tensorboard = open_log(opts.tensorboard, cfg.name or f"learner-{cfg.index}")
    group = None
    if opts.group_size > 1:
        assert cfg.group_address is not None, "validated"
        wait = max(DEFAULT_GROUP_TIMEOUT, opts.reconnect + cfg.timeout + 60)  # the leader may be reconnecting
        group = LocalGroup(cfg.group_rank, opts.group_size, cfg.group_address, timeout=wait)
    with DistributedOptimizer(
        model,
        cfg.connect,
        name=cfg.name,
        timeout=cfg.timeout,
        reconnect=opts.reconnect,
        overlap=opts.overlap,
        index=cfg.index // opts.group_size,  # the server knows a group as one learner
        group=group,
        threads="auto" if threads == "auto" else None,
        secret=security.load_secret(cfg.secret_file),
        tls=security.client_tls(cfg.tls_ca, cfg.tls_cert, cfg.tls_key) if cfg.tls_ca else None,
    ) as opt:
        for x, y in parts.batches():
            if opt.stopped or (limit is not None and opt.steps >= limit):
                break
            opt.zero_grad()
            loss = scalar_loss(parts.loss(model(x), y), opts.loss)
            loss.backward()
            last_loss = loss.item()
            stamp = opt.timestamp
            opt.step(loss=last_loss, samples=len(x))
            now = time.monotonic()
            step_s, tick = now - tick, now
            tensorboard.record(
                server_step(stamp),  # the update this step's gradient was computed on
                loss=last_loss,
                staleness=updates_between(stamp, opt.timestamp),
                samples_per_s=len(x) / step_s,
                lr=opt.param_groups[0]["lr"],
            )
            if opts.progress_every and now - said >= opts.progress_every:
                said = now
                log.info(
                    "learner %d: step %d%s, server update %s, loss %.4f",
                    cfg.index,
                    opt.steps,
                    f" of {limit}" if limit is not None else "",
                    opt.timestamp,
                    last_loss,
                    extra={"step": opt.steps, "update": opt.timestamp, "loss": last_loss},
                )
        learner_id, last_stamp = opt.learner_id, opt.timestamp
    summary = {
        "learner_id": learner_id,
        "steps": opt.pushes,
        "reconnects": opt.reconnects,
        "refused": opt.refused,
        "last_loss": last_loss,
        "test_accuracy": None,
        "wall_s": time.monotonic() - started,
    }
    if parts.test is not None:
        summary["test_accuracy"], _ = evaluate(model, parts.test.x_test, parts.test.y_test)
        tensorboard.record(server_step(last_stamp), accuracy=summary["test_accuracy"])
    tensorboard.close()
    return summary

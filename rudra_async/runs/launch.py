"""Run a job under an existing cluster engine.

Start the same command as every task of a job — ``srun rudra-async launch …`` under Slurm,
``mpirun``, ``torchrun``, or one pod per rank on Kubernetes — and each process takes its
role from its rank: ranks 0…S−1 become the S shard servers, the others learners (learner
index = rank − S). Servers publish their address in a rendezvous directory that every task
can read (a shared filesystem); learners wait for all S addresses, then train. A server
ends once every learner of the job has joined and left (or on SIGTERM); the job's results
are each process's JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .. import advice
from ..config import LaunchConfig, LearnerConfig, LearnerOptions
from ..errors import ConfigError, RudraError
from ..layout import Shard
from ..transports.base import format_host_port, parse_host_port

log = logging.getLogger(__name__)

#: (engine, rank variable, size variable), the first one set wins: launchers that run inside
#: a Slurm allocation (torchrun or mpirun started by srun/sbatch) come before Slurm's own
#: variables, which such tasks inherit per node
ENGINES = (
    ("torchrun", "RANK", "WORLD_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("pmi", "PMI_RANK", "PMI_SIZE"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS"),
)
JOB_ID_VARS = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid")
#: the number of this job's tasks on this node, as each engine tells it
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """How many of the job's tasks share this node (the engine's variable), or None if unknown."""
    for var in LOCAL_SIZE_VARS:
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def rank_from_env(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(rank, world size, engine name) from a cluster engine's environment variables."""
    for engine, rank_var, size_var in ENGINES:
        if rank_var in env and size_var in env:
            try:
                rank, size = int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise ConfigError(
                    f"{rank_var}={env[rank_var]!r} / {size_var}={env[size_var]!r} are not integers"
                ) from None
            return rank, size, engine
    known = ", ".join(f"{r}/{s}" for _, r, s in ENGINES)
    raise ConfigError(f"no cluster rank in the environment ({known}); pass --rank and --world-size")


def resolve(cfg: LaunchConfig, env: Mapping[str, str] = os.environ) -> LaunchConfig:
    """``cfg`` with rank, world size and job id filled from the environment; the combination checked."""
    cfg = replace(cfg)
    if (cfg.rank is None) != (cfg.world_size is None):
        raise ConfigError("give both --rank and --world-size, or neither (then they come from the environment)")
    if cfg.rank is None:
        cfg.rank, cfg.world_size, engine = rank_from_env(env)
        log.info("rank %d of %d (from %s)", cfg.rank, cfg.world_size, engine)
    assert cfg.world_size is not None
    if cfg.job_id is None:
        cfg.job_id = next((env[v] for v in JOB_ID_VARS if env.get(v)), "job")
    if not 1 <= cfg.servers < cfg.world_size:
        raise ConfigError(f"need 1 <= servers < world size (some learners), got {cfg.servers} of {cfg.world_size}")
    if not 0 <= cfg.rank < cfg.world_size:
        raise ConfigError(f"rank {cfg.rank} is outside a world of {cfg.world_size}")
    if not os.path.isdir(cfg.rendezvous):
        raise ConfigError(f"rendezvous directory {cfg.rendezvous} does not exist (it must be shared by all tasks)")
    return cfg.validate()


def learners_of(cfg: LaunchConfig) -> int:
    """Learner tasks in the job (every rank that does not serve a shard)."""
    assert cfg.world_size is not None
    return cfg.world_size - cfg.servers


def address_file(cfg: LaunchConfig, shard: int) -> str:
    """Where shard ``shard``'s server publishes its address."""
    return os.path.join(cfg.rendezvous, f"{cfg.job_id}.shard{shard}.url")


def launch(cfg: LaunchConfig) -> dict[str, Any]:
    """Run this process's role; returns its result (server statistics or learner summary)."""
    cfg = resolve(cfg)
    assert cfg.rank is not None
    if cfg.rank < cfg.servers:
        from ..eventloop import run

        advice.warn(cfg.server, learners_of(cfg), cfg.learner.overlap)

        return {"role": "server", "rank": cfg.rank, **run(serve_shard(cfg, Shard(cfg.rank, cfg.servers)))}
    from ..learner.loop import run_learner

    index = cfg.rank - cfg.servers
    options, passes = learner_share(cfg)
    urls = wait_for_servers(cfg)
    server = cfg.server
    summary = run_learner(
        LearnerConfig(
            connect=",".join(urls),
            index=index,
            learners=learners_of(cfg),
            passes=passes,
            host_learners=tasks_on_this_node(os.environ),
            options=options,
            secret_file=server.secret_file,
            tls_ca=cfg.tls_ca,
            tls_cert=server.tls_cert if server.tls_client_ca else None,
            tls_key=server.tls_key if server.tls_client_ca else None,
        )
    )
    return {"role": "learner", "rank": cfg.rank, "index": index, **summary}


def learner_share(cfg: LaunchConfig) -> tuple[LearnerOptions, float | None]:
    """A learner's options and passes for ``--epochs``: epochs·N/(λμ) steps of a built-in data
    set, or ``epochs`` passes over its own ``--data``; unchanged without ``--epochs``."""
    opts = cfg.learner
    if cfg.epochs is None:
        return opts, None
    if opts.data is not None:
        return opts, cfg.epochs
    from ..learner import data as datasets

    n_train = len(datasets.load(opts.dataset).y_train)
    return replace(opts, steps=max(1, math.ceil(cfg.epochs * n_train / (learners_of(cfg) * opts.batch_size)))), None


async def serve_shard(cfg: LaunchConfig, shard: Shard) -> dict[str, Any]:
    """Serve one shard until every learner of the job has joined and left, or none has been
    connected for ``cfg.wait`` seconds (a learner that never came), or SIGTERM."""
    from ..server import ParameterServer

    port = cfg.port + shard.index if cfg.port else 0  # shard servers may share a node
    server_cfg = replace(
        cfg.server.for_shard(shard, format_host_port("tcp", cfg.listen_host, port)),
        expected_learners=learners_of(cfg),
    )
    path = address_file(cfg, shard.index)
    async with ParameterServer(server_cfg) as ps:
        ps.close_on_signals()
        _, port = parse_host_port(ps.addresses[0], "tcp")
        _publish(path, format_host_port("tcp", cfg.advertise or socket.gethostname(), port))
        idle_since = time.monotonic()
        try:
            while not ps.closing:
                learners = {info.name for info in ps.core.learners.values()}  # a reconnect says hello again, same name
                if any(info.connected for info in ps.core.learners.values()):
                    idle_since = time.monotonic()
                elif len(learners) >= learners_of(cfg):
                    break  # every learner of the job came and went
                elif time.monotonic() - idle_since > cfg.wait:
                    log.warning(
                        "shard %s: %d of %d learners came; none connected for %g s, ending",
                        shard,
                        len(learners),
                        learners_of(cfg),
                        cfg.wait,
                    )
                    break
                await asyncio.sleep(0.1)
        finally:
            _unpublish(path)
        if ps.failure is not None:
            raise ps.failure
    return ps.stats()


def wait_for_servers(cfg: LaunchConfig) -> list[str]:
    """Every shard server's address, in shard order, once all are published and accept
    connections (a file left by a dead server of an earlier run is waited past)."""
    deadline = time.monotonic() + cfg.wait
    paths = [address_file(cfg, i) for i in range(cfg.servers)]
    while True:
        urls = [_read_address(p) for p in paths]
        waiting = [p for p, url in zip(paths, urls) if url is None or not _accepts(url)]
        if not waiting:
            return [url for url in urls if url is not None]
        if time.monotonic() > deadline:
            raise RudraError(
                f"servers did not publish their addresses within {cfg.wait:g} s: missing {waiting}", code="rendezvous"
            )
        time.sleep(0.2)


def _read_address(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RudraError(f"cannot read {path}: {exc.strerror}", code="rendezvous") from None


def _accepts(url: str) -> bool:
    try:
        host, port = parse_host_port(url, "tcp")
        socket.create_connection((host, port), timeout=2).close()
        return True
    except (OSError, ConfigError):
        return False


def _publish(path: str, url: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as fh:
            fh.write(url + "\n")
        os.replace(tmp, path)  # learners never read half a file
    except OSError as exc:
        raise RudraError(f"cannot publish this server's address in {path}: {exc.strerror}", code="rendezvous") from None


def _unpublish(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass

"""Run a job under an existing cluster engine.

Start the same command as every task of a job — ``srun rudra-async launch …`` under Slurm,
``mpirun``, ``torchrun``, or one pod per rank on Kubernetes — and each process takes its
role from its rank: ranks 0…S−1 become the S shard servers, the others learners (learner
index = rank − S). Servers publish their address in a rendezvous directory that every task
can read (a shared filesystem); learners wait for all S addresses, then train. A server
ends once every learner of the job has joined and left (one lost rather than gone with a bye
is waited for --reconnect seconds) or on SIGTERM; the job's results
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
from typing import TYPE_CHECKING, Any

from .. import advice
from ..config import LaunchConfig, LearnerConfig, LearnerOptions, ServerConfig
from ..errors import ConfigError, RudraError
from ..layout import Shard
from ..transports.base import format_host_port, parse_host_port

if TYPE_CHECKING:
    from ..server import ParameterServer

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
    if cfg.rendezvous is None:
        raise ConfigError("give --rendezvous DIR (a directory every task can read), or --ray to run the job on Ray")
    if not os.path.isdir(cfg.rendezvous):
        raise ConfigError(f"rendezvous directory {cfg.rendezvous} does not exist (it must be shared by all tasks)")
    return cfg.validate()


def learners_of(cfg: LaunchConfig) -> int:
    """Learner tasks in the job (every rank that does not serve a shard)."""
    assert cfg.world_size is not None
    return cfg.world_size - cfg.servers


def address_file(cfg: LaunchConfig, shard: int) -> str:
    """Where shard ``shard``'s server publishes its address."""
    assert cfg.rendezvous is not None and cfg.job_id is not None
    return os.path.join(cfg.rendezvous, f"{cfg.job_id}.shard{shard}.url")


def launch(cfg: LaunchConfig) -> dict[str, Any]:
    """Run this process's role; returns its result (server statistics or learner summary).
    (A job on Ray is :func:`.ray_launch.launch_ray`'s, from one process.)"""
    cfg = resolve(cfg)
    assert cfg.rank is not None
    if cfg.rank < cfg.servers:
        from ..eventloop import run

        advice.warn(cfg.server, learners_of(cfg), cfg.learner.overlap)

        return {"role": "server", "rank": cfg.rank, **run(serve_shard(cfg, Shard(cfg.rank, cfg.servers)))}
    from ..learner.loop import run_learner

    index = cfg.rank - cfg.servers
    summary = run_learner(learner_config(cfg, index, wait_for_servers(cfg), tasks_on_this_node(os.environ)))
    return {"role": "learner", "rank": cfg.rank, "index": index, **summary}


def learner_config(cfg: LaunchConfig, index: int, urls: list[str], host_learners: int | None) -> LearnerConfig:
    """Learner ``index`` of the job, reaching its servers at ``urls`` (in shard order)."""
    options, passes = learner_share(cfg)
    server = cfg.server
    return LearnerConfig(
        connect=",".join(urls),
        index=index,
        learners=learners_of(cfg),
        passes=passes,
        host_learners=host_learners,
        options=options,
        secret_file=server.secret_file,
        tls_ca=cfg.tls_ca,
        tls_cert=server.tls_cert if server.tls_client_ca else None,
        tls_key=server.tls_key if server.tls_client_ca else None,
    )


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

    server_cfg = shard_server_config(cfg, shard)
    path = address_file(cfg, shard.index)
    async with ParameterServer(server_cfg) as ps:
        ps.close_on_signals()
        _publish(path, advertised(cfg, ps, socket.gethostname()))
        try:
            await until_learners_left(ps, learners_of(cfg), cfg.wait, shard, cfg.learner.reconnect)
        finally:
            _unpublish(path)
        if ps.failure is not None:
            raise ps.failure
    return ps.stats()


def shard_server_config(cfg: LaunchConfig, shard: Shard) -> ServerConfig:
    """Shard ``shard``'s server: on ``--port`` + its index (0: any free port), expecting the job's learners."""
    port = cfg.port + shard.index if cfg.port else 0  # shard servers may share a node
    return replace(
        cfg.server.for_shard(shard, format_host_port("tcp", cfg.listen_host, port)), expected_learners=learners_of(cfg)
    )


def advertised(cfg: LaunchConfig, ps: ParameterServer, host: str) -> str:
    """The address learners reach server ``ps`` at: ``--advertise``, else ``host``, on its port."""
    _, port = parse_host_port(ps.addresses[0], "tcp")
    return format_host_port("tcp", cfg.advertise or host, port)


async def until_learners_left(ps: ParameterServer, learners: int, wait: float, shard: Shard, reconnect: float) -> None:
    """Return once ``learners`` learners have joined ``ps`` and left (each with a bye, or lost
    more than ``reconnect`` seconds ago: the learners' --reconnect, within which a lost one
    may come back), or none has been connected for ``wait`` seconds (a learner that never
    came), or ``ps`` closes."""
    idle_since = time.monotonic()
    lost_since: dict[str, float] = {}
    while not ps.closing:
        now = time.monotonic()
        latest = {info.name: info for info in sorted(ps.core.learners.values(), key=lambda i: i.learner_id)}
        for name, info in latest.items():  # a reconnect says hello again, same name
            if info.connected or info.left_cleanly:
                lost_since.pop(name, None)
            else:
                lost_since.setdefault(name, now)
        may_return = any(now - since <= reconnect for since in lost_since.values())
        if any(info.connected for info in latest.values()) or may_return:
            idle_since = now
        elif len(latest) >= learners:
            return  # every learner of the job came and went
        elif now - idle_since > wait:
            log.warning(
                "shard %s: %d of %d learners came; none connected for %g s, ending", shard, len(latest), learners, wait
            )
            return
        await asyncio.sleep(0.1)


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

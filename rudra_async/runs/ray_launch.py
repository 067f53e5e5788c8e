"""Run a job on a Ray cluster: ``rudra-async launch --ray auto|local|ADDRESS`` or, from Python
(a notebook), :func:`launch_ray`.

The driver (the process that calls it) starts the S shard servers and λ = world size − S
learners as Ray actors placed by resources: each server reserves ``server_cpus`` CPUs, each
learner ``learner_cpus`` CPUs (its torch threads) and ``learner_gpus`` GPUs. Nothing goes
through a shared directory: each server actor returns its address, and the driver gives the
learners those addresses and the shared secret as actor arguments (the configured
``--secret-file`` or ``RUDRA_ASYNC_SECRET``, else a fresh random one for this job). The
servers end once every learner has joined and left, as ``launch``'s do. The result, returned
to the driver: ``servers`` (each shard's statistics, as ``launch`` prints them) and
``learners`` (each learner's summary, its test accuracy among them).

Ray is an optional dependency (``pip install 'rudra-async[ray]'``); its workers must be able to
import rudra_async (the driver's environment on a local cluster; a ``runtime_env`` or an
image with it installed on a remote one).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import replace
from typing import Any

from .. import advice, security
from ..config import LaunchConfig
from ..errors import ConfigError, RudraError
from ..layout import Shard
from .launch import advertised, learner_config, learners_of, shard_server_config, until_learners_left

__all__ = ["launch_ray"]

#: where ``--ray local`` starts its own cluster (ray.init without an address)
LOCAL = "local"


class ServerActor:
    """One shard server inside a Ray actor (an asyncio actor: the server runs on its loop)."""

    def __init__(self) -> None:
        self.ps: Any = None

    async def start(self, cfg: LaunchConfig, shard: int, secret: bytes) -> str:
        """Start serving shard ``shard``; returns the address learners reach it at."""
        import ray

        from ..server import ParameterServer

        self.cfg, self.shard = cfg, Shard(shard, cfg.servers)
        self.ps = ParameterServer(shard_server_config(cfg, self.shard), secret=secret)
        await self.ps.__aenter__()
        return advertised(cfg, self.ps, ray.util.get_node_ip_address())

    async def finish(self) -> dict[str, Any]:
        """Wait until every learner has joined and left, close, return the statistics."""
        try:
            await until_learners_left(
                self.ps, learners_of(self.cfg), self.cfg.wait, self.shard, self.cfg.learner.reconnect
            )
        finally:
            await self.ps.__aexit__(None, None, None)
        if self.ps.failure is not None:
            raise self.ps.failure
        return {"role": "server", "shard": self.shard.index, **self.ps.stats()}


class LearnerActor:
    """One learner inside a Ray actor."""

    def run(self, cfg: LaunchConfig, index: int, urls: list[str], secret: bytes, threads: int) -> dict[str, Any]:
        from ..learner.loop import run_learner

        os.environ[security.SECRET_ENV] = secret.decode()  # this actor's process only
        options = cfg.learner if cfg.learner.threads else replace(cfg.learner, threads=threads)
        summary = run_learner(learner_config(replace(cfg, learner=options), index, urls, None))
        return {"role": "learner", "index": index, **summary}


def launch_ray(cfg: LaunchConfig, **init: Any) -> dict[str, Any]:
    """Run the job ``cfg`` describes on Ray (``cfg.ray``: ``auto``, ``local`` or a cluster's
    address; ``cfg.world_size``: servers + learners). Connects to Ray unless this process
    already is (``init``: more ``ray.init`` arguments), and disconnects if it connected.
    Returns ``{"servers": [...], "learners": [...]}``."""
    ray = _import_ray()
    world = cfg.world_size
    if world is None:
        raise ConfigError("--ray needs --world-size (servers + learners)")
    if not 1 <= cfg.servers < world:
        raise ConfigError(f"need 1 <= servers < world size (some learners), got {cfg.servers} of {world}")
    cfg = replace(cfg, rank=None, job_id=cfg.job_id or "ray").validate()
    if cfg.rendezvous is not None:
        raise ConfigError("--ray exchanges addresses through Ray: leave out --rendezvous")
    secret = security.load_secret(cfg.server.secret_file) or secrets.token_hex(32).encode()
    cfg = replace(cfg, server=replace(cfg.server, secret_file=None))  # the secret goes to the actors, not its path
    advice.warn(cfg.server, learners_of(cfg), cfg.learner.overlap)
    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=None if cfg.ray == LOCAL else cfg.ray, **init)
    actors: list[Any] = []
    try:
        _check_resources(ray, cfg)
        server_cls = ray.remote(num_cpus=cfg.server_cpus)(ServerActor)
        servers = [server_cls.remote() for _ in range(cfg.servers)]
        actors += servers
        urls = _get(ray, [s.start.remote(cfg, i, secret) for i, s in enumerate(servers)], cfg.wait, "start the servers")
        learner_cls = ray.remote(num_cpus=cfg.learner_cpus, num_gpus=cfg.learner_gpus)(LearnerActor)
        learners = [learner_cls.remote() for _ in range(learners_of(cfg))]
        actors += learners
        threads = max(1, int(cfg.learner_cpus))
        runs = [a.run.remote(cfg, i, urls, secret, threads) for i, a in enumerate(learners)]
        summaries = _get(ray, runs, None, "train")
        stats = _get(ray, [s.finish.remote() for s in servers], None, "end the servers")
        return {"servers": stats, "learners": summaries}
    finally:
        for actor in actors:
            ray.kill(actor)
        if connected_here:
            ray.shutdown()


def _check_resources(ray: Any, cfg: LaunchConfig) -> None:
    """ConfigError unless the cluster has the CPUs and GPUs the job reserves (an actor that
    does not fit would wait for them forever)."""
    have = ray.cluster_resources()
    learners = learners_of(cfg)
    need = {"CPU": cfg.servers * cfg.server_cpus + learners * cfg.learner_cpus, "GPU": learners * cfg.learner_gpus}
    short = [f"{need[k]:g} {k}s (it has {have.get(k, 0):g})" for k in need if need[k] > have.get(k, 0) + 1e-9]
    if short:
        raise ConfigError(
            f"the Ray cluster is too small for {cfg.servers} servers and {learners} learners: they reserve "
            f"{' and '.join(short)}; lower --server-cpus / --learner-cpus / --learner-gpus or add nodes"
        )


def _get(ray: Any, refs: list[Any], timeout: float | None, doing: str) -> list[Any]:
    """``ray.get(refs)``; an actor's error or the timeout as a RudraError saying what failed."""
    try:
        return list(ray.get(refs, timeout=timeout))
    except ray.exceptions.GetTimeoutError:
        raise RudraError(f"Ray: could not {doing} within {timeout:g} s (enough free resources?)") from None
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, RudraError):
            raise cause from None
        raise RudraError(f"Ray: could not {doing}: {cause or exc}") from None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'rudra-async[ray]'") from None
    return ray

"""Configuration: the one place where every setting is declared with its default, help,
type and range (see :mod:`rudra_async.options`). The command line, the environment
variables and the study's allowed keys are all derived from these classes.

- :class:`ServerConfig`: one parameter server (protocol, optimizer, learning rate, limits,
  kernel, checkpoints, shard);
- :class:`LearnerOptions`: the training recipe every learner of a run shares;
- :class:`LearnerConfig`: one learner process (its server, index and options);
- :class:`TrainConfig`: a local run (``rudra-async train``): a server and λ learners;
- :class:`LaunchConfig`: one task of a job started by a cluster engine.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

from . import registry
from .addresses import is_loopback_host
from .checkpoint import shard_path
from .errors import ConfigError
from .layout import Shard
from .lr import MAX_WINDOW, LRPolicy
from .options import check_ranges, flat_fields, section, setting
from .sync import SyncProtocol, overlap_breaks
from .wire import DEFAULT_MAX_BODY, DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from .transports.base import Transport

__all__ = [
    "DEFAULT_LISTEN",
    "LaunchConfig",
    "LearnerConfig",
    "LearnerOptions",
    "ServerConfig",
    "TrainConfig",
]

DEFAULT_LISTEN = "tcp://127.0.0.1:7000"
TENSORBOARD_MISSING = "--tensorboard needs the tensorboard package: pip install 'rudra-async[tensorboard]'"

#: built-in protocol -> (its option, the config field holding it)
PROTOCOL_OPTIONS = {
    "softsync": ("n", "n"),
    "adaptive": ("target", "staleness_target"),
    "bounded": ("s", "staleness_bound"),
    "backup": ("b", "backup"),
}


def make_protocol(cfg: ServerConfig) -> SyncProtocol:
    """The synchronization protocol ``cfg`` names (built in or a plugin), with its options."""
    proto: SyncProtocol = registry.create("protocol", cfg.protocol, cfg.protocol_kwargs(), SyncProtocol)
    return proto


def make_lr_policy(cfg: ServerConfig) -> LRPolicy:
    """The learning-rate policy ``cfg`` names (built in or a plugin), with its options."""
    policy: LRPolicy = registry.create("lr policy", cfg.lr_policy, cfg.lr_policy_kwargs(), LRPolicy)
    return policy


def check_overlap(server: ServerConfig, learner: LearnerOptions) -> None:
    """ConfigError for learners that overlap under a protocol that would drop their gradients."""
    if learner.overlap:
        why = overlap_breaks(make_protocol(server).describe())
        if why is not None:
            raise ConfigError(f"--overlap cannot train with --protocol {server.protocol}: {why}")


def check_directory(directory: str) -> None:
    """Raise, without importing torch, the ConfigError a learner's :func:`rudra_async.learner.tensorboard.open_log` would
    for ``directory`` (so a run fails before its processes start): the tensorboard package
    is missing, or the nearest existing path on the way to ``directory`` is not a directory
    one can write into."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(TENSORBOARD_MISSING)
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--tensorboard {directory}: cannot write there ({existing} is not a directory)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--tensorboard {directory}: cannot write there ({existing} is not writable)")


def check_tls_pair(server: ServerConfig, tls_ca: str | None) -> None:
    """A run that starts its own learners: they verify the server's certificate with ``tls_ca``."""
    if bool(server.tls_cert) != bool(tls_ca):
        raise ConfigError("TLS in a run needs both --tls-cert (the servers') and --tls-ca (the learners' trust)")


def parse_milestones(text: str) -> tuple[float, ...]:
    """``"120,130"`` → (120.0, 130.0)."""
    try:
        return tuple(float(v) for v in text.split(",")) if text else ()
    except ValueError:
        raise ConfigError(f"expected comma-separated numbers, got {text!r}") from None


@dataclass
class ServerConfig:
    """What a :class:`~rudra_async.server.ParameterServer` needs. ``max_updates`` ends the
    run: once the clock reaches it, replies carry ``stop`` and further gradients are
    refused with ``stopped``. ``listen``, ``resume`` and ``shard`` belong to one server
    process; ``train`` and ``launch`` set them per server (:data:`PER_SERVER`)."""

    PER_SERVER: ClassVar[tuple[str, ...]] = ("listen", "resume", "shard")

    listen: list[str] = setting(factory=lambda: [DEFAULT_LISTEN], help="Address to listen on (repeatable).")
    protocol: str = setting(
        "async", "hardsync | softsync | adaptive | async | bounded | backup | a plugin's name | module:Class."
    )
    n: int | None = setting(None, "softsync: c = max(1, ⌊λ/n⌋) gradients per update (1 ≤ n ≤ λ).", low=1)
    staleness_target: float | None = setting(
        None, "adaptive: the mean staleness σ its n is steered to (default 2; docs/protocols.md).", above=0
    )
    staleness_bound: int | None = setting(None, "bounded: no gradient applied with σ > this.", low=0)
    backup: int | None = setting(None, "backup: update after λ − b gradients, drop the late b.", low=0)
    protocol_options: dict[str, Any] = setting(
        factory=dict, flag="--protocol-option", help="KEY=VALUE passed to a plugin protocol (repeatable)."
    )
    lr: float = setting(0.03, "Base learning rate α0.", above=0)
    momentum: float = setting(0.9, "Momentum (torch.optim.SGD's; 0 for none), in [0, 1).", low=0, below=1)
    weight_decay: float = setting(0.0, "L2 weight decay (torch.optim.SGD's).", low=0)
    nesterov: bool = setting(False, "Nesterov momentum.")
    lr_policy: str = setting(
        "compensated",
        "compensated (the momentum asynchrony adds taken out, and a warm-up: trains a one-process recipe as it "
        "was, docs/protocols.md) | constant | staleness (α0/σ) | staleness-plus-one (α0/(σ+1)) | "
        "mean-staleness (α0/⟨σ⟩) | a plugin's name | module:Class.",
    )
    mean_staleness_window: int = setting(
        0, "mean-staleness: gradients in the window (0: the whole run).", low=0, high=MAX_WINDOW
    )
    lr_policy_options: dict[str, Any] = setting(
        factory=dict, flag="--lr-option", help="KEY=VALUE passed to a plugin LR policy (repeatable)."
    )
    dc_lambda: float = setting(
        0.0,
        "Delay compensation (DC-ASGD): each gradient g computed on θ_j is applied as g + λ·g⊙g⊙(θ_now − θ_j) "
        "(0: off; docs/protocols.md).",
        low=0,
        high=1e6,
    )
    dc_history: int = setting(
        8,
        "Delay compensation: weight versions kept; a gradient with σ >= this is applied uncompensated "
        "(memory: up to this + 1 copies of the weights).",
        low=2,
        high=1024,
    )
    lr_decay_at: tuple[float, ...] = setting(
        factory=tuple, parse=parse_milestones, metavar="M1,M2,...", help="Step-decay milestones, e.g. 120,130."
    )
    lr_decay: float = setting(0.1, "Factor applied at each milestone, in (0, 1].", above=0, high=1)
    lr_decay_unit: str = setting("updates", "Unit of the milestones.", choices=("updates", "epochs"))
    warmup: int = setting(0, "Linear warm-up over this many updates.", low=0)
    lr_scale_ref_batch: int | None = setting(None, "Linear scaling rule: α × (samples per update)/this.", low=1)
    samples_per_epoch: int | None = setting(None, "Training-set size, for epoch-based LR decay.", low=1)
    max_updates: int | None = setting(None, "End the run after this many updates.", low=1)
    expected_learners: int | None = setting(
        None,
        "How many learners the run has (λ), for sharding data: learners get indices 0..λ-1 and each its "
        "1/λ of the data (default: the learners registered at the time).",
        low=1,
    )
    max_frame: int = setting(DEFAULT_MAX_BODY, "Largest frame body accepted, in bytes.", low=1024, metavar="BYTES")
    max_model_bytes: int = setting(
        1 << 32,
        "Largest model (float32 bytes of this server's shard) the first hello may bring to a server without weights.",
        low=4,
        metavar="BYTES",
    )
    max_grad_norm: float | None = setting(
        None, "Refuse a pushed gradient whose L2 norm is above this (gradient_too_large).", above=0
    )
    grad_outlier_factor: float = setting(
        1000.0,
        "Refuse a pushed gradient whose max |g| is above this many times the median max |g| of the last 256 "
        "gradients accepted, once 32 have been (gradient_outlier; 0: off).",
        low=0,
    )
    secret_file: str | None = setting(
        None,
        "File holding the shared secret learners must prove they know (default: the RUDRA_ASYNC_SECRET "
        "variable; at least 16 bytes).",
        metavar="FILE",
    )
    insecure: bool = setting(False, "Allow listening on a non-loopback address without a secret.")
    tls_cert: str | None = setting(
        None, "TLS certificate (PEM) of this server: TCP connections are encrypted.", metavar="FILE"
    )
    tls_key: str | None = setting(None, "Private key of --tls-cert (default: in the same file).", metavar="FILE")
    tls_client_ca: str | None = setting(
        None, "Require learners to present a TLS certificate signed by this CA (PEM).", metavar="FILE"
    )
    handshake_timeout: float = setting(
        DEFAULT_TIMEOUT, "Seconds a new connection has to authenticate and say hello before it is closed.", above=0
    )
    idle_timeout: float = setting(
        300.0,
        "Close a learner's connection after this many seconds without a request, or with a reply it does "
        "not read (0: never).",
        low=0,
    )
    learner_timeout: float | None = setting(
        None,
        "Evict from the round a learner that has not pushed for this many seconds after it got its weights "
        "(hardsync, backup, bounded; not async or softsync, which wait for nobody); it rejoins when it "
        "pushes or pulls again.",
        above=0,
    )
    max_connections: int = setting(1024, "Most connections at once (more are closed on arrival).", low=1)
    max_unauthenticated: int = setting(
        64, "Most connections that have not yet said hello; a new one closes the oldest of them.", low=1
    )
    learner_history: int = setting(
        10_000, "Departed learners kept by name in the statistics (older ones only in the totals).", low=0
    )
    kernel: str = setting(
        "auto",
        "Update kernel backend; auto: cupy where a GPU is visible, else torch, else numpy.",
        choices=("auto", "numpy", "torch", "cupy"),
    )
    kernel_device: str = setting("auto", "Device of the update kernel.", choices=("auto", "cpu", "cuda"))
    kernel_threads: int = setting(
        1,
        "CPU threads of the torch update kernel (torch.set_num_threads in the server's process); 0: torch's "
        "default. One leaves the other cores to learners: torch's idle worker threads spin on a core after "
        "every update.",
        low=0,
    )
    update_threads: int = setting(
        0,
        "Threads that compute each update of a large model (at least 2^21 values) and the max |g| of its "
        "gradients, side by side, each a piece of the vector: the same bits as one thread; 0: the cores this "
        "process may use.",
        low=0,
    )
    gradient_buffers: int = setting(
        2,
        "Pushed gradients of 1 MiB or more that stream connections (tcp) receive at once, over all of them: a "
        "push beyond waits in its socket for a buffer (one that a protocol holds does not count). Two: one "
        "updates the weights while the next arrives; one halves that memory, more rarely helps.",
        low=1,
    )
    checkpoint: str | None = setting(
        None,
        "Write weights, momentum and clock here (atomically) when the server "
        "stops; with several shards, put {shard} in the name.",
        metavar="FILE",
    )
    checkpoint_every: int | None = setting(None, "Also write the checkpoint every this many updates.", low=1)
    checkpoint_keep: int = setting(
        2,
        "Checkpoint files kept: FILE, then FILE.1 (the one before it), FILE.2, ... (1: FILE alone).",
        low=1,
        high=100,
    )
    resume: str | None = setting(
        None,
        "Start from this checkpoint instead of the first learner's weights ({shard} in the name "
        "becomes the shard's index, as in --checkpoint).",
        metavar="FILE",
    )
    shard: Shard = setting(
        factory=Shard,
        parse=Shard.parse,
        metavar="I/N",
        help="Hold the I-th of N parts of the parameters (learners connect to all N, in order).",
    )
    metrics: str | None = setting(
        None,
        "Serve Prometheus metrics (/metrics), a status page (/) and status JSON (/status.json) over HTTP "
        "at HOST:PORT (a bare PORT: on 127.0.0.1; port 0: any free one); off by default. "
        "Shard I of a group serves at PORT + I.",
        metavar="ADDRESS",
    )
    metrics_token_file: str | None = setting(
        None,
        "File holding a token that requests to --metrics must send (Authorization: Bearer TOKEN); needed for a "
        "--metrics address other hosts can reach, unless --metrics-insecure.",
        metavar="FILE",
    )
    metrics_insecure: bool = setting(
        False, "Serve --metrics to other hosts without a token (its pages show learners' addresses and names)."
    )
    slow_after: float = setting(
        60.0, "Warn when a connected learner sends nothing for this many seconds (not waiting on the server).", above=0
    )

    def validate(self) -> ServerConfig:
        check_ranges(self)
        if not self.listen:
            raise ConfigError("the server needs at least one address to listen on")
        if self.nesterov and not self.momentum:
            raise ConfigError("nesterov needs momentum > 0")
        if not isinstance(self.shard, Shard):
            raise ConfigError(f"shard must be a Shard (e.g. Shard.parse('0/2')), got {self.shard!r}")
        if self.metrics is not None:
            host, _ = parse_http_address(self.metrics)
            if not (is_loopback_host(host) or self.metrics_token_file or self.metrics_insecure):
                raise ConfigError(
                    f"--metrics {self.metrics} can be reached from other hosts, and its pages show the learners' "
                    "addresses and names: protect it with --metrics-token-file FILE (rudra-async secret FILE makes "
                    "one), or say --metrics-insecure"
                )
        if self.checkpoint_every is not None and not self.checkpoint:
            raise ConfigError("--checkpoint-every needs --checkpoint")
        if (self.tls_key or self.tls_client_ca) and not self.tls_cert:
            raise ConfigError("--tls-key and --tls-client-ca need --tls-cert")
        if self.lr_decay_unit == "epochs" and self.lr_decay_at and not self.samples_per_epoch:
            raise ConfigError("epoch-based LR decay needs --samples-per-epoch")
        if not all(math.isfinite(m) and m >= 0 for m in self.lr_decay_at):
            raise ConfigError(f"--lr-decay-at milestones must be finite and >= 0, got {self.lr_decay_at}")
        for proto, (_, attr) in PROTOCOL_OPTIONS.items():
            if getattr(self, attr) is not None and self.protocol != proto:
                flag = "--" + attr.replace("_", "-")
                raise ConfigError(f"{flag} applies only to --protocol {proto}, not {self.protocol}")
        return self

    def for_shard(self, shard: Shard, listen: str) -> ServerConfig:
        """This configuration for one server of a shard group, listening at ``listen``; a
        ``{shard}`` in the checkpoint path becomes its index (:func:`~rudra_async.checkpoint.shard_path`)."""
        metrics = metrics_for_shard(self.metrics, shard) if self.metrics else None
        return replace(
            self, listen=[listen], shard=shard, checkpoint=shard_path(self.checkpoint, shard), metrics=metrics
        )

    def check_shards(self, count: int) -> None:
        """Settings a group of ``count`` shard servers cannot share (before any is started)."""
        shard_path(self.checkpoint, Shard(0, count))

    def protocol_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for the chosen protocol."""
        kwargs = dict(self.protocol_options)
        if self.protocol in PROTOCOL_OPTIONS:
            key, attr = PROTOCOL_OPTIONS[self.protocol]
            if getattr(self, attr) is not None:
                kwargs[key] = getattr(self, attr)
        return kwargs

    def lr_policy_kwargs(self) -> dict[str, Any]:
        """Constructor arguments for the chosen LR policy."""
        kwargs = dict(self.lr_policy_options)
        if self.lr_policy == "mean-staleness" and self.mean_staleness_window:
            kwargs["window"] = self.mean_staleness_window
        return kwargs

    def check_learners(self, learners: int) -> None:
        """Combinations that depend on λ (known to ``train``, not to a bare server)."""
        if self.n is not None and self.n > learners:
            raise ConfigError(f"softsync needs n <= λ; got n = {self.n} with {learners} learners")
        if self.backup is not None and self.backup >= learners:
            raise ConfigError(f"backup needs b < λ; got b = {self.backup} with {learners} learners")


def parse_http_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT``, ``http://HOST:PORT`` or a bare ``PORT`` (on 127.0.0.1)."""
    rest = text.removeprefix("http://").rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", rest
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--metrics needs HOST:PORT or PORT, got {text!r}")
    return host, int(port)


def metrics_for_shard(address: str, shard: Shard) -> str:
    """Shard I of a group serves its metrics at the given port + I (port 0 stays 0: any), as
    ``HOST:PORT`` whichever form :func:`parse_http_address` read."""
    host, port = parse_http_address(address)
    if shard.count == 1 or port == 0:
        return address
    return f"[{host}]:{port + shard.index}" if ":" in host else f"{host}:{port + shard.index}"


@dataclass
class LogOptions:
    """How the command line logs (options of ``rudra-async`` itself, before the command)."""

    log_level: str = setting("INFO", "Least severe messages logged.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = setting("text", "text lines, or one JSON object per line.", choices=("text", "json"))


@dataclass
class LearnerOptions:
    """The training recipe that every learner of a run shares."""

    model: str = setting(
        "mlp",
        "Built-in model (mlp, linear, cifar10_full; built for --dataset) or module:function returning an nn.Module.",
    )
    dataset: str = setting("digits", "Built-in data set: digits, mnist5k or cifar10:DIRECTORY (unless --data).")
    data: str | None = setting(
        None,
        "module:function returning a DataLoader (or any iterable of (input, target) batches); it may take "
        "index=, learners= (to give each learner its shard), batch_size= and seed=.",
    )
    loss: str = setting("cross_entropy", "cross_entropy, mse, or module:function(output, target) -> scalar tensor.")
    device: str = setting("cpu", "Where the model computes: cpu, cuda, cuda:N, mps, or auto (cuda when available).")
    overlap: bool = setting(
        False, "Push/pull step t in the background while step t+1 computes (one more step of staleness)."
    )
    group_size: int = setting(
        1,
        "Learners per learner group (the paper's adv): a group's learners add their gradients on their host and "
        "one of them exchanges with the server for the group (not with --overlap).",
        low=1,
    )
    batch_size: int = setting(32, "Mini-batch size μ per learner.", short="-b", low=1)
    steps: int | None = setting(None, "Gradients each learner pushes (default: until the server stops).", low=1)
    seed: int = setting(0, "Seed of the initial weights (every learner builds the same) and of sampling.")
    threads: int | None = setting(
        None,
        "torch threads per learner process (default: this host's cores divided among the run's learners on it).",
        low=1,
    )
    reconnect: float = setting(
        0.0,
        "If the server is lost, keep trying to reach it (e.g. restarted with --resume) for this many seconds.",
        low=0,
    )
    tensorboard: str | None = setting(
        None,
        "Write loss, staleness and throughput scalars for TensorBoard under DIR/<learner name> "
        "(needs the tensorboard extra).",
        metavar="DIR",
    )
    progress_every: float = setting(
        10.0, "Seconds between a learner's progress lines (INFO; 0: none; train reports for its learners).", low=0
    )

    def validate(self) -> LearnerOptions:
        check_ranges(self)
        if self.group_size > 1 and self.overlap:
            raise ConfigError("--group-size cannot go with --overlap: a group's learners exchange in step")
        if self.tensorboard is not None:
            check_directory(self.tensorboard)
        if self.data is not None and ":" not in self.model:  # now, not once a server is up
            raise ConfigError(model_for_data(self.model))
        return self


def model_for_data(model: str) -> str:
    """Why a built-in ``--model`` cannot go with ``--data``."""
    return f"--model {model!r} is built for --dataset; with --data give --model module:function"


@dataclass
class LearnerConfig:
    """One learner process: where its server is, who it is, and the shared options."""

    connect: str = setting(
        help="Server address (required), e.g. tcp://127.0.0.1:7000; for a sharded group, every shard's, "
        "comma-separated, in order."
    )
    index: int = setting(0, "Learner index (seeds its sampling; passed to a --data function).", low=0)
    learners: int = setting(1, "Learners in the job (passed to a --data function, to shard the data).", low=1)
    passes: float | None = setting(
        None, "Stop after this many passes over this learner's data (--data); train sets it from --epochs.", above=0
    )
    host_learners: int | None = setting(
        None,
        "Learner processes sharing this host, to divide its cores among (train and launch set it; default: "
        "the run's λ when the server is on this host).",
        low=1,
    )
    group_rank: int = setting(
        0,
        "This learner's rank in its learner group (--group-size; 0: the one that talks to the server); its --index "
        "is the group's index × --group-size + this rank.",
        low=0,
    )
    group_address: str | None = setting(
        None,
        "host:port where the learner group meets (its rank 0 listens there; a loopback or host-local address: "
        "the group's channel has no secret). Needed with --group-size > 1.",
        metavar="HOST:PORT",
    )
    name: str | None = setting(None, "Name the server shows for this learner (default: host:pid).")
    timeout: float = setting(DEFAULT_TIMEOUT, "Connect timeout in seconds.", above=0)
    secret_file: str | None = setting(
        None, "File holding the server's shared secret (default: the RUDRA_ASYNC_SECRET variable).", metavar="FILE"
    )
    tls_ca: str | None = setting(
        None, "Use TLS (tcp://) and accept only a server certificate signed by this CA (PEM).", metavar="FILE"
    )
    tls_cert: str | None = setting(None, "Client TLS certificate (PEM), for servers that ask for one.", metavar="FILE")
    tls_key: str | None = setting(None, "Private key of --tls-cert (default: in the same file).", metavar="FILE")
    options: LearnerOptions = section(LearnerOptions)

    def validate(self) -> LearnerConfig:
        check_ranges(self)
        if (self.tls_cert or self.tls_key) and not self.tls_ca:
            raise ConfigError("--tls-cert and --tls-key need --tls-ca (the CA of the server's certificate)")
        self.options.validate()
        if self.options.group_size > 1 and self.group_address is None:
            raise ConfigError("--group-size needs --group-address (where the group meets) and --group-rank")
        size = self.options.group_size
        if self.group_rank >= size:
            raise ConfigError(f"--group-rank {self.group_rank} is not a rank of a group of {size}")
        if self.index % size != self.group_rank:
            raise ConfigError(
                f"--index {self.index} is not a learner of rank {self.group_rank} in groups of {size}: learner k of "
                f"group g has index g·{size} + k (its part of the data; the server knows the group as learner g)"
            )
        return self


@dataclass
class TrainConfig:
    """A local run: a server (or a group of shard servers) in this process and λ learner
    processes. The run sets the servers' :data:`SET_BY_RUN` settings itself."""

    #: settings of the nested configurations that a run decides itself (not flags of ``train``)
    SET_BY_RUN: ClassVar[tuple[str, ...]] = (
        *ServerConfig.PER_SERVER,
        "max_updates",
        "samples_per_epoch",
        "steps",
        "expected_learners",
    )

    learners: int = setting(4, "Number of learner processes λ.", short="-l", low=1)
    epochs: float = setting(30.0, "Passes over the training set, all learners together.", above=0)
    updates: int | None = setting(None, "Stop after this many server updates (overrides --epochs).", low=1)
    transport: str = setting("tcp", "tcp, shm (same host), or a plugin's scheme (ucx).")
    shards: int = setting(1, "Shard servers (in this process), each holding one part of the parameters.", low=1)
    host: str = setting("127.0.0.1", cli=False)
    timeout: float = setting(
        900.0, "Seconds the whole run may take; learners are stopped past it.", above=0, flag="--run-timeout"
    )
    tls_ca: str | None = setting(
        None, "With --tls-cert: the CA (PEM) learners verify the server's certificate with.", metavar="FILE"
    )
    server: ServerConfig = section(ServerConfig)
    learner: LearnerOptions = section(LearnerOptions)

    @classmethod
    def settings(cls) -> list[str]:
        """The names a run accepts (``train``'s flags, a study point's keys)."""
        return [name for name, (_, f, _) in flat_fields(cls, exclude=cls.SET_BY_RUN).items() if f.metadata["cli"]]

    def validate(self) -> TrainConfig:
        check_ranges(self)
        self.learner.validate()
        if self.learners % self.learner.group_size:
            raise ConfigError(
                f"--group-size {self.learner.group_size} must divide --learners {self.learners} (groups of equal size)"
            )
        self.server.validate().check_learners(self.pushers)
        check_overlap(self.server, self.learner)
        check_tls_pair(self.server, self.tls_ca)
        if self._transport().in_process:
            raise ConfigError(f"transport {self.transport!r} cannot reach learner processes; use tcp, shm or ucx")
        self.server.check_shards(self.shards)
        return self

    def server_config(self, listen: str, n_train: int | None, shard: Shard = Shard()) -> ServerConfig:
        return replace(
            self.server.for_shard(shard, listen),
            max_updates=self.updates,
            samples_per_epoch=self.server.samples_per_epoch or n_train,
            expected_learners=self.pushers,
        )

    @property
    def pushers(self) -> int:
        """The learners the server sees: λ, or its learner groups (λ / --group-size)."""
        return self.learners // self.learner.group_size

    def listen_url(self) -> str:
        """Where the run's server listens: a fresh address on this machine, as the transport
        makes one (:meth:`~rudra_async.transports.base.Transport.fresh_address`)."""
        return self._transport().fresh_address(self.host)

    def _transport(self) -> Transport:
        from .transports import transport_for  # here: importing config loads no transport (no socket, no TLS)

        return transport_for(f"{self.transport}://")

    def steps_per_learner(self, n_train: int) -> int | None:
        """Epochs count samples over all learners: each does epochs·N/(λμ) steps (with a
        built-in data set; with --data the learners count their own passes)."""
        if self.updates is not None or self.learner.data is not None:
            return None
        return max(1, math.ceil(self.epochs * n_train / (self.learners * self.learner.batch_size)))

    def passes_per_learner(self) -> float | None:
        """With --data, an epoch is one pass of every learner over the batches its data
        function gives it (which may be its shard)."""
        return self.epochs if self.learner.data is not None and self.updates is None else None


@dataclass
class LaunchConfig:
    """One process of a launched job. ``server`` configures every shard server (its listen
    address and shard are set per rank); ``learner`` holds the learners' options."""

    rendezvous: str | None = setting(
        None, "A directory every task of the job can read and write (shared filesystem; not with --ray)."
    )
    ray: str | None = setting(
        None,
        "Run the whole job from here on a Ray cluster: 'auto' (the running one), 'local' (start one here) or its "
        "address; servers and --world-size minus --servers learners become Ray actors (docs: README, Ray).",
        metavar="ADDRESS",
    )
    server_cpus: float = setting(1.0, "--ray: CPUs each server actor reserves.", low=0)
    learner_cpus: float = setting(
        1.0, "--ray: CPUs each learner actor reserves (its torch threads, at least 1).", low=0
    )
    learner_gpus: float = setting(0.0, "--ray: GPUs each learner actor reserves (give --device cuda with it).", low=0)
    servers: int = setting(1, "Ranks 0..S-1 serve the S shards; the rest learn.", low=1)
    rank: int | None = setting(None, "This task's rank (default: from Slurm, MPI, torchrun, …).", low=0)
    world_size: int | None = setting(
        None, "Tasks in the job (default: from the environment; with --ray: servers + learners).", low=2
    )
    job_id: str | None = setting(
        None, "Names this job's files in the rendezvous directory (default: from the environment)."
    )
    advertise: str | None = setting(None, "Host name or address learners use to reach this server (default: hostname).")
    listen_host: str = setting("0.0.0.0", "Address the servers listen on.")
    port: int = setting(0, "Server port; shard I listens on port + I (0: any free port, published).", low=0, high=65535)
    wait: float = setting(300.0, "Seconds a learner waits for the servers.", above=0)
    tls_ca: str | None = setting(
        None, "With --tls-cert: the CA (PEM) learners verify the servers' certificates with.", metavar="FILE"
    )
    epochs: float | None = setting(
        None,
        "Passes over the training set, all learners together: each learner takes epochs·N/(λμ) steps of a "
        "built-in data set, or epochs passes over its own --data (default: until the server stops).",
        above=0,
    )
    server: ServerConfig = section(ServerConfig)
    learner: LearnerOptions = section(LearnerOptions)

    #: what launch cannot take as a setting, and what to give instead
    NOT_SETTINGS: ClassVar[dict[str, str]] = {
        "learners": "a launched job's learners are its tasks beyond --servers (the engine's task count)",
    }

    #: settings of the nested configurations that a launch decides itself (per rank)
    SET_BY_RUN: ClassVar[tuple[str, ...]] = (*ServerConfig.PER_SERVER, "samples_per_epoch", "expected_learners")

    def validate(self) -> LaunchConfig:
        """The settings alone; the rank, world size and rendezvous directory are checked when
        the launch reads its environment (:func:`rudra_async.runs.launch.resolve`)."""
        check_ranges(self)
        if self.learner.group_size > 1:
            raise ConfigError(
                "launch does not form learner groups yet (--group-size): use train, or start each member with "
                "rudra-async learner --group-size --group-rank --group-address"
            )
        self.server.validate().check_shards(self.servers)
        check_overlap(self.server, self.learner)
        if self.port and self.port + self.servers - 1 > 65535:
            raise ConfigError(
                f"--port {self.port}: shard {self.servers - 1} would listen on {self.port + self.servers - 1}"
            )
        check_tls_pair(self.server, self.tls_ca)
        self.learner.validate()
        if self.epochs is not None and self.learner.steps is not None:
            raise ConfigError("give --epochs or --steps, not both")
        return self

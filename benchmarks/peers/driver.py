"""rudra-async next to its peers, on the same workloads, on this machine, in one run.

    flock /tmp/bench.lock python -m benchmarks.peers [--quick] [--reps 3] [--only SYSTEMS]
        [--workloads a0,small,a,b] [--lambdas 1,2,4] [--md docs/benchmarks.md] [--json docs/benchmarks.json]

Wrap every run of any length in ``flock /tmp/bench.lock`` so that no two benchmarks share
the cores. ``--quick`` is a smoke test (short windows, one repetition, nothing under docs/).

Systems (``--only`` takes a comma-separated list of prefixes of these names):

- ``rudra:async:tcp``, ``rudra:hardsync:tcp``, ``rudra:softsync2:tcp`` (n = 2, λ ≥ 2) and
  the same over ``shm``: a rudra-async server process (``ParameterServer``, torch's fused SGD
  kernel) and λ learner processes (``SyncClient.push_pull`` in (a0) and small; for (a)/(b)
  the user's API, ``rudra_async.torch.DistributedOptimizer``, wrapping the model);
  ``rudra:async-overlap:tcp`` / ``shm`` ((a) and (b) only): the same with ``overlap=True``;
- ``ddp``: ``DistributedDataParallel`` over gloo, λ ranks, fused SGD on every rank; in (a0)
  and small, a gloo all-reduce of the fixed gradient plus the fused SGD step;
- ``rpc:async``, ``rpc:sync``: PyTorch's batch-update parameter-server tutorial over
  ``torch.distributed.rpc`` (TensorPipe): a server process with the model and ``optim.SGD``
  (batch_update_size 1 or λ), trainers ``rpc_sync(update_and_fetch, grads)`` each step;
- ``mxnet:dist_async``, ``mxnet:dist_sync``: MXNet 1.9.1's kvstore (ps-lite), see below;
- ``reference``: one process, ``torch.optim.SGD(fused=True)``, the compute limit of (a)/(b);
  at λ > 1, λ of them side by side without communication (what the host gives λ trainings).

Workloads: ``a0`` the parameter server alone (25,175,040 float32 = (a)'s MLP, a fixed
gradient pushed and the weights pulled, no compute), ``small`` (a 1,000-float push+pull,
λ = 1, its latency), ``a`` (MLP 1024-4096-4096-1024, batch 8, MSE) and ``b`` (CNN
conv5×5 3→32, pool, conv5×5 32→64, pool, fc 4096→128, fc 128→10 on 3×32×32, batch 32,
cross-entropy), synthetic data, one compute thread per process everywhere.

How a point is measured: all processes of a point start fresh; each learner records every
step's completion time and push+pull time on a shared board (``common.py``). Once every
learner has done its warm-up steps (and a warm-up time has passed), the driver opens the
window: at least ``measure_s`` seconds and at least ``min_steps`` steps per learner (never
past the point's timeout). A learner's rate is its steps in the window over the time from
its last step before the window to its last step in it; samples/s is the sum over learners
× batch; updates/s divides gradients/s by the gradients per update (λ for hardsync,
dist_sync, rpc:sync and DDP; ⌊λ/n⌋ for softsync; else 1). Server CPU seconds come from
``/proc/PID/stat`` (utime + stime over the window, divided by the updates in it), server
peak RSS from ``VmHWM`` in ``/proc/PID/status`` at the end. Start-up never counts. Each
repetition is a full pass over the matrix (passes interleave, so slow drift of a shared
machine spreads over all systems); the table shows the median and min–max of the passes.

Making MXNet's dist_async / dist_sync run on one machine (what we learned):

- ``pip install mxnet==1.9.1 'numpy<1.24'`` in a virtual environment of its own (the
  ``py3-none-manylinux2014_x86_64`` CPU wheel installs on Python 3.11; mxnet 1.9.1 breaks on
  numpy ≥ 1.24, rudra-async needs ≥ 1.24). The driver creates it under
  ``~/.cache/rudra-async-bench/mxnet-venv`` (``--mxnet-venv``) when it is missing.
- One scheduler, one server and λ workers, all with ``DMLC_PS_ROOT_URI=127.0.0.1``,
  ``DMLC_PS_ROOT_PORT`` (a free port), ``DMLC_NUM_SERVER=1``, ``DMLC_NUM_WORKER=λ``,
  ``DMLC_NODE_HOST=127.0.0.1`` and ``DMLC_ROLE``. Scheduler and server are just
  ``python -c 'import mxnet'``: the import sees the role and runs the node until the job
  ends. Workers call ``mx.kv.create('dist_async' | 'dist_sync')``; ``kv.rank`` is assigned by
  the scheduler (not by us).
- Server-side SGD: every worker calls ``kv.init`` (rank 0's value is kept; it is a barrier),
  then ``kv.set_optimizer(mx.optimizer.SGD(...))`` (pickled and sent to the server, whose
  Python controller installs it as the updater; Gluon's Trainer does the same with
  ``update_on_kvstore``), then ``kv._barrier()`` so that no push arrives before the
  optimizer. In dist_async each push is applied on arrival; in dist_sync the server sums
  the λ pushes of a key, applies one update and only then answers the pushes, so a worker's
  pull (ordered after its push by the engine) sees the new weights.
- Measuring: the engine is asynchronous; a step ends with ``weights.wait_to_read()`` (a0)
  or ``mx.nd.waitall()`` (training). Threads: ``OMP_NUM_THREADS=1``,
  ``MXNET_CPU_WORKER_NTHREADS=1`` (ps-lite still runs its own I/O threads). The training
  workers compute with MXNet itself (Gluon, hybridized, same architectures), pushing every
  parameter's gradient and pulling every weight with priorities, as Gluon's Trainer does.
- The nodes never exit on their own once a worker is killed; the driver kills every
  process group it started at the end of each point.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loopback import free_port
from benchmarks.peers.common import BATCH, SINGLE_THREAD_ENV, Board, Spec

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MXNET_VENV = Path.home() / ".cache" / "rudra-async-bench" / "mxnet-venv"
MXNET_REQUIREMENTS = ["mxnet==1.9.1", "numpy<1.24"]
TORCH_MAIN = "from benchmarks.peers.torch_side import main; main()"
#: the rudra-async server, in a process without torch (as ``rudra-async server`` runs)
RUDRA_SERVER_MAIN = "from benchmarks.peers.rudra_server import main; main()"
PIDFILE = Path.home() / ".cache" / "rudra-async-bench" / "running.pids"

RUDRA = [f"rudra:{p}:{t}" for t in ("tcp", "shm") for p in ("async", "async-overlap", "hardsync", "softsync2")]
SYSTEMS = [*RUDRA, "ddp", "rpc:async", "rpc:sync", "mxnet:dist_async", "mxnet:dist_sync", "reference"]
PEERS = ["ddp", "rpc:async", "rpc:sync", "mxnet:dist_async", "mxnet:dist_sync"]
WORKLOADS = ["a0", "small", "a", "b"]


@dataclass
class Timing:
    warm_steps: int
    warm_s: float
    measure_s: float
    min_steps: int
    timeout_s: float
    capacity: int = 4096
    window_limit_s: float = 20.0  # each window after the first may add this much to the point's timeout


def timing(workload: str, quick: bool) -> Timing:
    if workload == "small":
        return Timing(200, 0.3 if quick else 1.0, 0.5 if quick else 2.0, 50, 40 if quick else 60, 1 << 17)
    warm = {"a0": 3, "a": 5, "b": 5}[workload]
    if quick:  # tiny models step thousands of times a second: a ring that holds the whole window
        return Timing(2, 0.2, 0.8, 2, 45, 1 << 17)
    return Timing(warm, 0.5, 3.0, 5, 60)


# -- processes --------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 12) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Point:
    system: str
    workload: str
    learners: int
    rep: int
    tmp: Path = Path()
    procs: list[Proc] = field(default_factory=list)
    server: Proc | None = None

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        with open(PIDFILE, "a") as f:
            f.write(f"{popen.pid}\n")
        return proc

    def check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                raise PointError(f"{p.name} exited with code {p.popen.returncode}:\n{p.tail()}")

    def kill(self) -> None:
        """Stop every process of the point without leaking shared memory: first each main
        process alone (SIGINT, then SIGKILL), so that Python's resource tracker, a child in the
        same process group, outlives it and unlinks the shared-memory segments it owned (the
        shm transport's, 100 MB each in (a0)); then whatever is left of the groups."""
        alive = [p for p in self.procs if p.popen.poll() is None]
        for sig, grace in ((signal.SIGINT, 2.0), (signal.SIGKILL, 5.0)):
            for p in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    p.popen.send_signal(sig)
            deadline = time.monotonic() + grace
            for p in alive:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(max(0.01, deadline - time.monotonic()))
            alive = [p for p in alive if p.popen.poll() is None]
        time.sleep(0.5)  # the resource trackers unlink on their parent's end
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.popen.pid, signal.SIGKILL)
        forget_pids(p.popen.pid for p in self.procs)


class PointError(Exception):
    pass


def forget_pids(pids: Any) -> None:
    gone = {str(p) for p in pids}
    with contextlib.suppress(OSError):
        kept = [line for line in PIDFILE.read_text().split() if line not in gone]
        PIDFILE.write_text("".join(f"{p}\n" for p in kept))


def kill_leftovers() -> None:
    """Process groups a killed earlier run left behind (their ids are in PIDFILE)."""
    PIDFILE.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        for line in PIDFILE.read_text().split():
            pid = int(line)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"benchmarks.peers" in cmdline or b"mxnet" in cmdline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                print(f"killed a leftover process group {pid}", file=sys.stderr)
    PIDFILE.write_text("")


def torch_env() -> dict[str, str]:
    env = {**os.environ, **SINGLE_THREAD_ENV, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def wait_line(proc: Proc, prefix: str, point: Point, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        point.check_alive()
        time.sleep(0.05)
    raise PointError(f"{proc.name} did not print {prefix!r} within {timeout:g} s:\n{proc.tail()}")


# -- launching each system ----------------------------------------------------------------------
def launch(point: Point, spec: Spec, args: argparse.Namespace) -> None:
    system, lam = point.system, point.learners
    py = [sys.executable, "-c", TORCH_MAIN]
    env = torch_env()
    if system.startswith("rudra:"):
        protocol, transport = system.split(":")[1:]
        overlap = protocol == "async-overlap"
        mode, n = ("softsync", 2) if protocol == "softsync2" else ("async" if overlap else protocol, 0)
        listen = "tcp://127.0.0.1:0" if transport == "tcp" else "shm://"
        server_spec = Spec(**{**spec.__dict__, "role": "server", "mode": mode, "n": n, "address": listen})
        server_env = {**env, "RUDRA_BENCH_SERVER_KERNEL": args.server_kernel}
        if args.server_gradient_buffers is not None:  # else the server's own default
            server_env["RUDRA_BENCH_SERVER_GRADIENT_BUFFERS"] = str(args.server_gradient_buffers)
        point.server = point.start(
            "server", [sys.executable, "-c", RUDRA_SERVER_MAIN, server_spec.to_json()], server_env
        )
        url = wait_line(point.server, "ADDRESS", point, 45)
        for r in range(lam):
            s = Spec(**{**spec.__dict__, "rank": r, "mode": mode, "n": n, "address": url, "overlap": overlap})
            point.start(f"learner{r}", [*py, s.to_json()], env)
    elif system == "ddp":
        address = f"127.0.0.1:{free_port()}"
        for r in range(lam):
            point.start(f"rank{r}", [*py, Spec(**{**spec.__dict__, "rank": r, "address": address}).to_json()], env)
    elif system.startswith("rpc:"):
        address, mode = f"127.0.0.1:{free_port()}", system.split(":")[1]
        server_spec = Spec(**{**spec.__dict__, "role": "server", "mode": mode, "address": address})
        point.server = point.start("server", [*py, server_spec.to_json()], env)
        for r in range(lam):
            s = Spec(**{**spec.__dict__, "rank": r, "mode": mode, "address": address})
            point.start(f"trainer{r}", [*py, s.to_json()], env)
    elif system.startswith("mxnet:"):
        mx_py = str(ensure_mxnet(args.mxnet_venv))
        mode = system.split(":")[1]
        mx_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        mx_env.update(SINGLE_THREAD_ENV)
        mx_env.update(
            DMLC_PS_ROOT_URI="127.0.0.1",
            DMLC_PS_ROOT_PORT=str(free_port()),
            DMLC_NUM_SERVER="1",
            DMLC_NUM_WORKER=str(lam),
            DMLC_NODE_HOST="127.0.0.1",
            PS_VERBOSE="1",  # ps-lite logs who registered: where a start-up hang stopped
            PYTHONUNBUFFERED="1",
        )
        point.start("scheduler", [mx_py, "-c", "import mxnet"], {**mx_env, "DMLC_ROLE": "scheduler"})
        point.server = point.start("server", [mx_py, "-c", "import mxnet"], {**mx_env, "DMLC_ROLE": "server"})
        s = Spec(**{**spec.__dict__, "mode": mode}).to_json()
        for r in range(lam):
            point.start(f"worker{r}", [mx_py, str(HERE / "mxnet_side.py"), s], {**mx_env, "DMLC_ROLE": "worker"})
    elif system == "reference":  # λ independent copies side by side: what the host gives λ trainings
        for r in range(lam):
            point.start(f"reference{r}", [*py, Spec(**{**spec.__dict__, "rank": r}).to_json()], env)
    else:
        raise PointError(f"unknown system {system!r}")


_mxnet_python: Path | None = None
_mxnet_error: str | None = None


def ensure_mxnet(venv: Path) -> Path:
    """The MXNet environment's python, created (``python -m venv`` + pip) when missing."""
    global _mxnet_python, _mxnet_error
    if _mxnet_error:
        raise PointError(_mxnet_error)
    if _mxnet_python:
        return _mxnet_python
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import mxnet, numpy; print(mxnet.__version__, numpy.__version__)"]
    try:
        if not (python.exists() and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0):
            print(f"creating the MXNet environment in {venv} ...", file=sys.stderr)
            venv.parent.mkdir(parents=True, exist_ok=True)
            if venv.exists():
                shutil.rmtree(venv)
            steps = [
                [sys.executable, "-m", "venv", str(venv)],
                [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *MXNET_REQUIREMENTS],
            ]
            for cmd in steps:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=mx_clean_env())
                if r.returncode != 0:
                    raise PointError(f"`{' '.join(cmd)}` failed ({r.returncode}):\n{(r.stdout + r.stderr)[-2000:]}")
            r = subprocess.run(probe, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise PointError(f"mxnet does not import in {venv}:\n{(r.stdout + r.stderr)[-2000:]}")
    except (PointError, OSError, subprocess.TimeoutExpired) as exc:
        _mxnet_error = f"the MXNet environment could not be made: {exc}"
        raise PointError(_mxnet_error) from None
    _mxnet_python = python
    return python


def mx_clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_CONSTRAINT")}


def mxnet_version(venv: Path) -> str:
    try:
        python = ensure_mxnet(venv)
        r = subprocess.run(
            [str(python), "-c", "import mxnet; print(mxnet.__version__)"], capture_output=True, text=True
        )
        return r.stdout.strip() or "?"
    except PointError as exc:
        return f"unavailable ({str(exc).splitlines()[0]})"


# -- measuring --------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return math.nan


def per_update(system: str, learners: int) -> int:
    """Gradients per server update (per synchronized step for DDP)."""
    if system.startswith("rudra:hardsync") or system in ("ddp", "rpc:sync", "mxnet:dist_sync"):
        return learners
    if system.startswith("rudra:softsync2"):
        return max(1, learners // 2)
    return 1


def measure(point: Point, board: Board, t: Timing, started: float, windows: int) -> list[dict[str, Any]]:
    deadline = started + t.timeout_s + (windows - 1) * t.window_limit_s

    def wait(cond: Any, what: str) -> None:
        while not cond():
            point.check_alive()
            if time.monotonic() > deadline:
                raise PointError(f"timed out after {t.timeout_s:g} s {what} (steps per learner: {board.counts()})")
            time.sleep(0.02)

    wait(lambda: min(board.counts()) >= 1, "waiting for every learner's first step")
    first = time.monotonic()
    wait(
        lambda: min(board.counts()) >= t.warm_steps and time.monotonic() - first >= t.warm_s,
        "warming up",
    )
    server_pid = point.server.popen.pid if point.server else None
    learner_pids = [board.pid(r) for r in range(board.learners)]
    results = [window(point, board, t, deadline, wait, server_pid, learner_pids) for _ in range(windows)]
    board.stop()
    rss = peak_rss_mb(server_pid) if server_pid else math.nan
    for r in results:
        r["server_peak_rss_mb"] = None if math.isnan(rss) else rss
    return results


def window(
    point: Point, board: Board, t: Timing, deadline: float, wait: Any, server_pid: int | None, learner_pids: list[int]
) -> dict[str, Any]:
    """One measured window from now: its figures."""
    t0 = time.monotonic()
    cpu0 = cpu_seconds(server_pid) if server_pid else math.nan
    learner_cpu0 = [cpu_seconds(p) for p in learner_pids]
    start_counts = board.counts()
    end = t0 + t.measure_s

    def window_done() -> bool:
        now = time.monotonic()
        enough = all(c - s >= t.min_steps for c, s in zip(board.counts(), start_counts))
        return now >= end and (enough or now > deadline - 1)

    wait(window_done, "in the measured window")
    t1 = time.monotonic()
    cpu1 = cpu_seconds(server_pid) if server_pid else math.nan
    learner_cpu = [cpu_seconds(p) - c for p, c in zip(learner_pids, learner_cpu0)]

    rates, lats = [], []
    for r in range(board.learners):
        times, lat, _ = board.steps(r)
        inside = (times > t0) & (times <= t1)
        before = times[times <= t0]
        k = int(inside.sum())
        if k == 0 or len(before) == 0:
            raise PointError(f"learner {r} made no step in the {t1 - t0:.1f} s window (or lost its ring)")
        rates.append(float(k / (times[inside][-1] - before[-1])))
        lats.extend(float(x) for x in lat[inside] if not math.isnan(x))
    grads = sum(rates)
    updates = grads / per_update(point.system, point.learners)
    batch = BATCH.get(point.workload)
    return {
        "samples_per_s": grads * batch if batch else None,
        "gradients_per_s": grads,
        "updates_per_s": updates,
        "latency_ms": statistics.median(lats) * 1e3 if lats else None,
        "server_cpu_s_per_update": None if math.isnan(cpu0) else (cpu1 - cpu0) / (updates * (t1 - t0)),
        "server_cpu_share": None if math.isnan(cpu0) else (cpu1 - cpu0) / (t1 - t0),
        "learner_cpu_share": statistics.mean(learner_cpu) / (t1 - t0),
        "server_cpu_s_per_gradient": None if math.isnan(cpu0) else (cpu1 - cpu0) / (grads * (t1 - t0)),
        "learners_cpu_s_per_gradient": sum(learner_cpu) / (grads * (t1 - t0)),
        "window_s": t1 - t0,
        "per_learner_steps_per_s": rates,
    }


def run_point(system: str, workload: str, learners: int, rep: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One point (one launch, ``args.windows`` windows), launched again, up to
    :data:`STARTUP_TRIES` launches in all, while it fails before any step (a start-up hang, a
    port taken); the failed launches' errors and logs stay in ``earlier_tries``."""
    earlier: list[dict[str, Any]] = []
    while True:
        results = run_once(system, workload, learners, rep, args)
        failed = results[0].get("error", "")
        if len(earlier) + 1 >= STARTUP_TRIES or not any(s in failed for s in STARTUP_FAILURES):
            break
        earlier.append(results[0])
    for r in results:
        if earlier:
            r["earlier_tries"] = [{k: e[k] for k in ("error", "logs") if k in e} for e in earlier]
        r["wall_s"] += sum(e["wall_s"] for e in earlier)
    return results


STARTUP_FAILURES = ("waiting for every learner's first step", "did not print")
#: launches of one point at most while it fails before any step: MXNet's dist_sync (b) at
#: λ = 2 hangs in its first step in about half the launches on this machine kind (both
#: workers wait in ``mx.nd.waitall()`` for pulls the server never answers, the server idle)
STARTUP_TRIES = 3


def run_once(system: str, workload: str, learners: int, rep: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    base: dict[str, Any] = {"system": system, "workload": workload, "learners": learners, "rep": rep}
    t = timing(workload, args.quick)
    point = Point(system, workload, learners, rep, Path(tempfile.mkdtemp(prefix="rudra-peers-", dir=shm_dir())))
    board = Board(str(point.tmp / "board"), learners, t.capacity, create=True)
    spec = Spec(system, workload, "learner", 0, learners, board.path, t.capacity, tiny=args.tiny)
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    try:
        launch(point, spec, args)
        results = [{**base, "window": i, **r} for i, r in enumerate(measure(point, board, t, started, args.windows))]
    except PointError as exc:
        results = [{**base, "error": str(exc)}]
    except Exception as exc:  # a bug of the driver must not lose the other points
        results = [{**base, "error": f"{type(exc).__name__}: {exc}"}]
    finally:
        point.kill()
        board.close()
        if not results or "error" in results[0]:
            results = results or [{**base, "error": "interrupted"}]
            results[0]["logs"] = {p.name: p.tail() for p in point.procs}
        shutil.rmtree(point.tmp, ignore_errors=True)
    for r in results:
        r["wall_s"] = time.monotonic() - started
    return results


def shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


# -- the matrix ---------------------------------------------------------------------------------
def matrix(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    points = []
    for workload in args.workloads:
        for system in args.systems:
            if system == "reference" or "overlap" in system:  # training only: compute to measure or overlap
                if workload in ("a", "b"):
                    lams = sorted({1, *args.lambdas}) if system == "reference" else args.lambdas
                    points.extend((system, workload, lam) for lam in lams)
                continue
            lambdas = ([2] if system == "ddp" else [1]) if workload == "small" else args.lambdas
            for lam in lambdas:
                if system.startswith("rudra:softsync2") and lam < 2:
                    continue  # n-softsync needs n ≤ λ
                points.append((system, workload, lam))
    return points


def _earlier_tries(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The launches that failed before the one ``result`` came from, once per launch (on its
    first window); a JSON file written before launches were retried twice kept one, as
    ``first_try`` (on every window), which ``--add`` may bring back."""
    if result.get("window", 0) != 0:
        return []
    return [result["first_try"]] if "first_try" in result else result.get("earlier_tries", [])


def summarize(results: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Per (system, workload, λ): median, min and max of each figure over the passes."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["system"], r["workload"], r["learners"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        s: dict[str, Any] = {
            "reps": len(rs),
            "ok": len(ok),
            "errors": [r["error"] for r in rs if "error" in r],
            "retried": [e["error"] for r in rs for e in _earlier_tries(r)],
        }
        for figure in FIGURES:
            values = [r[figure] for r in ok if r.get(figure) is not None]
            if values:
                s[figure] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        out[key] = s
    return out


FIGURES = [
    "samples_per_s",
    "updates_per_s",
    "latency_ms",
    "server_peak_rss_mb",
    "server_cpu_s_per_update",
    "server_cpu_share",
    "learner_cpu_share",
    "server_cpu_s_per_gradient",
    "learners_cpu_s_per_gradient",
]


def med(summary: dict, key: tuple[str, str, int], figure: str) -> float | None:
    s = summary.get(key, {}).get(figure)
    return s["median"] if s else None


def targets(summary: dict, lambdas: list[int]) -> list[dict[str, Any]]:
    """The issue's targets, each a ratio of medians measured in this run."""
    rows = []

    def add(name: str, num: float | None, den: float | None, goal: float, what: str) -> None:
        ratio = num / den if num is not None and den else None
        rows.append(
            {
                "target": name,
                "ratio": ratio,
                "goal": goal,
                "met": None if ratio is None else bool(ratio >= goal),
                "numbers": what,
            }
        )

    for transport, goal in (("tcp", 3.0), ("shm", 6.0)):
        for lam in lambdas:
            ours = med(summary, (f"rudra:async:{transport}", "a0", lam), "updates_per_s")
            theirs = med(summary, ("mxnet:dist_async", "a0", lam), "updates_per_s")
            add(
                f"(a0) updates/s, rudra async {transport}:// ÷ MXNet dist_async, λ={lam}",
                ours,
                theirs,
                goal,
                f"{fmt(ours)} vs {fmt(theirs)} updates/s",
            )
    for transport in ("tcp", "shm"):
        ours = med(summary, (f"rudra:async:{transport}", "small", 1), "latency_ms")
        theirs = med(summary, ("mxnet:dist_async", "small", 1), "latency_ms")
        add(
            f"(small) 1,000-float push+pull, MXNet dist_async ÷ rudra {transport}://",
            theirs,
            ours,
            4.0,
            f"{fmt(theirs, 3)} ms vs {fmt(ours, 3)} ms",
        )
    lam = 2
    peers = {p: med(summary, (p, "a", lam), "samples_per_s") for p in PEERS}
    measured = {p: v for p, v in peers.items() if v is not None}
    best = max(measured, key=lambda p: measured[p]) if measured else None
    for protocol, transport in LEARNER_MODES:
        ours = med(summary, (f"rudra:{protocol}:{transport}", "a", lam), "samples_per_s")
        add(
            f"(a) samples/s at λ=2, rudra {protocol} {transport}:// ÷ best peer ({best})",
            ours,
            measured.get(best) if best else None,
            1.2,
            f"{fmt(ours)} vs {fmt(measured.get(best) if best else None)} samples/s",
        )
    ref = med(summary, ("reference", "b", 1), "samples_per_s")
    limit = 2 * ref if ref else None
    for protocol, transport in LEARNER_MODES:
        ours = med(summary, (f"rudra:{protocol}:{transport}", "b", lam), "samples_per_s")
        add(
            f"(b) samples/s at λ=2, rudra {protocol} {transport}:// ÷ compute limit (2 × single process)",
            ours,
            limit,
            0.95,
            f"{fmt(ours)} vs 2 × {fmt(ref)} samples/s",
        )
    return rows


LEARNER_MODES = [(p, t) for p in ("async", "async-overlap") for t in ("tcp", "shm")]


def more_ratios(summary: dict, lambdas: list[int]) -> list[str]:
    """Markdown rows: rudra async (without and with overlap) over the best peer, over λ × the
    single process, and over λ single processes run side by side, at every λ."""
    rows = []
    for workload in ("a", "b"):
        ref = med(summary, ("reference", workload, 1), "samples_per_s")
        for lam in lambdas:
            peers = {p: med(summary, (p, workload, lam), "samples_per_s") for p in PEERS}
            measured = {p: v for p, v in peers.items() if v}
            best = max(measured, key=lambda p: measured[p]) if measured else None
            side_by_side = med(summary, ("reference", workload, lam), "samples_per_s")
            for protocol, transport in LEARNER_MODES:
                ours = med(summary, (f"rudra:{protocol}:{transport}", workload, lam), "samples_per_s")
                if ours is None:
                    continue
                vs_peer = f"{ours / measured[best]:.2f}× {best}" if best else "—"
                vs_limit = f"{ours / (lam * ref):.2f}×" if ref else "—"
                vs_copies = f"{ours / side_by_side:.2f}×" if side_by_side else "—"
                rows.append(
                    f"| ({workload}) | {lam} | {protocol} | {transport} | {fmt(ours)} | {vs_peer} | {vs_limit} "
                    f"| {vs_copies} |"
                )
    return rows


def cpu_budget(summary: dict, lambdas: list[int], cores: int) -> list[str]:
    """Markdown rows: where the CPU of each training point goes. Per gradient (one learner
    step): the learners' and the server's CPU, their sum over the reference's CPU per step
    (the compute), the cores busy, and the samples/s the host's cores allow at that cost."""
    rows = []
    for workload in ("a", "b"):
        compute = med(summary, ("reference", workload, 1), "learners_cpu_s_per_gradient")
        for lam in lambdas:
            for system in SYSTEMS:
                s = summary.get((system, workload, lam))
                learners = med(summary, (system, workload, lam), "learners_cpu_s_per_gradient")
                if s is None or learners is None or system == "reference":
                    continue
                server = med(summary, (system, workload, lam), "server_cpu_s_per_gradient") or 0.0
                total = learners + server
                busy = lam * med(summary, (system, workload, lam), "learner_cpu_share") + (
                    med(summary, (system, workload, lam), "server_cpu_share") or 0.0
                )
                over = f"{total / compute:.2f}×" if compute else "—"
                allowed = cores * BATCH[workload] / total
                rows.append(
                    f"| ({workload}) | {system} | {lam} | {fmt(learners * 1e3)} | "
                    f"{fmt(server * 1e3) if server else '—'} | {fmt(total * 1e3)} | {over} | {fmt(busy)} | "
                    f"{fmt(med(summary, (system, workload, lam), 'samples_per_s'))} | {fmt(allowed)} |"
                )
    return rows


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if x == 0 or abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def cell(s: dict[str, Any], figure: str, scale: float = 1.0, digits: int = 3) -> str:
    v = s.get(figure)
    if not v:
        return "—"
    m, lo, hi = (v[k] * scale for k in ("median", "min", "max"))
    if s["ok"] < 2:
        return fmt(m, digits)
    return f"{fmt(m, digits)} ({fmt(lo, digits)}–{fmt(hi, digits)})"


def cores(s: dict[str, Any]) -> str:
    server, learner = s.get("server_cpu_share"), s.get("learner_cpu_share")
    return f"{fmt(server['median'], 2) if server else '—'}, {fmt(learner['median'], 2) if learner else '—'}"


WORKLOAD_TITLES = {
    "a0": "(a0) the parameter server alone: 25,175,040 float32, fixed gradient, no compute",
    "small": "(small) a 1,000-float push+pull round trip, λ = 1 (DDP: an all-reduce between 2 ranks)",
    "a": "(a) communication-heavy: MLP 1024-4096-4096-1024, batch 8, MSE",
    "b": "(b) compute-heavy: CNN on 3×32×32, batch 32, cross-entropy",
}


def markdown(report: dict[str, Any]) -> str:
    summary = {tuple(json.loads(k)): v for k, v in report["summary"].items()}
    m = report["machine"]
    lines = [
        "# rudra-async next to its peers",
        "",
        f"Produced by `{report['command']}` on {report['date']}.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gb']:.0f} GB, Linux {m['kernel']}; "
        f"Python {m['python']}, torch {m['torch']}, MXNet {m['mxnet']} (own venv). "
        f"Load average before/after: {m['load_before']} / {m['load_after']} (a shared machine: expect noise).",
        "",
        f"Each cell: median (min–max) of {report['reps']} pass(es) over the whole matrix × "
        f"{report.get('windows', 1)} consecutive measured window(s) per launch; each point starts "
        "fresh processes and times steady-state windows after warm-up (start-up never counts). "
        "One compute thread per process. Server CPU ms/update: the server process's user+system CPU "
        "over the window ÷ updates in it; CPU cores used: CPU seconds ÷ window seconds (a learner below 1 "
        "waited for the network, the server or a core). Latency: one push+pull (for DDP: all-reduce + SGD step; "
        "not separable in DDP's and MXNet's training loops). See `benchmarks/peers/driver.py` for the method.",
        "",
        *(
            [f"**Incomplete run: {report['launches_done']} of {report['launches_total']} launches.**", ""]
            if report.get("launches_done", 0) < report.get("launches_total", 0)
            else []
        ),
        "## Targets",
        "",
        "| target | ratio | goal | met | numbers (medians) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in report["targets"]:
        ratio = "—" if t["ratio"] is None else f"{t['ratio']:.2f}×"
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['target']} | {ratio} | ≥ {t['goal']:g}× | {met} | {t['numbers']} |")
    for workload in report["workloads"]:
        keys = [k for k in summary if k[1] == workload]
        if not keys:
            continue
        keys.sort(key=lambda k: (SYSTEMS.index(k[0]) if k[0] in SYSTEMS else 99, k[2]))
        lines += [
            "",
            f"## {WORKLOAD_TITLES[workload]}",
            "",
            "| system | λ | samples/s | updates/s | push+pull ms | server peak RSS MB | server CPU ms/update "
            "| CPU cores used: server, each learner |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for k in keys:
            s = summary[k]
            if not s["ok"]:
                first = s["errors"][0].splitlines()[0] if s["errors"] else "?"
                lines.append(f"| {k[0]} | {k[2]} | failed: {first} | | | | | |")
                continue
            note = f" ({s['ok']}/{s['reps']} ok)" if s["ok"] < s["reps"] else ""
            lines.append(
                f"| {k[0]}{note} | {k[2]} | {cell(s, 'samples_per_s')} | {cell(s, 'updates_per_s')} | "
                f"{cell(s, 'latency_ms')} | {cell(s, 'server_peak_rss_mb')} | "
                f"{cell(s, 'server_cpu_s_per_update', 1e3)} | {cores(s)} |"
            )
    ratios = more_ratios(summary, report.get("lambdas", [1, 2, 4]))
    if ratios:
        lines += [
            "",
            "## rudra-async async at every λ (ratios of medians)",
            "",
            "| workload | λ | learners | transport | samples/s | ÷ best peer | ÷ (λ × single process) "
            "| ÷ λ single processes side by side |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *ratios,
        ]
    budget = cpu_budget(summary, report.get("lambdas", [1, 2, 4]), m["cores"])
    if budget:
        compute = {w: med(summary, ("reference", w, 1), "learners_cpu_s_per_gradient") for w in ("a", "b")}
        lines += [
            "",
            "## Where the CPU goes (training workloads)",
            "",
            "Per gradient (one learner step), the CPU seconds of all learners and of the server process "
            "(MXNet: its server, not the scheduler) over the window ÷ gradients in it; ÷ compute: that sum over "
            "the single-process reference's CPU per step (compute, update and nothing else: "
            + ", ".join(f"({w}) {fmt(c * 1e3)} ms" for w, c in compute.items() if c)
            + "). What exceeds 1× is what communicating costs, whichever process pays it (loopback TCP: the "
            "kernel's copies of every byte on both sides). Cores busy: the server's and learners' CPU ÷ window "
            f"seconds; where it is near {m['cores']} (all cores), the point is CPU-bound and its samples/s "
            f"cannot pass {m['cores']} × batch ÷ CPU per gradient (last column).",
            "",
            "| workload | system | λ | CPU ms per gradient: learners | server | all | ÷ compute | cores busy "
            "| samples/s | samples/s the cores allow at this cost |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *budget,
        ]
    errors = [(k, e) for k, s in summary.items() for e in s["errors"]]
    retried = [(k, e) for k, s in summary.items() for e in s.get("retried", [])]
    if errors or retried:
        lines += ["", "## Errors", ""]
        for k, e in errors:
            lines.append(f"- {k[0]}, {k[1]}, λ={k[2]}: {one_line(e)}")
        for k, e in retried:
            lines.append(f"- {k[0]}, {k[1]}, λ={k[2]}, run again after a start-up failure: {one_line(e)}")
    lines += ["", "## What each system is", "", *SYSTEM_NOTES]
    return "\n".join(lines) + "\n"


SYSTEM_NOTES = [
    "- `rudra:P:T`: one rudra-async server process (`ParameterServer`, protocol P, torch's fused SGD "
    "kernel, 1 thread) and λ learner processes (`SyncClient.push_pull`: one round trip pushes the gradient "
    "and pulls the next weights); training learners wrap the model in `rudra_async.torch.DistributedOptimizer` "
    "as a user's script does (its default: no overlap of communication with compute). `async-overlap`: "
    "the same with `DistributedOptimizer(overlap=True)` (the paper's adv*): step t's push+pull runs in a "
    "background thread while step t+1 computes, so each gradient is one more update stale; its push+pull "
    "column is the time `step()` waits for the previous exchange. `softsync2`: n = 2, "
    "c = ⌊λ/2⌋ gradients per update.",
    "- `ddp`: `DistributedDataParallel` over gloo, λ ranks, `SGD(fused=True)` on each; the all-reduce "
    "overlaps the backward pass. In (a0) and (small): all-reduce of the fixed gradient + the SGD step.",
    "- `rpc:async` / `rpc:sync`: PyTorch's batch-update parameter-server tutorial over "
    "`torch.distributed.rpc` (TensorPipe): the server holds the model and `optim.SGD(momentum=0.9)`; "
    "trainers call `rpc_sync(update_and_fetch, grads)`, answered (with the weights as a list of tensors "
    "rather than the tutorial's pickled module) after 1 or λ gradients.",
    "- `mxnet:dist_async` / `mxnet:dist_sync`: MXNet 1.9.1's kvstore (ps-lite) with one scheduler, one "
    "server and λ workers on 127.0.0.1, server-side SGD through `kv.set_optimizer`; training workers "
    "compute with MXNet's own Gluon (hybridized, same architectures) and push/pull every parameter with "
    "priorities as Gluon's Trainer does, so MXNet's compute speed (oneDNN) is part of its figures. MXNet "
    "runs a Python thread and an engine worker thread per process (`MXNET_CPU_WORKER_NTHREADS=1`).",
    "- `reference`: one process, `torch.optim.SGD(fused=True)` on the same model and batches: the compute "
    "limit (λ × its samples/s at λ = 1) of the training workloads. At λ > 1: λ such processes side by side, "
    "independent (no communication): what this host gives λ trainings at once, however they communicate.",
]


def one_line(text: str) -> str:
    return text.strip().replace("\n", " ⏎ ")[:600]


def machine(args: argparse.Namespace) -> dict[str, Any]:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    torch_version = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    uses_mxnet = any(s.startswith("mxnet") for s in args.systems)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch_version,
        "mxnet": mxnet_version(args.mxnet_venv) if uses_mxnet else "not run",
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: short windows, 1 pass, outputs not in docs/")
    ap.add_argument("--reps", type=int, default=None, help="passes over the matrix (default 3; 1 with --quick)")
    ap.add_argument("--windows", type=int, default=1, help="measured windows per launch (each counts as a repetition)")
    ap.add_argument("--only", default="", help="comma-separated prefixes of system names (default: all)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated among a0,small,a,b")
    ap.add_argument("--lambdas", default="1,2,4", help="learner counts λ")
    ap.add_argument("--tiny", action="store_true", help="tiny models and a 10,000-float (a0), for tests")
    ap.add_argument("--mxnet-venv", type=Path, default=MXNET_VENV)
    ap.add_argument("--server-kernel", default="auto", help="the rudra server's --kernel (auto: torch on a CPU)")
    ap.add_argument(
        "--server-gradient-buffers", type=int, help="the rudra server's --gradient-buffers (default: its own)"
    )
    ap.add_argument("--md", type=Path, default=None, help="Markdown table (default docs/benchmarks.md)")
    ap.add_argument("--json", type=Path, default=None, help="JSON results (default docs/benchmarks.json)")
    ap.add_argument(
        "--add",
        action="store_true",
        help="add this run's points to the results already in --json (points run again replace theirs)",
    )
    args = ap.parse_args(argv)
    prefixes = [p for p in args.only.split(",") if p]
    args.systems = [s for s in SYSTEMS if not prefixes or any(s.startswith(p) for p in prefixes)]
    if not args.systems:
        ap.error(f"--only {args.only!r} matches none of {', '.join(SYSTEMS)}")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if bad := [w for w in args.workloads if w not in WORKLOADS]:
        ap.error(f"unknown workloads {bad}; choose among {WORKLOADS}")
    args.lambdas = [int(x) for x in args.lambdas.split(",") if x]
    args.reps = args.reps or (1 if args.quick else 3)
    scratch = Path(tempfile.gettempdir()) / "rudra-peers-quick"
    default_dir = scratch if (args.quick or args.tiny) else ROOT / "docs"
    args.md = args.md or default_dir / "benchmarks.md"
    args.json = args.json or default_dir / "benchmarks.json"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kill_leftovers()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks kill the point's processes
    points = matrix(args)
    command = "python -m benchmarks.peers " + " ".join(argv if argv is not None else sys.argv[1:])
    report: dict[str, Any] = {
        "command": command.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(args),
        "reps": args.reps,
        "windows": args.windows,
        "workloads": args.workloads,
        "lambdas": args.lambdas,
        "quick": args.quick,
        "results": [],
    }
    if args.add and args.json.exists():
        keep_earlier(report, json.loads(args.json.read_text()), points)
        args.lambdas = report["lambdas"]
    total = len(points) * args.reps
    print(f"{len(points)} points × {args.reps} passes × {args.windows} windows = {total} launches", file=sys.stderr)
    done = 0
    try:
        for rep in range(args.reps):
            for system, workload, lam in points:
                rs = run_point(system, workload, lam, rep, args)
                report["results"].extend(rs)
                done += 1
                report["launches_done"], report["launches_total"] = done, total
                print(
                    f"[{done}/{total}] pass {rep + 1} {system:18} {workload:5} λ={lam}  {status(rs)}", file=sys.stderr
                )
                write(report, args, final=False)  # an interrupted run keeps what it measured
    finally:
        write(report, args, final=True)
    return report


def keep_earlier(report: dict[str, Any], earlier: dict[str, Any], points: list[tuple[str, str, int]]) -> None:
    """``--add``: the earlier run's results for the points this run does not measure, its
    commands listed before this one's, its workloads and λ joined to this run's."""
    again = set(points)
    report["results"] = [r for r in earlier["results"] if (r["system"], r["workload"], r["learners"]) not in again]
    report["command"] = f"{earlier['command']}` then `{report['command']}"
    report["workloads"] = sorted({*earlier["workloads"], *report["workloads"]})
    report["lambdas"] = sorted({*earlier["lambdas"], *report["lambdas"]})


def status(rs: list[dict[str, Any]]) -> str:
    r = rs[0]
    if "error" in r:
        return "ERROR " + " ⏎ ".join(r["error"].strip().splitlines()[-2:])[:300]
    figures = "  ".join(
        f"{f}={'/'.join(fmt(x[f]) for x in rs)}"
        for f in ("samples_per_s", "updates_per_s", "latency_ms")
        if r.get(f) is not None
    )
    return f"{figures}  ({r['wall_s']:.1f} s)"


def write(report: dict[str, Any], args: argparse.Namespace, final: bool) -> None:
    report["machine"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    summary = summarize(report["results"])
    report["summary"] = {json.dumps(list(k)): v for k, v in summary.items()}
    report["targets"] = targets(summary, args.lambdas)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    args.md.write_text(markdown(report))
    if final:
        print(f"wrote {args.md} and {args.json}", file=sys.stderr)

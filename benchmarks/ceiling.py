"""What this host allows the (a0) workload at best, whatever the software, in one run.

(a0) is the parameter server alone: 25,175,040 float32, each learner pushes a gradient
(100 MB) and pulls the weights (100 MB) per update, the server checks the gradient (max |g|)
and applies momentum SGD. This script measures what that costs in CPU on this host, each
part on its own, and divides the host's cores by the sum: no implementation that moves
those bytes and does that work can make more updates per second (it would need the parts
to overlap perfectly, with no other cost at all).

- **tcp**: a bare loopback echo of the same bytes: λ client processes each send 100 MB and
  receive 100 MB, a server process echoes them with a thread per connection (blocking
  sockets, no framing, no work; the kernel's autotuned buffers: fixed 4 MiB ones gave no
  less CPU, and ``sendfile`` from a memfd was slower). Its round trips/s, and the CPU
  seconds of all processes per round trip.
- **shm**: two copies of 100 MB per update (the gradient into shared memory, the weights
  out of it; ``memcpy`` on one thread). A learner whose gradient were produced in shared
  memory in the first place would save one: this bound holds for learners that copy, as
  ``SyncClient`` and ``DistributedOptimizer`` do (and MXNet's ``kv.push``).
- **the server's work** per update, on one thread: the check (``torch.aminmax``, what the
  server's torch kernel uses) and the update (torch's fused momentum SGD), each over a
  gradient it has not read just before.

Bound (updates/s) = cores / (transport CPU + check + update), with and without the check
(tcp); at λ = 1 also no more than the bare echo's round trips/s (tcp), and than one over the
serial chain copy in + update (shm, with the check and the copy out overlapped). With
``--targets docs/benchmarks.json`` it prints, next to each bound, 3× and 6× MXNet
``dist_async``'s (a0) updates/s of that run (the issue's targets for tcp and shm).

**Training, (a) and (b) at λ = 2**, with ``--targets`` (whose single-process reference gives
the compute): per gradient, a parameter server's processes spend at least the reference's
CPU per step (forward, backward and the SGD update, one thread), plus moving the model's
bytes each way (the bare echo at that size, with 2 learners; or the two shm copies), plus the
check. Bound (samples/s) = min(cores × batch ÷ that, 2 × batch ÷ the reference's step less
its update). Printed next to the targets of that run: (a) 1.2× the best peer, (b) 0.95× the
compute limit (2 × the reference's samples/s).

    python benchmarks/ceiling.py [--seconds 6] [--lambdas 1,2,4] [--targets docs/benchmarks.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from timing import median_time  # benchmarks/timing.py (the script's directory is on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.peers: the workloads' models

VALUES = 25_175_040  # (a)'s MLP, the (a0) vector
NBYTES = 4 * VALUES
WARMUP_S = 1.5


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True


def _echo_server(ready: Any, learners: int, nbytes: int, measuring: Any, done: Any, cpu: Any) -> None:
    """Echo every ``nbytes`` received on each of ``learners`` connections (one thread each);
    report this process's CPU seconds between ``measuring`` and ``done``."""
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])

    def echo(conn: socket.socket) -> None:
        buf = memoryview(bytearray(nbytes))
        while _recv_exactly(conn, buf):
            conn.sendall(buf)

    for _ in range(learners):
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
    measuring.wait()
    start = time.process_time()
    done.wait()
    cpu.put(time.process_time() - start)


def _echo_client(port: int, seconds: float, nbytes: int, measuring: Any, out: Any) -> None:
    """Round trips of ``nbytes`` each way for ``WARMUP_S`` + ``seconds``; report the round
    trips and CPU seconds of the measured part."""
    sock = socket.create_connection(("127.0.0.1", port))
    up, down = memoryview(np.full(nbytes // 4, 1e-3, np.float32)).cast("B"), memoryview(bytearray(nbytes))
    end_warmup = time.monotonic() + WARMUP_S
    while time.monotonic() < end_warmup:
        sock.sendall(up)
        _recv_exactly(sock, down)
    measuring.set()
    trips, cpu0, t0 = 0, time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        sock.sendall(up)
        _recv_exactly(sock, down)
        trips += 1
    out.put((trips, time.monotonic() - t0, time.process_time() - cpu0))
    sock.close()


def tcp_echo(learners: int, seconds: float, nbytes: int = NBYTES) -> tuple[float, float]:
    """(round trips/s, CPU seconds of all processes per round trip) of the bare echo of
    ``nbytes`` (a multiple of 4) each way."""
    ctx = mp.get_context("spawn")
    ready, out, cpu = ctx.Queue(), ctx.Queue(), ctx.Queue()
    measuring, done = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_echo_server, args=(ready, learners, nbytes, measuring, done, cpu), daemon=True)
    server.start()
    port = ready.get(timeout=60)
    clients = [ctx.Process(target=_echo_client, args=(port, seconds, nbytes, measuring, out)) for _ in range(learners)]
    for c in clients:
        c.start()
    results = [out.get(timeout=seconds + 120) for _ in clients]
    done.set()
    server_cpu = cpu.get(timeout=60)
    for c in clients:
        c.join(timeout=60)
    server.join(timeout=60)
    trips = sum(r[0] for r in results)
    rate = sum(r[0] / r[1] for r in results)
    return rate, (server_cpu + sum(r[2] for r in results)) / trips


def server_work(reps: int, values: int = VALUES) -> dict[str, float]:
    """Seconds, one thread, of a copy of ``values`` float32, the check and the update, each
    reading arrays it did not read just before (a server reads each gradient once; a small
    model's arrays may still be in the cache, which only raises the bound)."""
    torch.set_num_threads(1)
    grads = [np.random.default_rng(i).standard_normal(values).astype(np.float32) for i in range(3)]
    turn = itertools.cycle(grads)
    w, v, out = (np.zeros(values, np.float32) for _ in range(3))
    tw, tv = torch.from_numpy(w), torch.from_numpy(v)

    def update() -> None:
        g = torch.from_numpy(next(turn))
        torch._fused_sgd_(
            [tw], [g], [tv], weight_decay=0.0, momentum=0.9, lr=1e-6, dampening=0.0,
            nesterov=False, maximize=False, is_first_step=False,
        )  # fmt: skip

    return {
        "copy": median_time(lambda: np.copyto(out, next(turn)), reps),
        "check": median_time(lambda: torch.aminmax(torch.from_numpy(next(turn))), reps),
        "update": median_time(update, reps),
    }


def load_summary(path: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """A driver run's summary (``python -m benchmarks.peers``'s JSON), keyed (system, workload, λ)."""
    with open(path) as f:
        return {tuple(json.loads(k)): v for k, v in json.load(f)["summary"].items()}


def mxnet_targets(summary: dict[tuple[str, str, int], dict[str, Any]]) -> dict[int, float]:
    """MXNet dist_async's (a0) updates/s per λ in a driver run."""
    found = {}
    for (system, workload, learners), point in summary.items():
        if system == "mxnet:dist_async" and workload == "a0" and point.get("updates_per_s"):
            found[learners] = point["updates_per_s"]["median"]
    return found


#: the learner count of the issue's training targets
TRAINING_LAMBDA = 2


def training_bound(
    ref_cpu_s: float, ref_samples_per_s: float, batch: int, extra_s: float, update_s: float, cores: int, lam: int
) -> float:
    """Samples/s at best for λ = ``lam`` learners: ``cores`` ÷ (the reference's CPU per step +
    ``extra_s``, what moving and checking a gradient adds) per ``batch``, and no more than
    ``lam`` learners each running the reference's step less its update (the server's)."""
    by_cores = cores * batch / (ref_cpu_s + extra_s)
    by_steps = lam * batch / (batch / ref_samples_per_s - update_s)
    return min(by_cores, by_steps)


def training_target(summary: dict[tuple[str, str, int], dict[str, Any]], workload: str, lam: int) -> tuple[float, str]:
    """The issue's target for ``workload`` at λ = ``lam`` in a driver run (samples/s, and whose):
    (a) 1.2× the best peer, (b) 0.95× λ single processes; NaN where the run lacks it."""
    from benchmarks.peers.driver import PEERS, med

    if workload == "a":
        peers = {p: v for p in PEERS if (v := med(summary, (p, "a", lam), "samples_per_s"))}
        best = max(peers, key=lambda p: peers[p], default=None)
        return (1.2 * peers[best], f"1.2 × {best} {peers[best]:,.1f}") if best else (math.nan, "no peer in the JSON")
    ref = med(summary, ("reference", workload, 1), "samples_per_s")
    return (0.95 * lam * ref, f"0.95 × {lam} × the single process {ref:,.1f}") if ref else (math.nan, "no reference")


def training_bounds(summary: dict[tuple[str, str, int], dict[str, Any]], cores: int, seconds: float, reps: int) -> None:
    """Print (a)'s and (b)'s bounds at λ = 2 (see the module docstring) next to the run's targets."""
    from benchmarks.peers.common import BATCH
    from benchmarks.peers.driver import med
    from benchmarks.peers.torch_side import build_model

    lam = TRAINING_LAMBDA
    print(f"(a)/(b) bounds at λ = {lam}, samples/s: min(cores × batch ÷ CPU per gradient, {lam} learners' steps)")
    for workload in ("a", "b"):
        ref = ("reference", workload, 1)
        ref_cpu, ref_rate = med(summary, ref, "learners_cpu_s_per_gradient"), med(summary, ref, "samples_per_s")
        if not ref_cpu or not ref_rate:
            print(f"  ({workload}): the JSON has no single-process reference")
            continue
        batch, values = BATCH[workload], sum(p.numel() for p in build_model(workload, False).parameters())
        work = server_work(reps, values)
        moves = {"tcp": tcp_echo(lam, seconds, 4 * values)[1], "shm": 2 * work["copy"]}
        target, whose = training_target(summary, workload, lam)
        print(
            f"  ({workload}) {values:,} floats, batch {batch}: reference {ref_cpu * 1e3:.1f} ms CPU per step; per "
            f"gradient tcp echo {moves['tcp'] * 1e3:.2f} ms, shm copies {moves['shm'] * 1e3:.2f} ms, check "
            f"{work['check'] * 1e3:.2f} ms; target {target:,.1f} ({whose})"
        )
        for transport, move_s in moves.items():
            checked, free = (
                training_bound(ref_cpu, ref_rate, batch, move_s + check_s, work["update"], cores, lam)
                for check_s in (work["check"], 0.0)
            )
            print(
                f"     {transport}: bound {checked:,.1f} ({free:,.1f} without the check, {free / target:.2f}× the "
                "target)",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds of each echo point")
    ap.add_argument("--lambdas", default="1,2,4")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--targets", help="a benchmarks.peers JSON: print 3x/6x its MXNet dist_async (a0)")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    work = server_work(args.reps)
    ms = {k: v * 1e3 for k, v in work.items()}
    print(f"host: {cores} cores; one thread, 25.2M float32, median of {args.reps}:")
    print(f"  copy 100 MB {ms['copy']:.1f} ms   check (aminmax) {ms['check']:.1f} ms   update (fused SGD) "
          f"{ms['update']:.1f} ms")  # fmt: skip
    summary = load_summary(args.targets) if args.targets else {}
    mx = mxnet_targets(summary)
    server_ms = ms["check"] + ms["update"]
    print("(a0) bounds, updates/s: cores / CPU per update; at λ = 1 also no faster than the bare echo")
    print("  (tcp) and than the serial chain copy in + update (shm: the check and the copy out overlapped)")
    for lam in [int(x) for x in args.lambdas.split(",")]:
        rate, cpu_s = tcp_echo(lam, args.seconds)
        echo_ms = cpu_s * 1e3
        tcp_bound = cores / ((echo_ms + server_ms) / 1e3)
        tcp_free = cores / ((echo_ms + ms["update"]) / 1e3)
        shm_bound = cores / ((2 * ms["copy"] + server_ms) / 1e3)
        if lam == 1:
            tcp_bound, tcp_free = min(tcp_bound, rate), min(tcp_free, rate)
            shm_bound = min(shm_bound, 1e3 / (ms["copy"] + ms["update"]))
        line = (
            f"  λ={lam}: tcp echo {rate:5.1f} round trips/s, {echo_ms:5.1f} ms CPU each -> tcp bound "
            f"{tcp_bound:5.1f} ({tcp_free:5.1f} without the check);  shm bound {shm_bound:5.1f}"
        )
        if lam in mx:
            line += f";  targets: tcp {3 * mx[lam]:5.1f}, shm {6 * mx[lam]:5.1f} (MXNet {mx[lam]:.2f})"
        print(line, flush=True)
    if summary:
        training_bounds(summary, cores, args.seconds, args.reps)


if __name__ == "__main__":
    main()

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

    python benchmarks/ceiling.py [--seconds 6] [--lambdas 1,2,4] [--targets docs/benchmarks.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any

import numpy as np
import torch
from timing import median_time  # benchmarks/timing.py (the script's directory is on sys.path)

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


def _echo_server(ready: Any, learners: int, measuring: Any, done: Any, cpu: Any) -> None:
    """Echo every 100 MB received on each of ``learners`` connections (one thread each);
    report this process's CPU seconds between ``measuring`` and ``done``."""
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])

    def echo(conn: socket.socket) -> None:
        buf = memoryview(bytearray(NBYTES))
        while _recv_exactly(conn, buf):
            conn.sendall(buf)

    for _ in range(learners):
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
    measuring.wait()
    start = time.process_time()
    done.wait()
    cpu.put(time.process_time() - start)


def _echo_client(port: int, seconds: float, measuring: Any, out: Any) -> None:
    """Round trips of 100 MB each way for ``WARMUP_S`` + ``seconds``; report the round trips
    and CPU seconds of the measured part."""
    sock = socket.create_connection(("127.0.0.1", port))
    up, down = memoryview(np.full(VALUES, 1e-3, np.float32)).cast("B"), memoryview(bytearray(NBYTES))
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


def tcp_echo(learners: int, seconds: float) -> tuple[float, float]:
    """(round trips/s, CPU seconds of all processes per round trip) of the bare echo."""
    ctx = mp.get_context("spawn")
    ready, out, cpu = ctx.Queue(), ctx.Queue(), ctx.Queue()
    measuring, done = ctx.Event(), ctx.Event()
    server = ctx.Process(target=_echo_server, args=(ready, learners, measuring, done, cpu), daemon=True)
    server.start()
    port = ready.get(timeout=60)
    clients = [ctx.Process(target=_echo_client, args=(port, seconds, measuring, out)) for _ in range(learners)]
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


def server_work(reps: int) -> dict[str, float]:
    """Seconds, one thread, of a 100 MB copy, the check and the update, each reading
    arrays it did not read just before (a server reads each gradient once)."""
    torch.set_num_threads(1)
    grads = [np.random.default_rng(i).standard_normal(VALUES).astype(np.float32) for i in range(3)]
    turn = itertools.cycle(grads)
    w, v, out = (np.zeros(VALUES, np.float32) for _ in range(3))
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


def mxnet_targets(path: str) -> dict[int, float]:
    """MXNet dist_async's (a0) updates/s per λ in a driver run's JSON."""
    with open(path) as f:
        summary = json.load(f)["summary"]
    found = {}
    for key, point in summary.items():
        system, workload, learners = json.loads(key)
        if system == "mxnet:dist_async" and workload == "a0" and point.get("updates_per_s"):
            found[learners] = point["updates_per_s"]["median"]
    return found


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
    mx = mxnet_targets(args.targets) if args.targets else {}
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


if __name__ == "__main__":
    main()

"""Push+pull round trip over TCP against a raw uvloop socket baseline, in one run.

Each round trip moves the gradient up and the weights down (2 × SIZE bytes). The baseline
moves the same bytes with a bare uvloop BufferedProtocol echo (preallocated buffers, no
framing, no update). The server runs in its own process, like a real deployment.

    python benchmarks/tcp_roundtrip.py [--mb 100] [--reps 10] [--shards 2]

Prints medians and the ratio rudra/baseline for throughput (higher is better), both for
the whole round trip and for the transport share (the server's update-kernel time taken
out; since the reply is written while its update is computed, part of that time overlaps
the transfer, so this share is a lower bound and its ratio an upper bound), and the small-message round-trip latency; for the latter also the raw socket
busy-polling as rudra-async's connections do (``RUDRA_ASYNC_BUSY_POLL_US``), for context.
With ``--shards N`` it also times the same round trip against a group of N shard servers
(one process each) and prints it next to the single server's.

Where the large round trip's time goes: the CPU each side spends per round trip (the
server process's, read from /proc, and this process's), for the raw echo and for
rudra-async, over the timed round trips. On a host with few cores, the round trip cannot
take less than both sides' CPU over the cores, whatever overlaps.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import uvloop

from rudra_async.client import SyncClient, connect
from rudra_async.config import ServerConfig
from rudra_async.layout import Layout, Shard
from rudra_async.server import ParameterServer
from rudra_async.transports import polling


class CpuMeter:
    """CPU seconds of this process and of another (``pid``, read from /proc) between
    :meth:`start` and :meth:`stop`, per ``count`` round trips."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.server = self.client = 0.0

    def _other(self) -> float:
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def start(self) -> None:
        self._at = (self._other(), time.process_time())

    def stop(self, count: int) -> None:
        server, client = self._at
        self.server = (self._other() - server) / count
        self.client = (time.process_time() - client) / count


# -- baseline: raw uvloop echo of N bytes -------------------------------------------------------
class _Receiver(asyncio.BufferedProtocol):
    """Receives messages of exactly ``nbytes`` into one preallocated buffer; with ``poll``,
    its loop busy-polls after each write as rudra-async's connections do."""

    def __init__(self, nbytes: int, poll: bool = False) -> None:
        self.buf = bytearray(nbytes)
        self.pos = 0
        self.poller = polling.loop_poller() if poll else None

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return memoryview(self.buf)[self.pos :]

    def write(self, data) -> None:
        self.transport.write(data)
        if self.poller is not None:
            self.poller.sent()

    def buffer_updated(self, n):
        if self.poller is not None:
            self.poller.arrived()
        self.pos += n
        if self.pos == len(self.buf):
            self.pos = 0
            self.on_message()

    def on_message(self) -> None:
        raise NotImplementedError


class _Echo(_Receiver):
    def __init__(self, nbytes: int, poll: bool = False) -> None:
        super().__init__(nbytes, poll)
        self.out = bytearray(nbytes)

    def on_message(self) -> None:
        self.write(self.out)


class _Client(_Receiver):
    done: asyncio.Future | None = None

    def on_message(self) -> None:
        self.done.set_result(None)


def _serve_raw(nbytes: int, port_q, poll: bool = False) -> None:
    async def main():
        server = await asyncio.get_running_loop().create_server(lambda: _Echo(nbytes, poll), "127.0.0.1", 0)
        port_q.put(server.sockets[0].getsockname()[1])
        await asyncio.sleep(3600)

    uvloop.run(main())


async def raw_round_trips(
    port: int, nbytes: int, reps: int, poll: bool = False, cpu: CpuMeter | None = None
) -> list[float]:
    """Seconds per round trip of the raw echo (the first, a warm-up, left out; ``cpu``
    measures the others)."""
    loop = asyncio.get_running_loop()
    _, proto = await loop.create_connection(lambda: _Client(nbytes, poll), "127.0.0.1", port)
    payload = bytearray(nbytes)
    times = []
    for i in range(reps + 1):
        proto.done = loop.create_future()
        t = time.perf_counter()
        proto.write(payload)
        await proto.done
        times.append(time.perf_counter() - t)
        if cpu is not None and i == 0:
            cpu.start()
    if cpu is not None:
        cpu.stop(reps)
    proto.transport.close()
    return times[1:]


# -- rudra: a real ParameterServer in another process --------------------------------------------
def _serve_rudra(size: int, port_q, stats_pipe, shard: Shard = Shard()) -> None:
    async def main():
        cfg = ServerConfig(listen=["tcp://127.0.0.1:0"], lr=1e-6, momentum=0.9, shard=shard)
        async with ParameterServer(cfg, initial={"w": np.zeros(size, np.float32)}) as ps:
            port_q.put((shard.index, ps.addresses[0]))
            while True:  # answer "mark" (after the warm-up) and "stats" (the end) with the statistics
                if not stats_pipe.poll():
                    await asyncio.sleep(0.05)
                    continue
                request = stats_pipe.recv()
                stats_pipe.send(ps.stats(loss_curve=False))
                if request == "stats":
                    break

    uvloop.run(main())


async def rudra_round_trips(
    url: str,
    size: int,
    reps: int,
    initial: np.ndarray | None = None,
    after_warmup: Callable[[], None] = lambda: None,
    **options: Any,
) -> list[float]:
    """Seconds per push+pull of ``size`` floats (the first, which warms the buffers, left out;
    ``after_warmup()`` is called after it); ``initial`` and ``options`` go to
    :func:`rudra_async.client.connect`."""
    client = await connect(url, Layout.from_shapes([("w", (size,))]), initial, **options)
    grad = np.full(size, 1e-3, np.float32)
    w = await client.pull()
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        w = await client.push_pull(grad, w.timestamp)
        times.append(time.perf_counter() - t)
        if i == 0:
            after_warmup()
    await client.close()
    return times[1:]


def blocking_round_trips(
    url: str, size: int, reps: int, after_warmup: Callable[[], None] = lambda: None
) -> list[float]:
    """:func:`rudra_round_trips` through :class:`~rudra_async.client.SyncClient`, the blocking
    client a learner's ``DistributedOptimizer`` uses."""
    client = SyncClient(url, Layout.from_shapes([("w", (size,))]))
    grad = np.full(size, 1e-3, np.float32)
    w = client.pull()
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        w = client.push_pull(grad, w.timestamp)
        times.append(time.perf_counter() - t)
        if i == 0:
            after_warmup()
    client.close()
    return times[1:]


def raw_median(ctx, nbytes: int, reps: int, poll: bool = False) -> tuple[float, CpuMeter]:
    """Median seconds per round trip of the raw echo (``poll``: both ends busy-poll), and
    both sides' CPU per round trip."""
    port_q = ctx.Queue()
    raw = ctx.Process(target=_serve_raw, args=(nbytes, port_q, poll), daemon=True)
    raw.start()
    cpu = CpuMeter(raw.pid)
    raw_times = uvloop.run(raw_round_trips(port_q.get(timeout=30), nbytes, reps, poll, cpu))
    raw.kill()
    return statistics.median(raw_times), cpu


def measure(size: int, reps: int, polled_raw: bool = False) -> dict:
    nbytes = 4 * size
    ctx = mp.get_context("spawn")
    raw, raw_cpu = raw_median(ctx, nbytes, reps)
    rudra_cpu: list[CpuMeter] = []
    rudra_times, update_per_rt = rudra_group(ctx, size, reps, 1, rudra_cpu)
    blocking_times, _ = rudra_group(ctx, size, reps, 1, blocking=True)
    return {
        "blocking": statistics.median(blocking_times),
        "bytes_per_rt": 2 * nbytes,
        "raw": raw,
        "raw_polled": raw_median(ctx, nbytes, reps, poll=True)[0] if polled_raw else None,
        "rudra": statistics.median(rudra_times),
        "update": update_per_rt,
        "raw_cpu": raw_cpu,
        "rudra_cpu": rudra_cpu[0],
    }


def rudra_group(
    ctx, size: int, reps: int, shards: int, cpu: list[CpuMeter] | None = None, blocking: bool = False
) -> tuple[list[float], float]:
    """Round-trip times against ``shards`` server processes, and the slowest shard's update
    time per round trip over the timed ones (the warm-up's first update, which touches the
    momentum's pages for the first time, left out). With ``cpu``, one :class:`CpuMeter` per
    shard is appended to it (this process's CPU in each). ``blocking``: through the
    SyncClient (one server only), not the asyncio Client."""
    port_q = ctx.Queue()
    pipes, procs = [], []
    for i in range(shards):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_serve_rudra, args=(size, port_q, there, Shard(i, shards)), daemon=True)
        proc.start()
        pipes.append(here)
        procs.append(proc)
    by_shard = dict(port_q.get(timeout=30) for _ in range(shards))
    marks = []
    meters = [CpuMeter(proc.pid) for proc in procs]

    def mark() -> None:
        for here in pipes:
            here.send("mark")
            marks.append(here.recv())
        for meter in meters:
            meter.start()

    url = ",".join(by_shard[i] for i in range(shards))
    if blocking:
        times = blocking_round_trips(url, size, reps, after_warmup=mark)
    else:
        times = uvloop.run(rudra_round_trips(url, size, reps, after_warmup=mark))
    for meter in meters:
        meter.stop(reps)
    if cpu is not None:
        cpu += meters
    updates = []
    for here, proc, before in zip(pipes, procs, marks):
        here.send("stats")
        after = here.recv()
        updates.append((after["update_seconds"] - before["update_seconds"]) / (after["updates"] - before["updates"]))
        proc.kill()
    return times, max(updates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small-floats", type=int, default=256)
    ap.add_argument("--small-reps", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=1, help="also time a group of this many shard servers")
    args = ap.parse_args()

    big = measure(int(args.mb * 1e6 / 4), args.reps)
    gbps = lambda s: big["bytes_per_rt"] / s / 1e9
    transport = big["rudra"] - big["update"]
    print(
        f"push+pull of a {args.mb:g} MB gradient ({big['bytes_per_rt'] / 1e6:.0f} MB moved per round trip), median of {args.reps}"
    )
    print(f"  raw uvloop socket baseline : {big['raw'] * 1e3:8.1f} ms  {gbps(big['raw']):6.2f} GB/s")
    print(
        f"  rudra-async, whole trip    : {big['rudra'] * 1e3:8.1f} ms  {gbps(big['rudra']):6.2f} GB/s   ratio {big['raw'] / big['rudra']:.2f}x"
    )
    print(
        f"  the same, SyncClient       : {big['blocking'] * 1e3:8.1f} ms  {gbps(big['blocking']):6.2f} GB/s   "
        f"ratio {big['raw'] / big['blocking']:.2f}x"
    )
    print(f"    of which server update   : {big['update'] * 1e3:8.1f} ms")
    print(
        f"  rudra-async, transport only: {transport * 1e3:8.1f} ms  {gbps(transport):6.2f} GB/s   ratio {big['raw'] / transport:.2f}x"
    )
    cores = len(os.sched_getaffinity(0))
    for name, cpu in (("raw socket", big["raw_cpu"]), ("rudra-async", big["rudra_cpu"])):
        both = cpu.server + cpu.client
        print(
            f"  CPU per round trip, {name:11}: server {cpu.server * 1e3:6.1f} ms + client {cpu.client * 1e3:6.1f} ms"
            f" = {both * 1e3:6.1f} ms, over {cores} cores at least {both / cores * 1e3:6.1f} ms"
        )
    if args.shards > 1:
        times, update = rudra_group(mp.get_context("spawn"), int(args.mb * 1e6 / 4), args.reps, args.shards)
        group = statistics.median(times)
        print(
            f"  {args.shards} shard servers, whole trip: {group * 1e3:8.1f} ms  {gbps(group):6.2f} GB/s   "
            f"ratio {big['raw'] / group:.2f}x raw, {big['rudra'] / group:.2f}x one server (slowest shard's update {update * 1e3:.1f} ms)"
        )
    small = measure(args.small_floats, args.small_reps, polled_raw=polling.window() > 0)
    print(f"small message ({4 * args.small_floats} B each way), median of {args.small_reps}")
    print(f"  raw uvloop socket baseline : {small['raw'] * 1e6:8.1f} us")
    print(f"  rudra-async push+pull      : {small['rudra'] * 1e6:8.1f} us   ratio {small['raw'] / small['rudra']:.2f}x")
    print(
        f"  the same, SyncClient       : {small['blocking'] * 1e6:8.1f} us   ratio {small['raw'] / small['blocking']:.2f}x"
        "   (the blocking client a learner's DistributedOptimizer uses)"
    )
    if small["raw_polled"] is not None:  # what the raw socket does with the same busy polling, for context
        print(
            f"  raw socket, busy-polling as rudra-async does ({polling.window() * 1e6:g} us window): "
            f"{small['raw_polled'] * 1e6:8.1f} us   ratio {small['raw_polled'] / small['rudra']:.2f}x"
        )


if __name__ == "__main__":
    main()

"""Each transport's push+pull throughput next to its physical baseline, in one run.

For 1 MB, 16 MB and 100 MB bodies, a frame goes to an echo peer in another process and
comes back (2 × SIZE bytes per round trip) through the transport API:

- tcp  vs a raw uvloop socket echo of the same bytes (target ≥ 0.8×)
- shm  vs memcpy of the same bytes, twice (the copies a round trip needs; target ≥ 0.7×)
- ucx  vs raw ucxx send/recv of the same bytes (target ≥ 0.8×)
- any other registered scheme (a plugin's, e.g. ``--only unix``) vs the raw uvloop TCP socket

then the small-message (256 B) round-trip latency of each, next to the same baseline.

For shm it also prints where the round trip's time goes beside memcpy x2 in one process:
the same two copies made as the transport makes them, the first by this process into
shared memory and the second by another process from that segment into its own, each
copy timed by the process that makes it (no notification in the figure); and beside its
small round trip, what a notification costs at the least between two processes on two
CPUs: a Unix-socket ping-pong of the same bytes (the socket the transport notifies
through), each side blocked in ``recv`` or spinning; an eventfd ping-pong, both sides
blocked, and a counter in shared memory whose waiters sleep in ``futex(2)`` (the two
doorbells without a socket an shm transport could use); and a counter in shared memory that both spin on
(the floor of any notification path).

    python benchmarks/transports.py [--reps 10] [--only tcp,shm,ucx]

Each size runs ``--reps`` round trips or enough to move ``MIN_BYTES``, whichever is more.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import multiprocessing as mp
import os
import platform
import signal
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tcp_roundtrip import _serve_raw, raw_round_trips

from rudra_async import transports
from rudra_async.transports.shm.segments import _Attached
from rudra_async.wire import MsgType

SIZES = [1_000_000, 16_000_000, 100_000_000]
SMALL = 256
#: bytes each size's round trips move at least: 10 round trips of 1 MB are over in ~3 ms, too
#: few for a median on a shared host (they gave 0.19x where 2,000 gave 0.38x), so small sizes run more
MIN_BYTES = 4_000_000_000


def reps_for(nbytes: int, reps: int) -> int:
    """Round trips to time for a body of ``nbytes``: ``reps``, or more for a small body."""
    return max(reps, MIN_BYTES // (2 * nbytes))


def _serve_echo(url: str, q) -> None:
    async def echo(conn):
        while True:
            try:
                f = await conn.recv()
            except Exception:
                return
            await conn.send(f.msg_type, {}, f.arrays)
            f.release()

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        listener = await transports.listen(url, echo)
        q.put(listener.address)
        await stop.wait()
        await listener.close()  # closes its connections: their shm segments are unlinked here

    uvloop.run(main())


def _serve_raw_ucx(nbytes: int, q) -> None:
    import ucxx

    ucxx.init(progress_mode="blocking")

    async def handler(ep):
        buf = np.empty(nbytes, np.uint8)
        try:
            while True:
                await ep.recv(buf)
                await ep.send(buf)
        except Exception:
            return

    async def main():
        lf = ucxx.create_listener(handler, 0)
        q.put(lf.port)
        await asyncio.sleep(3600)

    uvloop.run(main())


async def transport_round_trips(address: str, nbytes: int, reps: int) -> list[float]:
    conn = await transports.connect(address)
    arr = np.ones(nbytes // 4, np.float32)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        await conn.send(MsgType.PUSH, {}, [arr])
        f = await conn.recv()
        f.release()
        times.append(time.perf_counter() - t)
    conn.close()
    return times[1:]


async def raw_ucx_round_trips(port: int, nbytes: int, reps: int) -> list[float]:
    import ucxx

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    out, back = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        await ep.send(out)
        await ep.recv(back)
        times.append(time.perf_counter() - t)
    ep.abort()
    return times[1:]


def memcpy_round_trips(nbytes: int, reps: int) -> list[float]:
    a, b, c = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(b, a)
        np.copyto(c, b)
        times.append(time.perf_counter() - t)
    return times[1:]


def _copy_on_request(nbytes: int, names: tuple[str, str], pipe) -> None:
    """The echo's copy of the two-process baseline: on each request, copy segment 1 into
    segment 2 and answer with the seconds it took."""
    segments = [_Attached(name, os.getuid()) for name in names]  # as the transport attaches: no resource tracker
    src, dst = (np.frombuffer(s.buf, np.uint8, nbytes) for s in segments)
    while pipe.recv():
        t = time.perf_counter()
        np.copyto(dst, src)
        pipe.send(time.perf_counter() - t)


def two_process_copies(nbytes: int, reps: int) -> list[float]:
    """Seconds of the two copies of a shm round trip, each made by its own process: this one
    copies a private array into segment 1, another copies segment 1 into segment 2."""
    segments = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_copy_on_request, args=(nbytes, tuple(s.name for s in segments), there), daemon=True)
    child.start()
    src, dst = np.ones(nbytes, np.uint8), np.ndarray(nbytes, np.uint8, segments[0].buf)
    times = []
    try:
        for _ in range(reps + 1):
            t = time.perf_counter()
            np.copyto(dst, src)
            mine = time.perf_counter() - t
            here.send(True)
            times.append(mine + here.recv())
        here.send(False)
        child.join(10)
    finally:
        del dst
        for s in segments:
            s.close()
            s.unlink()
    return times[1:]


def _receive(sock: socket.socket, buf: bytearray, spin: bool) -> int:
    """Fill ``buf`` from ``sock``: blocking (the process sleeps until bytes come) or spinning
    on non-blocking reads; 0 at the end of the stream."""
    got = 0
    while got < len(buf):
        try:
            n = sock.recv_into(memoryview(buf)[got:], 0, socket.MSG_DONTWAIT if spin else 0)
        except BlockingIOError:
            continue
        if not n:
            return 0
        got += n
    return got


def _pin(cpu: int | None) -> None:
    """Run this process on ``cpu`` alone (None: wherever it may)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


@contextlib.contextmanager
def _on_two_cpus(target, *args) -> Iterator[None]:
    """Run ``target(*args, cpu)`` in another process pinned to one CPU while this one runs
    pinned to another (when there are two); at the end, this process may run anywhere it
    could before, and the other is joined (the block must have told it to stop)."""
    mask = os.sched_getaffinity(0)
    pair = sorted(mask)[:2] if len(mask) >= 2 else [None, None]
    child = mp.get_context("spawn").Process(target=target, args=(*args, pair[1]), daemon=True)
    child.start()
    _pin(pair[0])
    try:
        yield
    finally:
        os.sched_setaffinity(0, mask)
        child.join(10)


def _echo_socket(sock: socket.socket, spin: bool, cpu: int | None) -> None:
    """The peer of :func:`socket_ping_pong`: send back what arrives, until the end of the stream."""
    _pin(cpu)
    buf = bytearray(SMALL)
    while _receive(sock, buf, spin):
        sock.sendall(buf)


def socket_ping_pong(reps: int, spin: bool) -> list[float]:
    """Seconds per round trip of SMALL bytes over a Unix socket between two processes on two
    CPUs, each waiting blocked or spinning: what a notification over the transport's socket
    costs at the least."""
    here, there = socket.socketpair()
    msg, buf, times = bytes(SMALL), bytearray(SMALL), []
    with _on_two_cpus(_echo_socket, there, spin):
        there.close()
        try:
            for _ in range(reps + 1):
                t = time.perf_counter()
                here.sendall(msg)
                _receive(here, buf, spin)
                times.append(time.perf_counter() - t)
        finally:
            here.close()  # the end of the stream: the echo stops
    return times[1:]


#: an eventfd value that tells :func:`_echo_eventfd` to stop (a ping adds 1)
EVENTFD_STOP = 1 << 40


def _echo_eventfd(sock: socket.socket, cpu: int | None) -> None:
    """The peer of :func:`eventfd_ping_pong`: takes two eventfds over ``sock``, then answers
    each ping on the first with a pong on the second (both blocked in ``read``)."""
    _pin(cpu)
    _, (ping, pong), _, _ = socket.recv_fds(sock, 1, 2)
    while os.eventfd_read(ping) < EVENTFD_STOP:
        os.eventfd_write(pong, 1)
    os.close(ping)
    os.close(pong)


def eventfd_ping_pong(reps: int) -> list[float]:
    """Seconds per round trip of an eventfd ping and pong between two processes on two CPUs,
    each blocked in ``read`` between: what a kernel wake-up without a socket (the eventfd
    doorbell an shm transport could use) costs at the least."""
    here, there = socket.socketpair()
    ping, pong = os.eventfd(0), os.eventfd(0)
    times = []
    try:
        with _on_two_cpus(_echo_eventfd, there):
            there.close()
            socket.send_fds(here, [b"x"], [ping, pong])
            try:
                for _ in range(reps + 1):
                    t = time.perf_counter()
                    os.eventfd_write(ping, 1)
                    os.eventfd_read(pong)
                    times.append(time.perf_counter() - t)
            finally:
                os.eventfd_write(ping, EVENTFD_STOP)  # the echo stops
    finally:
        here.close()
        os.close(ping)
        os.close(pong)
    return times[1:]


#: futex(2)'s system call number, where this benchmark knows it
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """Two 32-bit words of a shared-memory block, and ``futex(2)`` on them (shared, not private)."""

    def __init__(self, buf) -> None:
        self.words = np.ndarray((2,), np.int32, buf)
        self._base = self.words.ctypes.data
        self._syscall = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).syscall
        self._syscall.restype = ctypes.c_long

    def wait(self, i: int, expected: int) -> None:
        """Sleep while word ``i`` holds ``expected``, until a wake-up or for 1 s at most."""
        timeout = _Timespec(1, 0)
        where = ctypes.c_void_p(self._base + 4 * i)
        self._syscall(SYS_FUTEX, where, FUTEX_WAIT, expected, ctypes.byref(timeout), None, 0)

    def wake(self, i: int) -> None:
        self._syscall(SYS_FUTEX, ctypes.c_void_p(self._base + 4 * i), FUTEX_WAKE, 1, None, None, 0)


def _echo_words(name: str, sleep: bool, cpu: int | None) -> None:
    """The peer of :func:`word_ping_pong`: copy word 0 into word 1 each time it changes,
    spinning or (``sleep``) asleep in ``futex(2)`` between; stop at -1, or after 10 s
    without a change."""
    _pin(cpu)
    shm = _Attached(name, os.getuid())
    futex = _Futex(shm.buf)
    seen, since = 0, time.monotonic()
    while seen >= 0 and time.monotonic() - since < 10:
        now = int(futex.words[0])
        if now == seen:
            if sleep:
                futex.wait(0, seen)
            continue
        seen, since = now, time.monotonic()
        futex.words[1] = now
        if sleep:
            futex.wake(1)
    del futex
    shm.close()


def word_ping_pong(reps: int, sleep: bool) -> list[float]:
    """Seconds per round trip of a counter in shared memory between two processes on two
    CPUs, both spinning on it (no system call: the floor of any notification path) or
    (``sleep``) asleep in ``futex(2)`` until it changes (the futex-like doorbell an shm
    transport could use, at its least)."""
    segment = shared_memory.SharedMemory(create=True, size=8)
    futex = _Futex(segment.buf)
    futex.words[:] = 0
    times = []
    try:
        with _on_two_cpus(_echo_words, segment.name, sleep):
            try:
                for i in range(1, reps + 2):
                    t, deadline = time.perf_counter(), time.monotonic() + 10
                    futex.words[0] = i
                    if sleep:
                        futex.wake(0)
                    while (answer := int(futex.words[1])) != i and time.monotonic() < deadline:
                        if sleep:
                            futex.wait(1, answer)
                    times.append(time.perf_counter() - t)
            finally:
                futex.words[0] = -1  # the echo stops
                futex.wake(0)
    finally:
        del futex
        segment.close()
        segment.unlink()
    return times[1:]


def in_process(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    return p, q.get(timeout=60)


def measure(scheme: str, nbytes: int, reps: int) -> tuple[float, float]:
    """(baseline median, transport median) seconds per round trip."""
    if scheme == "shm":
        base = statistics.median(memcpy_round_trips(nbytes, reps))
    elif scheme != "ucx":  # tcp, and any plugin's scheme: the raw loopback socket
        p, port = in_process(_serve_raw, nbytes)
        base = statistics.median(uvloop.run(raw_round_trips(port, nbytes, reps)))
        p.kill()
    else:
        p, port = in_process(_serve_raw_ucx, nbytes)
        from rudra_async_ucx import _ucxx

        _ucxx()
        base = statistics.median(uvloop.run(raw_ucx_round_trips(port, nbytes, reps)))
        p.kill()
    url = transports.transport_for(f"{scheme}://").fresh_address()  # any registered scheme, a plugin's too
    p, address = in_process(_serve_echo, url)
    ours = statistics.median(uvloop.run(transport_round_trips(address, nbytes, reps)))
    p.terminate()  # the echo closes its listener and connections, then exits
    p.join(10)
    if p.is_alive():  # stuck closing: do not leave it (or the run) hanging
        p.kill()
        p.join()
    return base, ours


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--small-reps", type=int, default=1000)
    ap.add_argument("--only", default="tcp,shm,ucx")
    args = ap.parse_args()
    baseline_name = collections.defaultdict(
        lambda: "raw uvloop socket", {"tcp": "raw uvloop socket", "shm": "memcpy x2", "ucx": "raw ucxx"}
    )
    print(
        "push+pull round trip through the transport API, echo peer in another process; median of "
        f"{args.reps} or more (at least {MIN_BYTES / 1e9:g} GB moved per size)"
    )
    for scheme in args.only.split(","):
        for n in SIZES:
            base, ours = measure(scheme, n, reps_for(n, args.reps))
            gb = lambda t: 2 * n / t / 1e9
            print(
                f"  {scheme:3} {n / 1e6:5.0f} MB: {baseline_name[scheme]:17} {gb(base):6.2f} GB/s   "
                f"{scheme} {gb(ours):6.2f} GB/s   ratio {base / ours:4.2f}x"
            )
            if scheme == "shm":
                split = statistics.median(two_process_copies(n, reps_for(n, args.reps)))
                print(
                    f"  {'':3} {'':5}    where it goes: the same copies in two processes {gb(split):6.2f} GB/s"
                    f"   ratio {split / ours:4.2f}x"
                )
    print(f"small message ({SMALL} B) round trip, median of {args.small_reps}")
    for scheme in args.only.split(","):
        base, ours = measure(scheme, SMALL, args.small_reps)
        print(f"  {scheme:3}: {baseline_name[scheme]:17} {base * 1e6:8.1f} us   {scheme} {ours * 1e6:8.1f} us")
        if scheme == "shm":  # how much of that a notification path could save
            asleep, spinning = (statistics.median(socket_ping_pong(args.small_reps, spin)) for spin in (False, True))
            counter = statistics.median(word_ping_pong(args.small_reps, sleep=False))
            doorbell = statistics.median(eventfd_ping_pong(args.small_reps))
            futex = (
                f"{statistics.median(word_ping_pong(args.small_reps, sleep=True)) * 1e6:.1f} us"
                if SYS_FUTEX
                else "not here"
            )
            print(
                f"  {'':3}  where it goes: a Unix-socket ping-pong of the same bytes between two CPUs {asleep * 1e6:.1f} us "
                f"(both spinning: {spinning * 1e6:.1f} us); both blocked, an eventfd ping-pong {doorbell * 1e6:.1f} us "
                f"and a futex one on a shared counter {futex}; a shared-memory counter ping-pong (both spinning) "
                f"{counter * 1e6:.1f} us"
            )


if __name__ == "__main__":
    main()

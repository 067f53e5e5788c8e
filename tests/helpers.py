"""Shared test helpers: a real server on a loopback port, raw frame reading."""

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

from rudra_async.client import connect
from rudra_async.config import ServerConfig
from rudra_async.errors import RemoteError
from rudra_async.layout import Layout
from rudra_async.server import ParameterServer
from rudra_async.wire import Frame, FrameReader

LOOPBACK = "tcp://127.0.0.1:0"


@contextlib.asynccontextmanager
async def run_server(secret=None, **overrides):
    """A real server on a loopback port chosen by the OS, serving in the background
    (``secret``: learners must authenticate)."""
    cfg = ServerConfig(**{"listen": [LOOPBACK], **overrides})
    async with ParameterServer(cfg, secret=secret) as ps:
        task = asyncio.create_task(ps.serve())
        try:
            yield ps
        finally:
            await ps.close()
            await task


def small_layout() -> Layout:
    return Layout.from_shapes([("w", (3, 4)), ("b", (4,))])


def initial_weights(layout: Layout, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(layout.size).astype(np.float32)


async def read_frame(reader: asyncio.StreamReader, timeout: float = 5.0) -> Frame:
    """Read one frame from a raw stream (for tests that speak bytes to the server)."""
    fr = FrameReader()
    while True:
        buf = fr.get_buffer()
        data = await asyncio.wait_for(reader.read(len(buf)), timeout)
        if not data:
            raise EOFError("server closed the connection")
        buf[: len(data)] = data
        frames = fr.advance(len(data))
        if frames:
            return frames[0]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


CLI_ARGS = [sys.executable, "-m", "rudra_async"]  # the rudra-async command of this interpreter


def run_cli(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``rudra-async ARGS`` to its end; text output captured (``env`` adds variables)."""
    return subprocess.run(
        [*CLI_ARGS, *args], capture_output=True, text=True, timeout=timeout, env={**subprocess_env(), **(env or {})}
    )


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``rudra-async ARGS`` in the background, text stdout and stderr piped."""
    return subprocess.Popen(
        [*CLI_ARGS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**subprocess_env(), **(env or {})},
    )


def start_server(port: int, *args: str) -> subprocess.Popen:
    """``rudra-async server`` on tcp://127.0.0.1:PORT, returned once it accepts connections."""
    proc = start_cli("server", "--listen", f"tcp://127.0.0.1:{port}", *args)
    wait_listening(port)
    return proc


def reap(*procs) -> None:
    """Kill whichever of these processes still run (a test's cleanup), and collect them."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.communicate()


def last_json(text: str) -> dict:
    """The JSON object on the last line of a command's output."""
    return json.loads(text.strip().splitlines()[-1])


async def push_sequence(url: str, layout: Layout, grads, initial=None):
    """One learner (one server, or a shard group's comma-separated URLs) pushing ``grads`` in
    order, each on the newest weights (σ = 0). Returns (final weights, every stamp seen)."""
    client = await connect(url, layout, initial)
    w = await client.pull()
    stamps = [w.timestamp]
    for g in grads:
        w = await client.push_pull(g, w.timestamp)
        stamps.append(w.timestamp)
    await client.close()
    return w.array.copy(), stamps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports free now, below the kernel's range
    of ephemeral ports (which outgoing connections take from: a port next to one the OS just
    gave out is soon taken)."""
    import random

    for _ in range(1000):
        first = random.randrange(20000, 32000 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def wait_listening(port: int, timeout: float = 30.0) -> None:
    """Return once something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def sgd_reference(w0, batches, lr, momentum, weight_decay, nesterov):
    """torch.optim.SGD on the combined gradient Σ s·g of each batch; yields weights after each step."""
    import torch

    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    for grads, scales in batches:
        p.grad = torch.from_numpy(sum(np.float32(s) * g.astype(np.float32) for s, g in zip(scales, grads)))
        opt.step()
        yield p.detach().numpy().copy()


def random_batches(size, steps, c, dtype=np.float32, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        grads = [rng.standard_normal(size).astype(dtype) for _ in range(c)]
        yield grads, list(rng.uniform(0.1, 1.0, c) / c)


@contextlib.contextmanager
def server_thread(**overrides):
    """A real server on a loopback port, its event loop in a background thread, for blocking
    clients (the PyTorch API) in the test's own thread. Yields the server; closed on exit."""
    import threading

    from rudra_async.eventloop import run

    box, ready = {}, threading.Event()

    async def main():
        cfg = ServerConfig(**{"listen": [LOOPBACK], **overrides})
        async with ParameterServer(cfg) as ps:
            box["ps"], box["loop"] = ps, asyncio.get_running_loop()
            ready.set()
            await ps.serve()

    def target():
        try:
            run(main())
        finally:
            ready.set()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    ready.wait(30)
    if "ps" not in box:
        raise RuntimeError("the server thread did not start")
    try:
        yield box["ps"]
    finally:
        box["loop"].call_soon_threadsafe(box["ps"].request_close)
        thread.join(30)


def write_cifar_batch(path, n: int, seed: int) -> None:
    """A CIFAR-10 python-pickle batch of ``n`` random images (the format of the real files)."""
    import pickle

    rng = np.random.default_rng(seed)
    batch = {
        b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
        b"labels": list(rng.integers(0, 10, n)),
        b"batch_label": b"test",
    }
    with open(path, "wb") as fh:
        pickle.dump(batch, fh)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``, or its peak ``VmHWM``) in MB, from /proc."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


async def http_get(url: str, method: str = "GET", timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one plain HTTP request, on the running event loop."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(f"{method} {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode())
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


async def numpy_learner(url, layout, initial, steps=None, delay=0.0, name=None, seed=0):
    """A numpy learner pushing small random gradients (with pauses of up to ``delay`` s) until
    ``steps`` or the server's stop; returns its connected client (the caller closes it)."""
    client = await connect(url, layout, initial, name=name)
    rng = np.random.default_rng(seed)
    w = await client.pull()
    step = 0
    while not w.stop and (steps is None or step < steps):
        grad = (0.01 * rng.standard_normal(layout.size)).astype(np.float32)
        try:
            w = await client.push_pull(grad, w.timestamp, step, samples=8, loss=2.0 / (1 + 0.01 * step))
        except RemoteError as exc:
            if exc.code == "stopped":  # the run ended while this gradient was computed
                break
            raise
        step += 1
        if delay:
            await asyncio.sleep(delay * rng.random())
    return client


def make_pki(d, address: str = "127.0.0.1") -> dict[str, str]:
    """In directory ``d``: a throw-away CA, a server/client certificate for ``address`` (and
    localhost) signed by it, an expired one, and an unrelated CA (openssl on the PATH).
    Returns their paths by file name."""

    def openssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}")
    (d / "ext").write_text(f"subjectAltName=IP:{address},DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    openssl("req", *ec, "-keyout", "host.key", "-out", "host.csr", "-subj", "/CN=host")
    sign = [
        "x509",
        "-req",
        "-in",
        "host.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-extfile",
        "ext",
    ]
    openssl(*sign, "-out", "host.pem", "-days", "2")
    openssl(*sign, "-out", "expired.pem", "-days", "-1")
    return {name: str(d / name) for name in ("ca.pem", "other-ca.pem", "host.pem", "host.key", "expired.pem")}

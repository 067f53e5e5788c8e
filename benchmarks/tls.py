"""The cost of TLS: a 100 MB push+pull round trip over tcp with and without TLS, in one run.

Two server processes (numpy kernel, momentum 0, so the update is the same cheap pass in
both) on loopback, one with a throw-away certificate (made with openssl), one without; one
learner times push_pull of a SIZE-byte gradient against each, alternating.

    python benchmarks/tls.py [--mb 100] [--reps 8]

Prints the median round trip and throughput of each, and the ratio TLS/plain.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import numpy as np
from tcp_roundtrip import rudra_round_trips  # benchmarks/tcp_roundtrip.py (the script's directory is on sys.path)

from rudra_async import security
from rudra_async.config import ServerConfig
from rudra_async.eventloop import run
from rudra_async.server import ParameterServer


def make_certificate(directory: Path) -> tuple[str, str]:
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "key.pem"]
    cert = ["-out", "cert.pem", "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(
        ["openssl", "req", "-x509", *key, *cert],
        cwd=directory,
        check=True,
        capture_output=True,
    )
    return str(directory / "cert.pem"), str(directory / "key.pem")


def serve(cfg: ServerConfig, queue: mp.Queue) -> None:
    async def main() -> None:
        async with ParameterServer(cfg) as ps:
            queue.put(ps.addresses[0])
            await ps.serve()

    run(main())


def round_trips(url: str, size: int, reps: int, **options: Any) -> Coroutine[Any, Any, list[float]]:
    """Seconds per push+pull of a ``size``-byte gradient to a server started without weights."""
    floats = size // 4
    return rudra_round_trips(url, floats, reps, np.zeros(floats, np.float32), timeout=60, **options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    size = args.mb * 1_000_000 // 4 * 4
    with tempfile.TemporaryDirectory() as d:
        cert, key = make_certificate(Path(d))
        base = dict(listen=["tcp://127.0.0.1:0"], kernel="numpy", momentum=0.0)
        ctx = mp.get_context("spawn")
        queue: mp.Queue = ctx.Queue()
        procs = [
            ctx.Process(target=serve, args=(ServerConfig(**base), queue), daemon=True),
            ctx.Process(target=serve, args=(ServerConfig(**base, tls_cert=cert, tls_key=key), queue), daemon=True),
        ]
        procs[0].start()
        plain_url = queue.get(timeout=60)
        procs[1].start()
        tls_url = queue.get(timeout=60)
        client_tls = security.client_tls(cert)
        plain: list[float] = []
        tls: list[float] = []
        for _ in range(2):  # alternate, so both see the same machine load
            plain += run(round_trips(plain_url, size, args.reps // 2))
            tls += run(round_trips(tls_url, size, args.reps // 2, tls=client_tls))
        for p in procs:
            p.terminate()
    moved = 2 * size / 1e6  # MB up and down
    p_med, t_med = statistics.median(plain), statistics.median(tls)
    print(f"{args.mb} MB push+pull over tcp, median of {len(plain)}:")
    print(f"  plain  {p_med * 1e3:8.1f} ms  {moved / p_med:8.0f} MB/s")
    print(f"  TLS    {t_med * 1e3:8.1f} ms  {moved / t_med:8.0f} MB/s")
    print(f"  TLS/plain throughput: {p_med / t_med:.2f}")


if __name__ == "__main__":
    main()

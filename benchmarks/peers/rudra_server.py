"""The rudra-async server process of the peer benchmark, without torch.

A ``rudra-async server`` never imports torch, so neither does this process: its peak RSS
is the server's own, as MXNet's server process holds only MXNet (importing torch would
add about 200 MB that no user's server pays). ``python -c 'from
benchmarks.peers.rudra_server import main; main()' SPEC_JSON`` serves one point until the
driver stops it, after printing ``ADDRESS <url>``.
"""

from __future__ import annotations

import asyncio
import os
import sys

from benchmarks.peers.common import LR, MOMENTUM, TRAIN_LR, Spec, apply_single_thread_env

apply_single_thread_env()

from rudra_async.config import ServerConfig  # noqa: E402  (after the thread settings)
from rudra_async.eventloop import run  # noqa: E402
from rudra_async.server import ParameterServer  # noqa: E402

#: the server's update kernel (``--kernel``), set by the driver's ``--server-kernel``
KERNEL_ENV = "RUDRA_BENCH_SERVER_KERNEL"
#: the server's ``--gradient-buffers``, set by the driver's ``--server-gradient-buffers``
GRADIENT_BUFFERS_ENV = "RUDRA_BENCH_SERVER_GRADIENT_BUFFERS"


def serve(spec: Spec) -> None:
    buffers = os.environ.get(GRADIENT_BUFFERS_ENV)
    cfg = ServerConfig(
        listen=[spec.address],
        protocol=spec.mode,
        n=spec.n if spec.mode == "softsync" else None,
        lr=LR if spec.workload in ("a0", "small") else TRAIN_LR,
        momentum=MOMENTUM,
        kernel=os.environ.get(KERNEL_ENV, "auto"),
        **({"gradient_buffers": int(buffers)} if buffers else {}),  # unset: ServerConfig's default
    )

    async def until_killed() -> None:
        async with ParameterServer(cfg) as ps:
            print("ADDRESS", ps.addresses[0], flush=True)
            while True:  # until the driver kills this process
                await asyncio.sleep(3600)

    run(until_killed())


def main() -> None:
    serve(Spec.from_json(sys.argv[1]))

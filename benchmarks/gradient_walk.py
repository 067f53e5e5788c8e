"""One gradient's walk, counted: the Python functions of rudra_async that one
``DistributedOptimizer.step`` passes through, on the learner and on the server, traced with
``sys.setprofile`` (docs/architecture.md, "One gradient, hop by hop").

The default route of that walk: protocol ``async`` over ``shm://``, the torch kernel, a
model of 20,100 float32 (``nn.Linear(200, 100)``; ``--width``), no secret (``--listen``). The server runs on its own
event loop in a thread of this process; after ``--warmup`` steps, one step is traced on
both sides. Printed per side: function entries (a generator or coroutine resumed counts
again), distinct functions, files, and with ``--list`` each distinct function in order of
first entry. Run it on two commits to compare them by one method::

    python benchmarks/gradient_walk.py --list
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import rudra_async
from rudra_async import eventloop
from rudra_async.config import ServerConfig
from rudra_async.server import ParameterServer
from rudra_async.torch import DistributedOptimizer

PACKAGE = str(Path(rudra_async.__file__).resolve().parent)
#: the server's periodic work, not a gradient's
IGNORED = ("_watch", "newly_slow", "evict_hung")


class Trace:
    """The rudra_async functions entered on one thread while it is on."""

    def __init__(self) -> None:
        self.entries: list[str] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(PACKAGE) and code.co_name not in IGNORED:
            where = os.path.relpath(code.co_filename, PACKAGE)
            self.entries.append(f"{where}:{getattr(code, 'co_qualname', code.co_name)}")

    def summary(self) -> dict[str, Any]:
        distinct = list(dict.fromkeys(self.entries))
        return {
            "entries": len(self.entries),
            "functions": len(distinct),
            "files": len({d.partition(":")[0] for d in distinct}),
            "order": distinct,
        }


def serve(ready: threading.Event, holder: dict[str, Any], listen: str) -> None:
    async def main() -> None:
        config = ServerConfig(listen=[listen], protocol="async", kernel="torch", lr=0.01, momentum=0.9)
        async with ParameterServer(config) as ps:
            holder["ps"], holder["loop"] = ps, asyncio.get_running_loop()
            ready.set()
            await ps.serve()

    eventloop.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--list", action="store_true", help="print each side's functions in order")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--listen", default="shm://", help="the server's address (default shm://)")
    parser.add_argument("--width", type=int, default=200, help="the model: nn.Linear(width, width // 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ready, holder = threading.Event(), {}
    server = threading.Thread(target=serve, args=(ready, holder, args.listen), daemon=True)
    server.start()
    if not ready.wait(30):
        sys.exit("the server did not start")
    ps, loop = holder["ps"], holder["loop"]
    torch.manual_seed(0)
    model = nn.Linear(args.width, args.width // 2)
    opt = DistributedOptimizer(model, ps.addresses[0], torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    x, y = torch.randn(16, args.width), torch.randn(16, args.width // 2)

    def step() -> None:
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step(loss=loss, samples=16)

    for _ in range(args.warmup):
        step()
    time.sleep(0.2)
    learner, server_side = Trace(), Trace()
    started = threading.Event()
    loop.call_soon_threadsafe(lambda: (sys.setprofile(server_side), started.set()))
    started.wait(5)
    sys.setprofile(learner)
    step()
    sys.setprofile(None)
    time.sleep(0.1)  # the server's last hops: the learner's release of the weights
    stopped = threading.Event()
    loop.call_soon_threadsafe(lambda: (sys.setprofile(None), stopped.set()))
    stopped.wait(5)
    opt.close()
    loop.call_soon_threadsafe(ps.request_close)
    server.join(30)
    result = {"learner": learner.summary(), "server": server_side.summary()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for side, s in result.items():
        print(f"{side}: {s['entries']} function entries, {s['functions']} distinct functions, {s['files']} files")
        if args.list:
            for name in s["order"]:
                print("   ", name)


if __name__ == "__main__":
    main()

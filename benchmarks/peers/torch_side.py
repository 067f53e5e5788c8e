"""The processes of the peer benchmark that run in rudra-async's own environment (torch).

``python -c 'from benchmarks.peers.torch_side import main; main()' SPEC_JSON`` runs one
process of one point: a rudra-async server or learner, a DDP rank, a ``torch.distributed.rpc``
parameter server or trainer, or the single-process reference loop. Each learner reports its
steps on the board (:mod:`benchmarks.peers.common`) and runs until the driver stops it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from benchmarks.peers.common import (
    BATCH,
    LR,
    MOMENTUM,
    TRAIN_LR,
    Recorder,
    Spec,
    apply_single_thread_env,
    mlp_sizes,
    params_of,
)

apply_single_thread_env()

import numpy as np  # noqa: E402  (after the thread settings)
import torch  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
try:
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass


# -- the training workloads -------------------------------------------------------------------
def build_model(workload: str, tiny: bool) -> nn.Module:
    """(a) the MLP 1024-4096-4096-1024; (b) the CNN on 3×32×32 images. Same seed in every process."""
    torch.manual_seed(0)
    if workload == "a":
        s = mlp_sizes(tiny)
        return nn.Sequential(nn.Linear(s[0], s[1]), nn.ReLU(), nn.Linear(s[1], s[2]), nn.ReLU(), nn.Linear(s[2], s[3]))
    c1, c2, hidden = (4, 8, 16) if tiny else (32, 64, 128)
    side = 8 if tiny else 32
    return nn.Sequential(
        nn.Conv2d(3, c1, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * (side // 4) ** 2, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


class Batches:
    """A few synthetic mini-batches, generated once and cycled (no data loading in the loop)."""

    def __init__(self, workload: str, tiny: bool, seed: int, count: int = 4) -> None:
        g = torch.Generator().manual_seed(1000 + seed)
        b = BATCH[workload]
        if workload == "a":
            s = mlp_sizes(tiny)
            self.data = [(torch.randn(b, s[0], generator=g), torch.randn(b, s[-1], generator=g)) for _ in range(count)]
            self.loss = nn.functional.mse_loss
        else:
            side = 8 if tiny else 32
            self.data = [
                (torch.randn(b, 3, side, side, generator=g), torch.randint(0, 10, (b,), generator=g))
                for _ in range(count)
            ]
            self.loss = nn.functional.cross_entropy
        self.i = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.i += 1
        return self.data[self.i % len(self.data)]


# -- rudra-async ------------------------------------------------------------------------------
def rudra_learner(spec: Spec, rec: Recorder) -> None:
    if spec.workload in ("a0", "small"):
        from rudra_async.client import SyncClient
        from rudra_async.layout import Layout

        n = params_of(spec.workload, spec.tiny)
        grad = np.full(n, 1e-3, np.float32)
        client = SyncClient(spec.address, Layout.from_shapes([("w", (n,))]), np.zeros(n, np.float32))
        w = client.pull()
        while not rec.stopped:
            t = time.perf_counter()
            w = client.push_pull(grad, w.timestamp, rec.n, 1)
            rec.step(time.perf_counter() - t)
        client.close()
        return
    from rudra_async.torch import DistributedOptimizer

    model, data = build_model(spec.workload, spec.tiny), Batches(spec.workload, spec.tiny, spec.rank)
    with DistributedOptimizer(model, spec.address, overlap=spec.overlap) as opt:  # what a user's script does
        while not rec.stopped:
            x, y = data.next()
            opt.zero_grad()
            data.loss(model(x), y).backward()
            t = time.perf_counter()
            opt.step(samples=len(x))  # push the gradient, pull the next weights into the model
            rec.step(time.perf_counter() - t)


# -- the single-process reference ---------------------------------------------------------------
def reference(spec: Spec, rec: Recorder) -> None:
    """torch.optim.SGD(fused=True) on the same model and batches, in one process: the compute limit."""
    model, data = build_model(spec.workload, spec.tiny), Batches(spec.workload, spec.tiny, 0)
    opt = torch.optim.SGD(model.parameters(), lr=TRAIN_LR, momentum=MOMENTUM, fused=True)
    while not rec.stopped:
        x, y = data.next()
        opt.zero_grad()
        data.loss(model(x), y).backward()
        opt.step()
        rec.step()


# -- DDP over gloo -------------------------------------------------------------------------------
def ddp_learner(spec: Spec, rec: Recorder) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{spec.address}", rank=spec.rank, world_size=spec.learners)
    if spec.workload in ("a0", "small"):
        # no compute: all-reduce a fixed gradient and apply it, what one DDP update moves and does
        n = params_of(spec.workload, spec.tiny)
        p = nn.Parameter(torch.zeros(n))
        opt = torch.optim.SGD([p], lr=LR, momentum=MOMENTUM, fused=True)
        grad, buf = torch.full((n,), 1e-3), torch.empty(n)
        p.grad = buf
        while not rec.stopped:
            t = time.perf_counter()
            buf.copy_(grad)
            dist.all_reduce(buf)
            buf.div_(spec.learners)
            opt.step()
            rec.step(time.perf_counter() - t)
        return
    from torch.nn.parallel import DistributedDataParallel

    model, data = build_model(spec.workload, spec.tiny), Batches(spec.workload, spec.tiny, spec.rank)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=TRAIN_LR, momentum=MOMENTUM, fused=True)
    while not rec.stopped:
        x, y = data.next()
        opt.zero_grad()
        data.loss(ddp(x), y).backward()  # the all-reduce overlaps the backward pass
        opt.step()
        rec.step()


# -- torch.distributed.rpc parameter server (PyTorch's batch-update PS tutorial) ----------------
class RpcParameterServer:
    """The server of PyTorch's "Batch-Updating Parameter Server" tutorial: it holds the model
    and an SGD optimizer; ``update_and_fetch`` adds a trainer's gradients and, once
    ``batch_update_size`` have arrived (1: every push, asynchronous; λ: synchronous), steps the
    optimizer and answers every waiting trainer with the new weights."""

    def __init__(self, params: list[nn.Parameter], lr: float, batch_update_size: int) -> None:
        self.params = params
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
        self.batch_update_size = batch_update_size
        self.count = 0
        self.lock = threading.Lock()
        self.future: torch.futures.Future = torch.futures.Future()

    def weights(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]


_PS: RpcParameterServer | None = None


def rpc_get_weights() -> list[torch.Tensor]:
    assert _PS is not None
    return _PS.weights()


@torch.distributed.rpc.functions.async_execution
def rpc_update_and_fetch(grads: list[torch.Tensor]) -> torch.futures.Future:
    ps = _PS
    assert ps is not None
    with ps.lock:
        for p, g in zip(ps.params, grads):
            p.grad += g
        ps.count += 1
        fut = ps.future
        if ps.count >= ps.batch_update_size:
            for p in ps.params:
                p.grad /= ps.batch_update_size
            ps.optimizer.step()
            ps.optimizer.zero_grad(set_to_none=False)
            ps.count = 0
            fut.set_result(ps.weights())
            ps.future = torch.futures.Future()
    return fut


def _rpc_init(spec: Spec, name: str, rank: int) -> None:
    from torch.distributed import rpc

    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{spec.address}", rpc_timeout=120)
    rpc.init_rpc(name, rank=rank, world_size=spec.learners + 1, rpc_backend_options=options)


def rpc_server(spec: Spec) -> None:
    global _PS
    if spec.workload in ("a0", "small"):
        params = [nn.Parameter(torch.zeros(params_of(spec.workload, spec.tiny)))]
        lr = LR
    else:
        params, lr = list(build_model(spec.workload, spec.tiny).parameters()), TRAIN_LR
    _PS = RpcParameterServer(params, lr, spec.learners if spec.mode == "sync" else 1)
    _rpc_init(spec, "ps", 0)
    print("READY", flush=True)
    while True:  # until the driver kills this process
        time.sleep(3600)


def rpc_learner(spec: Spec, rec: Recorder) -> None:
    from torch.distributed import rpc

    _rpc_init(spec, f"trainer{spec.rank}", spec.rank + 1)
    if spec.workload in ("a0", "small"):
        grads = [torch.full((params_of(spec.workload, spec.tiny),), 1e-3)]
        rpc.rpc_sync("ps", rpc_get_weights)
        while not rec.stopped:
            t = time.perf_counter()
            rpc.rpc_sync("ps", rpc_update_and_fetch, args=(grads,))
            rec.step(time.perf_counter() - t)
        return
    model, data = build_model(spec.workload, spec.tiny), Batches(spec.workload, spec.tiny, spec.rank)
    params = list(model.parameters())

    def load(weights: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)

    load(rpc.rpc_sync("ps", rpc_get_weights))
    while not rec.stopped:
        x, y = data.next()
        model.zero_grad(set_to_none=False)
        data.loss(model(x), y).backward()
        t = time.perf_counter()
        weights = rpc.rpc_sync("ps", rpc_update_and_fetch, args=([p.grad for p in params],))
        load(weights)
        rec.step(time.perf_counter() - t)


ROLES: dict[tuple[str, str], Callable[..., None]] = {
    ("rudra", "learner"): rudra_learner,
    ("ddp", "learner"): ddp_learner,
    ("rpc", "server"): rpc_server,
    ("rpc", "learner"): rpc_learner,
    ("reference", "learner"): reference,
}


def main() -> None:
    spec = Spec.from_json(sys.argv[1])
    fn = ROLES[spec.system.split(":")[0], spec.role]
    if spec.role == "server":
        fn(spec)
    else:
        fn(spec, Recorder(spec))

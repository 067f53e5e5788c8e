"""An MXNet kvstore worker of the peer benchmark, run by the MXNet environment's python.

``MXNET_VENV/bin/python benchmarks/peers/mxnet_side.py SPEC_JSON`` with the ``DMLC_*``
variables set (see the driver's docstring). It imports neither torch nor rudra_async: only
mxnet, numpy and ``common.py`` beside it. Scheduler and server processes need no script:
``import mxnet`` with ``DMLC_ROLE=scheduler|server`` runs them until the job ends.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BATCH, LR, MOMENTUM, TRAIN_LR, Recorder, Spec, apply_single_thread_env, mlp_sizes, params_of

apply_single_thread_env()

import mxnet as mx  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402


def build_model(workload: str, tiny: bool) -> gluon.HybridBlock:
    """The same architectures as the torch side (Gluon's default initialisation)."""
    mx.random.seed(0)
    net = gluon.nn.HybridSequential()
    if workload == "a":
        s = mlp_sizes(tiny)
        net.add(
            gluon.nn.Dense(s[1], activation="relu", in_units=s[0]),
            gluon.nn.Dense(s[2], activation="relu", in_units=s[1]),
            gluon.nn.Dense(s[3], in_units=s[2]),
        )
    else:
        c1, c2, hidden = (4, 8, 16) if tiny else (32, 64, 128)
        side = 8 if tiny else 32
        net.add(
            gluon.nn.Conv2D(c1, 5, padding=2, in_channels=3, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Conv2D(c2, 5, padding=2, in_channels=c1, activation="relu"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(hidden, activation="relu", in_units=c2 * (side // 4) ** 2),
            gluon.nn.Dense(10, in_units=hidden),
        )
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def batches(workload: str, tiny: bool, seed: int, count: int = 4) -> list:
    mx.random.seed(1000 + seed)
    b = BATCH[workload]
    if workload == "a":
        s = mlp_sizes(tiny)
        return [(mx.nd.random.normal(shape=(b, s[0])), mx.nd.random.normal(shape=(b, s[-1]))) for _ in range(count)]
    side = 8 if tiny else 32
    return [
        (mx.nd.random.normal(shape=(b, 3, side, side)), mx.nd.random.randint(0, 10, shape=(b,)).astype("float32"))
        for _ in range(count)
    ]


def worker(spec: Spec) -> None:
    kv = mx.kv.create(spec.mode)  # dist_async | dist_sync: connects to the scheduler
    spec.rank = kv.rank  # ps-lite numbers the workers itself
    rec = Recorder(spec)
    lr = LR if spec.workload in ("a0", "small") else TRAIN_LR
    if spec.workload in ("a0", "small"):
        n = params_of(spec.workload, spec.tiny)
        grad, weights = mx.nd.full((n,), 1e-3), mx.nd.zeros((n,))
        kv.init(0, weights)  # rank 0's value; a barrier
        kv.set_optimizer(mx.optimizer.SGD(learning_rate=lr, momentum=MOMENTUM))  # runs on the server
        kv._barrier()
        while not rec.stopped:
            t = time.perf_counter()
            kv.push(0, grad)
            kv.pull(0, out=weights)
            weights.wait_to_read()
            rec.step(time.perf_counter() - t)
        return
    net = build_model(spec.workload, spec.tiny)
    data = batches(spec.workload, spec.tiny, spec.rank)
    if spec.workload == "a":
        loss_fn = lambda out, y: ((out - y) ** 2).mean()
    else:
        ce = gluon.loss.SoftmaxCrossEntropyLoss()
        loss_fn = lambda out, y: ce(out, y).mean()
    params = list(net.collect_params().values())
    x0 = data[0][0]
    net(x0).wait_to_read()  # Gluon's deferred shapes
    for i, p in enumerate(params):
        kv.init(i, p.data())
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=lr, momentum=MOMENTUM))
    kv._barrier()
    step = 0
    while not rec.stopped:
        x, y = data[step % len(data)]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        # Gluon's Trainer with update_on_kvstore: push every gradient, pull every weight,
        # earlier layers first; the engine overlaps them with the rest of the backward pass
        for i, p in enumerate(params):
            kv.push(i, p.grad(), priority=-i)
        for i, p in enumerate(params):
            kv.pull(i, out=p.data(), priority=-i)
        mx.nd.waitall()
        rec.step()
        step += 1


def reference(spec: Spec) -> None:
    """MXNet's own single-process loop on the same model (local SGD, no kvstore)."""
    rec = Recorder(spec)
    net = build_model(spec.workload, spec.tiny)
    data = batches(spec.workload, spec.tiny, 0)
    trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": TRAIN_LR, "momentum": MOMENTUM})
    ce = gluon.loss.SoftmaxCrossEntropyLoss()
    loss_fn = (lambda out, y: ((out - y) ** 2).mean()) if spec.workload == "a" else (lambda out, y: ce(out, y).mean())
    step = 0
    while not rec.stopped:
        x, y = data[step % len(data)]
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(1)
        mx.nd.waitall()
        rec.step()
        step += 1


if __name__ == "__main__":
    spec = Spec.from_json(sys.argv[1])
    (reference if spec.role == "reference" else worker)(spec)

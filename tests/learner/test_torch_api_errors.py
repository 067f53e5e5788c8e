"""The PyTorch API's errors and what it leaves behind: bad input to step(), optimizer settings
and layers the server cannot run, a refused gradient with and without overlap, the user's
--data parts, and the hooks and buffers of an optimizer that failed or closed. Real servers
on loopback, learners in the test's thread."""

import gc
import signal
import sys
import threading
import types

import numpy as np
import pytest
import torch
from helpers import free_port, server_thread
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import rudra_async.torch as rt
from rudra_async.config import LearnerConfig, LearnerOptions
from rudra_async.errors import ConnectError, LearnerError, RemoteError
from rudra_async.learner.binding import FlatParameters
from rudra_async.learner.loop import run_learner

pytestmark = pytest.mark.torch


def backward(model: nn.Module, scale: float = 1.0) -> None:
    """One backward pass of ``model`` (4 inputs, 2 classes) on a fixed batch of 8."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    (nn.functional.cross_entropy(model(x), y) * scale).backward()


def test_step_takes_numpy_and_torch_numbers_for_samples_and_loss():
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        model = nn.Linear(4, 2)
        with rt.DistributedOptimizer(model, ps.addresses[0]) as opt:
            for samples, loss in ((np.int64(8), np.float32(0.5)), (torch.tensor(4), torch.tensor([0.25]))):
                opt.zero_grad()
                backward(model)
                assert opt.step(loss=loss, samples=samples)
        stats = ps.stats()
    assert stats["samples"] == 12 and [loss for _, loss in stats["loss_curve"]] == [0.5, 0.25]


def test_bad_samples_or_loss_are_learner_errors_and_the_gradient_can_still_be_sent():
    bad = [
        ({"samples": 8.0}, "samples must be an integer, got float 8.0"),
        ({"samples": torch.tensor(8.0)}, "samples must be an integer, got Tensor"),
        ({"samples": -1}, "samples must be >= 0, got -1"),
        ({"loss": torch.ones(8)}, r"loss must be a number or a one-value tensor, got a tensor of shape \[8\]"),
        ({"loss": "low"}, "loss must be a number or a one-value tensor, got 'low'"),
    ]
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        model = nn.Linear(4, 2)
        with rt.DistributedOptimizer(model, ps.addresses[0]) as opt:
            opt.zero_grad()
            backward(model)
            for kwargs, message in bad:
                with pytest.raises(LearnerError, match=message):
                    opt.step(**kwargs)
            assert ps.clock == 0
            assert opt.step(samples=8) and ps.clock == 1


def test_settings_and_layers_the_server_cannot_run_are_refused_before_any_gradient():
    """maximize=True (the server minimizes), dampening and sparse gradients (the wire carries
    dense ones): an optimizer with either setting and a sparse embedding are refused before
    the learner says hello; a sparse gradient from elsewhere when step() meets it."""

    class SparseLookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(10, 2))

        def forward(self, index: torch.Tensor) -> torch.Tensor:
            return nn.functional.embedding(index, self.table, sparse=True)

    with server_thread(protocol="async", lr=0.1, momentum=0.0, kernel="numpy") as ps:
        embedding = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
        with pytest.raises(LearnerError, match=r"parameter '0\.weight' gets sparse gradients, which rudra-async"):
            rt.DistributedOptimizer(embedding, ps.addresses[0])
        assert ps.stats()["learners"] == {}
        plain = nn.Linear(4, 2)
        with pytest.raises(LearnerError, match="the server's SGD minimizes the loss; build the optimizer with maxim"):
            rt.DistributedOptimizer(plain, ps.addresses[0], torch.optim.SGD(plain.parameters(), 0.1, maximize=True))
        nesterov = torch.optim.SGD(plain.parameters(), 0.1, momentum=0.0, nesterov=False)
        nesterov.param_groups[0]["nesterov"] = True  # torch refuses nesterov without momentum at construction
        with pytest.raises(LearnerError, match="start the server with --nesterov, or build the optimizer"):
            rt.DistributedOptimizer(plain, ps.addresses[0], nesterov)  # a flag: no value to give it
        damped = torch.optim.SGD(plain.parameters(), 0.1, momentum=0.9, dampening=0.5)
        with pytest.raises(LearnerError, match="has no dampening; build the optimizer with dampening=0"):
            rt.DistributedOptimizer(plain, ps.addresses[0], damped)
        assert len(ps.stats()["learners"]) == 1  # the nesterov check needs the WELCOME; the others come before
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        lookup = SparseLookup()
        with rt.DistributedOptimizer(lookup, ps.addresses[0]) as opt:
            lookup(torch.tensor([1, 2])).sum().backward()
            with pytest.raises(LearnerError, match="parameter 'table' gets sparse gradients"):
                opt.step(samples=2)
        assert ps.clock == 0 and ps.stats()["gradients"] == 0


@pytest.mark.parametrize(
    "protocol, options", [("hardsync", {}), ("backup", {"backup": 1}), ("bounded", {"staleness_bound": 0})]
)
def test_overlap_is_refused_where_the_protocol_would_drop_every_overlapped_gradient(protocol, options):
    """An overlapping learner's gradients are one exchange stale (σ ≥ 1): hardsync and backup
    drop every gradient older than the round's, bounded with s = 0 every one with σ > 0. Such a
    learner would train on every other step at best, so it is refused at once (and the same
    settings are a ConfigError for train); without overlap the same server trains."""
    with server_thread(protocol=protocol, lr=0.1, kernel="numpy", **options) as ps:
        model = nn.Linear(4, 2)
        with pytest.raises(LearnerError, match=f"overlap=True cannot train on this server: {protocol} "):
            rt.DistributedOptimizer(model, ps.addresses[0], overlap=True)
        with rt.DistributedOptimizer(model, ps.addresses[0]) as opt:
            opt.zero_grad()
            backward(model)
            assert opt.step(samples=8) and ps.clock == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_a_refused_gradient_is_raised_once_and_training_goes_on(overlap):
    """A NaN gradient is refused (bad_gradient). Without overlap its step() raises; with
    overlap the next one does (it waits for that exchange), once, and sends nothing itself.
    Either way the later steps train on and the model ends on the server's weights."""
    raised_at = 2 if overlap else 1
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = rt.DistributedOptimizer(model, ps.addresses[0], overlap=overlap)
        outcomes = []
        for i in range(6):
            opt.zero_grad()
            backward(model, float("nan") if i == 1 else 1.0)
            try:
                outcomes.append(opt.step(samples=8))
            except RemoteError as exc:
                outcomes.append(exc.code)
        opt.close()
        assert outcomes == [True] * raised_at + ["bad_gradient"] + [True] * (5 - raised_at)
        assert ps.clock == opt.timestamp == (4 if overlap else 5)
        np.testing.assert_array_equal(model.weight.detach().numpy(), ps.weights()["weight"])


@pytest.mark.parametrize("overlap", [False, True])
def test_an_outlier_gradient_is_lost_and_training_goes_on_but_a_run_of_them_ends_it(overlap):
    """One mini-batch's spike refused as gradient_outlier (found with MNIST-5k at μ = 4, where
    it ended both learners of a healthy run) costs that gradient only: step() goes on from the
    server's weights and counts it; MAX_REFUSED_IN_A_ROW in a row are a diverging model."""
    from rudra_async.learner.api import MAX_REFUSED_IN_A_ROW

    with server_thread(protocol="async", lr=0.01, kernel="numpy", grad_outlier_factor=10.0) as ps:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = rt.DistributedOptimizer(model, ps.addresses[0], overlap=overlap)
        for i in range(40):  # 32 accepted gradients arm the check
            opt.zero_grad()
            backward(model, 1e4 if i == 35 else 1.0)
            assert opt.step(samples=8)
        assert opt.refused == 1 and ps.stats()["rejected"] == {"gradient_outlier": 1}
        with pytest.raises(LearnerError, match=f"refused {MAX_REFUSED_IN_A_ROW} gradients in a row"):
            for _ in range(MAX_REFUSED_IN_A_ROW + 2):
                opt.zero_grad()
                backward(model, 1e4)
                opt.step(samples=8)
        opt.close()
        assert ps.clock == opt.pushes  # each accepted gradient one update, the refused none
    assert opt.refused == MAX_REFUSED_IN_A_ROW + 1


def test_an_optimizer_that_failed_or_closed_leaves_no_hooks_and_no_buffers():
    """Every DistributedOptimizer hooks the model's parameters and binds them to a flat buffer
    of its own. One whose server is not up, or that is closed, must take its hooks away and
    let its buffers go once the model is bound to another's (a retry loop, a re-created one)."""

    def hooks(model: nn.Module) -> int:
        return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())

    def alive() -> set[int]:
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is FlatParameters}

    model = nn.Linear(64, 64)
    before = alive()
    nobody = f"tcp://127.0.0.1:{free_port()}"
    for _ in range(3):
        with pytest.raises(ConnectError):
            rt.DistributedOptimizer(model, nobody, timeout=1)
    assert hooks(model) == 0 and not alive() - before
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        for overlap in (False, True):
            with rt.DistributedOptimizer(model, ps.addresses[0], overlap=overlap) as opt:
                assert hooks(model) == 2
                opt.zero_grad()
                model(torch.ones(1, 64)).sum().backward()
                assert opt.step(samples=1)
            assert hooks(model) == 0
        del opt
        with rt.DistributedOptimizer(model, ps.addresses[0]) as last:
            assert alive() - before == {id(last.flat)} and hooks(model) == 2  # the two closed ones are gone
        assert ps.clock == 2


class Stream(IterableDataset):
    """A streaming source: a DataLoader over it has no length."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(32):
            x = torch.randn(4, generator=g)
            yield x, int(x.sum() > 0)


def user_parts(monkeypatch, **data) -> None:
    """A module ``userparts`` with ``model`` and the given data functions, as --model/--data import it."""
    module = types.ModuleType("userparts")
    module.model = lambda: nn.Linear(4, 2)
    for name, fn in data.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, "userparts", module)


def learn(url: str, data: str, **config) -> dict:
    """run_learner (the learner command) in this process, with this process's torch threads kept."""
    threads = torch.get_num_threads()
    options = LearnerOptions(model="userparts:model", data=data, batch_size=8, steps=config.pop("steps", None))
    try:
        return run_learner(LearnerConfig(connect=url, options=options, **config))
    finally:
        torch.set_num_threads(threads)


def test_user_data_without_length_or_of_numpy_batches_trains_and_bad_batches_are_named(monkeypatch):
    """--data may give a DataLoader over an IterableDataset (no length: --steps counts) or
    numpy batches; a batch of anything else is a one-line LearnerError naming it."""
    rng = np.random.default_rng(0)
    numpy_batches = [(rng.standard_normal((8, 4), dtype=np.float32), rng.integers(0, 2, 8)) for _ in range(3)]
    user_parts(
        monkeypatch,
        stream=lambda batch_size: DataLoader(Stream(), batch_size=batch_size),
        numpy_batches=lambda: numpy_batches,
        lists=lambda: [([0.0] * 4, [1])],
    )
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        url = ps.addresses[0]
        assert learn(url, "userparts:stream", steps=5)["steps"] == 5
        with pytest.raises(LearnerError, match="data 'userparts:stream' has no length, so passes cannot be counted"):
            learn(url, "userparts:stream", passes=1.0)
        assert learn(url, "userparts:numpy_batches", passes=2.0)["steps"] == 6
        with pytest.raises(LearnerError, match="data 'userparts:lists' gave a batch part of type list; input and"):
            learn(url, "userparts:lists", steps=1)
        assert ps.clock == 11


def test_ctrl_c_while_an_overlapped_step_waits_leaves_the_exchange_in_flight():
    """Ctrl-C while step() waits for the exchange in flight interrupts the wait, not the
    exchange: the next step() waits for it again and takes its weights (else the model would
    be moved onto the buffer that exchange still receives into)."""
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        model = nn.Linear(4, 2)
        with rt.DistributedOptimizer(model, ps.addresses[0], overlap=True) as opt:
            release, exchange = threading.Event(), opt.client.push_pull
            opt.client.push_pull = lambda *a, **k: (release.wait(10), exchange(*a, **k))[1]
            backward(model)
            assert opt.step(samples=8)  # the first step only starts its exchange
            main = threading.main_thread().ident
            threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
            opt.zero_grad()
            backward(model)
            with pytest.raises(KeyboardInterrupt):
                opt.step(samples=8)  # waits for the first exchange, which is held
            release.set()
            assert opt.step(samples=8) and opt.timestamp == 1  # the first exchange's weights (clock 1)
        assert opt.timestamp == 2  # closing took the last exchange's: the server's own (one learner)
        np.testing.assert_array_equal(opt.flat.weights.numpy(), ps.core.store.weights)


def test_an_overlapped_device_step_takes_its_gradient_before_new_weights_reach_the_model():
    """On a device the new weights are copied in only after the gradient is taken (taking it
    waits for the backward, which reads the weights). Checked on the CPU with the device
    classes themselves, by the order of their copies."""
    from rudra_async.learner.binding import _DeviceGradients

    copies = []
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        model = nn.Linear(4, 2)
        with rt.DistributedOptimizer(model, ps.addresses[0], overlap=True) as opt:
            flat = opt.flat
            flat._device = _DeviceGradients(flat.params, flat.layout, flat.weights)  # as for a model on a GPU
            opt._spare = None  # on a device the weights arrive in the host staging
            opt._call(lambda: opt.client.set_weights_buffer(flat.host_weights))
            copier = flat._device.copier
            to_host, to_device = copier.to_host, copier.to_device
            copier.to_host = lambda g: (copies.append("gradient out"), to_host(g))[1]
            copier.to_device = lambda w, wait: (copies.append("weights in"), to_device(w, wait))[1]
            for _ in range(3):
                opt.zero_grad()
                backward(model)
                copies.append("step")
                opt.step(samples=8)
            copies.append("close")  # which takes the last exchange's weights
    steps = " ".join(copies).split(" close")[0].split("step")[1:]
    assert [s.split() for s in steps] == [["gradient", "out"]] + [["gradient", "out", "weights", "in"]] * 2


def test_ctrl_c_after_the_exchange_came_back_keeps_its_weights_to_take():
    """Ctrl-C after the previous exchange's weights came but before the model took them (on a
    device, taking the gradient waits for backward: where a Ctrl-C lands) leaves them to take:
    the next step() takes them."""
    with server_thread(protocol="async", lr=0.1, kernel="numpy") as ps:
        model = nn.Linear(4, 2)
        with rt.DistributedOptimizer(model, ps.addresses[0], overlap=True) as opt:
            backward(model)
            assert opt.step(samples=8)
            take = opt.flat.gradients

            def interrupted():
                opt.flat.gradients = take
                raise KeyboardInterrupt

            opt.flat.gradients = interrupted
            opt.zero_grad()
            backward(model)
            with pytest.raises(KeyboardInterrupt):
                opt.step(samples=8)
            assert opt.timestamp == 0
            assert opt.step(samples=8) and opt.timestamp == 1  # the first exchange's weights, taken now
        assert opt.timestamp == 2
        np.testing.assert_array_equal(opt.flat.weights.numpy(), ps.core.store.weights)

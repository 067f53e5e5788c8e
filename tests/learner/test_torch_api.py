"""The PyTorch API (rudra_async.torch): exactness against torch.optim.SGD, buffers, overlap,
shards and bad input, with real servers on loopback and learners in threads."""

import contextlib
import threading
import time

import numpy as np
import pytest
import torch
from helpers import server_thread
from torch import nn

import rudra_async.torch as rt
from rudra_async.errors import LearnerError, RemoteError
from rudra_async.layout import Shard

pytestmark = pytest.mark.torch

LAM, MU, STEPS = 3, 8, 12


def net(seed=0) -> nn.Module:
    """A frozen input layer, then two trainable layers (the model of the exactness test)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].requires_grad_(False)
    return model


def two_groups(model: nn.Module) -> torch.optim.SGD:
    """Different lr and weight decay per group, momentum with Nesterov for both."""
    return torch.optim.SGD(
        [
            {"params": model[4].parameters(), "lr": 0.2, "weight_decay": 0.0},
            {"params": model[2].parameters(), "lr": 0.05, "weight_decay": 0.01},
        ],
        lr=0.1,
        momentum=0.9,
        nesterov=True,
    )


def batches(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS * LAM * MU, 6, generator=g)
    return x, torch.randint(0, 3, (len(x),), generator=g)


def params_of(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def test_hardsync_learners_equal_torch_sgd_on_the_concatenated_batches_every_step():
    x, y = batches()
    reference = net()
    ref_opt = two_groups(reference)
    with server_thread(protocol="hardsync", lr=0.1, momentum=0.9, nesterov=True, kernel="numpy") as ps:
        models = [net() for _ in range(LAM)]
        opts = [rt.DistributedOptimizer(m, ps.addresses[0], optimizer=two_groups(m)) for m in models]
        after = [[None] * STEPS for _ in range(LAM)]

        def learn(k: int) -> None:
            for step in range(STEPS):
                lo = (step * LAM + k) * MU
                opts[k].zero_grad()
                nn.functional.cross_entropy(models[k](x[lo : lo + MU]), y[lo : lo + MU]).backward()
                opts[k].step(samples=MU)
                after[k][step] = params_of(models[k])

        threads = [threading.Thread(target=learn, args=(k,)) for k in range(LAM)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for step in range(STEPS):
            lo = step * LAM * MU
            ref_opt.zero_grad()
            nn.functional.cross_entropy(reference(x[lo : lo + LAM * MU]), y[lo : lo + LAM * MU]).backward()
            ref_opt.step()
            for k in range(LAM):
                for got, want in zip(after[k][step], params_of(reference)):
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"learner {k}, step {step}")
        assert ps.stats()["staleness_max"] == 0 and ps.clock == STEPS
        assert [len(opt.flat.layout.tensors) for opt in opts] == [4] * LAM  # the frozen layer stays home
        for opt in opts:
            opt.close()


def test_buffers_stay_with_the_learner_and_follow_its_own_forward_passes():
    """Documented rule: buffers (BatchNorm running statistics) are not sent; each learner's
    follow its own batches. With BatchNorm first, the running mean is the moving average of
    the input batch means the learner saw, whatever the weights."""
    with server_thread(protocol="async", lr=0.05, kernel="numpy") as ps:
        models, opts, seen = [], [], []
        for k in range(2):
            torch.manual_seed(0)
            models.append(nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)))
            opts.append(rt.DistributedOptimizer(models[k], ps.addresses[0]))
            seen.append(torch.zeros(4))
        names = [t.name for t in opts[0].flat.layout.tensors]
        assert names == ["0.weight", "0.bias", "1.weight", "1.bias"]  # no running_mean/var
        g = torch.Generator().manual_seed(2)
        for _ in range(10):
            for k in range(2):
                xb = torch.randn(16, 4, generator=g) + 3.0 * k  # the learners see different data
                opts[k].zero_grad()
                nn.functional.cross_entropy(models[k](xb), torch.zeros(16, dtype=torch.long)).backward()
                opts[k].step(samples=16)
                seen[k] = 0.9 * seen[k] + 0.1 * xb.mean(0)
        for k in range(2):
            torch.testing.assert_close(models[k][0].running_mean, seen[k])
        assert not torch.allclose(models[0][0].running_mean, models[1][0].running_mean)
        for opt in opts:
            opt.close()


def test_overlap_adds_one_step_of_staleness_and_equals_sgd_on_one_step_old_weights():
    """One learner, async: without overlap every σ = 0; with it every gradient but the first
    is computed on weights one update old."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    for overlap, expected in ((False, {"0": 10}), (True, {"0": 1, "1": 9})):
        with server_thread(protocol="async", lr=0.1, momentum=0.9, kernel="numpy") as ps:
            model = net()
            with rt.DistributedOptimizer(model, ps.addresses[0], overlap=overlap) as opt:
                for _ in range(10):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    assert opt.step(samples=64)
            assert ps.stats()["staleness_histogram"] == expected and ps.clock == 10


def test_a_model_whose_layout_differs_is_refused_and_the_server_goes_on():
    with server_thread(protocol="async", kernel="numpy") as ps:
        good = rt.DistributedOptimizer(net(), ps.addresses[0])
        with pytest.raises(RemoteError) as info:
            rt.DistributedOptimizer(nn.Linear(3, 3), ps.addresses[0])
        assert info.value.code == "layout_mismatch"
        other = net()
        in_layout_order = torch.optim.SGD(
            [{"params": other[2].parameters(), "lr": 0.05}, {"params": other[4].parameters(), "lr": 0.2}], momentum=0.9
        )
        with pytest.raises(RemoteError) as info:  # the same layout, other parameter groups
            rt.DistributedOptimizer(other, ps.addresses[0], optimizer=in_layout_order)
        assert info.value.code == "groups_mismatch"
        good.zero_grad()
        nn.functional.cross_entropy(good.model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
        assert good.step() and ps.clock == 1
        good.close()


def test_an_unused_layer_and_a_mismatched_optimizer_are_clear_errors():
    with server_thread(protocol="async", momentum=0.9, kernel="numpy") as ps:
        model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
        opt = rt.DistributedOptimizer(model, ps.addresses[0])
        opt.zero_grad()
        model["used"](torch.randn(4, 3)).sum().backward()
        with pytest.raises(LearnerError, match=r"no gradient for parameter\(s\) unused.weight, unused.bias"):
            opt.step()
        opt.close()
    with server_thread(protocol="async", momentum=0.9, kernel="numpy") as ps:
        plain = nn.Linear(3, 2)
        with pytest.raises(LearnerError, match=r"the optimizer's momentum is 0\.5, the server's is 0\.9"):
            rt.DistributedOptimizer(plain, ps.addresses[0], optimizer=torch.optim.SGD(plain.parameters(), 0.1, 0.5))
        with pytest.raises(LearnerError, match="the server applies SGD; Adam cannot be run there"):
            rt.DistributedOptimizer(plain, ps.addresses[0], optimizer=torch.optim.Adam(plain.parameters()))
        assert ps.clock == 0 and ps.stats()["gradients"] == 0


@pytest.mark.parametrize("zeroing", ["ours", "torch set_to_none", "torch in place"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_server_applies_exactly_the_gradients_backward_computed(overlap, zeroing):
    """Each tensor's .grad goes out as it is; with overlap the exchange (slowed here) still
    holds step t's gradients while step t+1's backward runs, however the user zeroes
    gradients. Async with one learner and a constant rate applies the pushes in order, so
    the server's weights are SGD replayed on the gradients recorded at each step (overlap
    makes them stale: the default policy, compensated, would take momentum out)."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    model = net()
    trained = [p for p in model.parameters() if p.requires_grad]
    torch_opt = torch.optim.SGD(trained, lr=0.1, momentum=0.9)
    recorded = []
    with server_thread(protocol="async", lr=0.1, momentum=0.9, kernel="numpy", lr_policy="constant") as ps:
        with rt.DistributedOptimizer(model, ps.addresses[0], optimizer=torch_opt, overlap=overlap) as opt:
            replay = [p.detach().clone() for p in trained]  # the initial weights
            exchange = opt.client.push_pull
            opt.client.push_pull = lambda *a: (time.sleep(0.02), exchange(*a))[1]
            for k in range(5):
                if zeroing == "ours":
                    opt.zero_grad()
                else:
                    torch_opt.zero_grad(set_to_none=zeroing == "torch set_to_none")
                nn.functional.cross_entropy(model(x[8 * k : 8 * k + 8]), y[8 * k : 8 * k + 8]).backward()
                recorded.append([p.grad.clone() for p in trained])
                assert opt.step(samples=8)
        final = ps.core.store.weights.copy()
    sgd = torch.optim.SGD(replay, lr=0.1, momentum=0.9)
    for grads in recorded:
        for p, g in zip(replay, grads):
            p.grad = g
        sgd.step()
    np.testing.assert_allclose(final, torch.cat([p.reshape(-1) for p in replay]).numpy(), rtol=1e-6, atol=1e-7)


def test_a_torch_zero_grad_that_sets_gradients_to_none_is_tolerated():
    with server_thread(protocol="async", lr=0.5, momentum=0.0, kernel="numpy") as ps:
        model = nn.Linear(3, 1, bias=False)
        torch_opt = torch.optim.SGD(model.parameters(), lr=0.5)
        opt = rt.DistributedOptimizer(model, ps.addresses[0], optimizer=torch_opt)
        before = model.weight.detach().clone()
        torch_opt.zero_grad()  # set_to_none=True: backward makes a fresh .grad
        x = torch.ones(1, 3)
        model(x).sum().backward()
        opt.step()
        torch.testing.assert_close(model.weight.detach(), before - 0.5 * x)
        opt.close()


def test_shards_given_as_a_list_train_like_one_server():
    x, y = batches()
    results = []
    for count in (1, 2):
        with contextlib.ExitStack() as stack:
            group = [
                stack.enter_context(server_thread(protocol="async", lr=0.1, momentum=0.9, shard=Shard(i, count)))
                for i in range(count)
            ]
            model = net()
            with rt.DistributedOptimizer(model, [ps.addresses[0] for ps in group]) as opt:
                for step in range(STEPS):
                    xb, yb = x[step * MU : (step + 1) * MU], y[step * MU : (step + 1) * MU]
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(xb), yb).backward()
                    opt.step()
            assert [ps.clock for ps in group] == [STEPS] * count
            results.append(params_of(model))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_device_model_offers_its_own_weights_to_the_server():
    """A model on a device reaches the server through host staging: at connect that staging
    must already hold the model's weights (a new server starts from them). Checked on the CPU
    with the staging class itself; the GPU test below checks it end to end."""
    from rudra_async.learner.binding import _DeviceCopier

    weights = torch.randn(1000)
    copier = _DeviceCopier(weights, torch.zeros(1000))
    np.testing.assert_array_equal(copier.host_weights, weights.numpy())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device visible to torch")
@pytest.mark.parametrize("overlap", [False, True])
def test_a_model_on_the_gpu_trains_like_torch_sgd_on_the_gpu(overlap):
    """GPU learner against a CPU server: gradients leave through pinned buffers on a side
    stream and weights come back the same way; equal to torch.optim.SGD run on the device."""
    device = torch.device("cuda")
    x, y = (t.to(device) for t in batches())
    reference = net().to(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    with server_thread(protocol="async", lr=0.1, momentum=0.9, kernel="numpy") as ps:
        model = net().to(device)
        with rt.DistributedOptimizer(model, ps.addresses[0], overlap=overlap) as opt:
            assert opt.flat.device.type == "cuda"
            for step in range(STEPS):
                xb, yb = x[step * MU : (step + 1) * MU], y[step * MU : (step + 1) * MU]
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                if overlap:  # the gradient sent is let go of: the next backward starts from zero
                    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
                else:
                    ref_opt.zero_grad()
                    nn.functional.cross_entropy(reference(xb), yb).backward()
                    ref_opt.step()
                    for got, want in zip(model.parameters(), reference.parameters()):
                        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert ps.clock == STEPS
        if overlap:
            assert ps.stats()["staleness_histogram"] == {"0": 1, "1": STEPS - 1}


@pytest.mark.parametrize("overlap", [False, True])
def test_a_learner_with_reconnect_trains_on_after_the_server_restarts(overlap):
    """The server restarts on the same port without a checkpoint (clock 0). A learner with
    ``reconnect`` loses the gradient computed on the lost server's weights and trains on
    from the new server's: with overlap it must not push that gradient, stamped with the
    old clock (refused as bad_timestamp, which ended the learner)."""
    from helpers import free_port

    port = free_port()
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with server_thread(listen=[f"tcp://127.0.0.1:{port}"], lr=0.1, kernel="numpy") as first:
        opt = rt.DistributedOptimizer(model, f"tcp://127.0.0.1:{port}", reconnect=20, overlap=overlap)
        for _ in range(6):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            assert opt.step(samples=8)
        if opt._pending is not None:
            opt._pending.result()
        assert first.clock == 6
    try:
        with server_thread(listen=[f"tcp://127.0.0.1:{port}"], lr=0.1, kernel="numpy") as second:
            for _ in range(4):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                assert opt.step(samples=8)
            assert opt.reconnects == 1
            opt.close()
            # lost: the gradient in flight when the server went, and with overlap also the one
            # computed on the lost server's weights while that exchange reconnected
            assert second.clock == (2 if overlap else 3)
            np.testing.assert_array_equal(params_of(model)[0], second.weights()["weight"])
    finally:
        opt.close()


@pytest.mark.parametrize("max_updates", [None, 5])
def test_closing_an_overlapping_learner_leaves_the_model_on_the_newest_weights(max_updates):
    """With overlap the last exchange is still in flight when the loop ends: close() waits
    for it and gives its weights to the model, so the model equals the server's weights,
    also when they are the run's last (they come with stop)."""
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with server_thread(lr=0.1, kernel="numpy", max_updates=max_updates) as ps:
        opt = rt.DistributedOptimizer(model, ps.addresses[0], overlap=True)
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step(samples=8)
        opt.close()
        assert ps.clock == 5 and opt.timestamp == 5
        np.testing.assert_array_equal(params_of(model)[0], ps.weights()["weight"])


def test_an_overlapping_learner_whose_push_comes_after_the_run_ended_takes_the_final_weights():
    """Another learner ends the run while this one's exchange is in flight: the push is
    refused (stopped), the run's final weights are pulled instead, so the next step() returns
    False with the model on the final weights, at their timestamp."""
    from rudra_async import SyncClient

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with server_thread(protocol="async", lr=0.5, kernel="numpy", max_updates=3) as ps:
        opt = rt.DistributedOptimizer(model, ps.addresses[0], overlap=True)
        other = SyncClient(ps.addresses[0], opt.flat.layout)

        def step() -> bool:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            return opt.step(samples=8)

        def flat_model() -> np.ndarray:
            return np.concatenate([p.reshape(-1) for p in params_of(model)])

        assert step() and step()
        opt._pending.result()  # the server is at 2 updates: this learner's exchange is done
        at_two = other.pull().array.copy()
        other.push(np.ones(opt.flat.layout.size, np.float32), 2)  # the 3rd update: the run is over
        at_three = other.pull().array.copy()
        assert step() is True and opt.timestamp == 2  # takes the weights of update 2; its push is refused
        np.testing.assert_array_equal(flat_model(), at_two)
        assert step() is False and opt.timestamp == 3  # the run's final weights came instead
        np.testing.assert_array_equal(flat_model(), at_three)
        opt.close()
        other.close()
        assert ps.clock == 3


def test_a_device_models_gradient_once_sent_is_let_go_of_as_on_the_cpu():
    """Overlap lets go of the gradient it sends, so the next backward starts from none: on
    the CPU ``.grad`` becomes None; on a device it stays bound to the flat device buffer and
    is zeroed (else the next backward adds to it). Checked on the CPU with the device classes
    themselves; the GPU test checks it end to end."""
    from rudra_async.learner.binding import FlatParameters, _DeviceGradients

    model = nn.Linear(3, 2)
    flat = FlatParameters(list(model.named_parameters()))
    flat._device = _DeviceGradients(flat.params, flat.layout, flat.weights)  # as for a model on a GPU
    x = torch.randn(4, 3)
    sent = []
    for _ in range(2):
        model(x).sum().backward()
        sent.append(flat.gradients()[0].copy())
        flat.release_gradients()
    np.testing.assert_array_equal(sent[1], sent[0])
    assert all(not p.grad.any() for p in model.parameters())
    flat.close()

"""A user's own PyTorch training on rudra-async (issue "your own training"): schedulers and
state_dict on the wrapper, frozen parameters and BatchNorm buffers kept by the server,
data split among learners, threads, start order and endings; with real servers on loopback
and learners in threads or processes."""

import contextlib
import json
import logging
import os
import runpy
import signal
import threading
import time

import numpy as np
import pytest
import torch
from helpers import free_port, run_cli, server_thread, start_server
from torch import nn

import rudra_async.torch as rt
from rudra_async.errors import LearnerError, PeerGone, RemoteError, Unreachable
from rudra_async.layout import Shard
from rudra_async.learner.api import set_threads
from rudra_async.learner.data import minibatches, shard_of

pytestmark = pytest.mark.torch


def bn_net(seed=0, frozen_seed=None) -> nn.Module:
    """A frozen first layer (seeded apart with ``frozen_seed``), BatchNorm, two trained layers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    if frozen_seed is not None:
        torch.manual_seed(frozen_seed)
        model[0].reset_parameters()
    model[0].requires_grad_(False)
    return model


def data(n=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def train_steps(opt, model, steps, x, y, mu=8):
    for k in range(steps):
        lo = (k * mu) % len(x)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[lo : lo + mu]), y[lo : lo + mu])
        loss.backward()
        opt.step(loss=loss, samples=mu)


def test_shards_partition_every_epoch_and_reshuffle():
    for n, lam in [(10, 3), (12, 4), (7, 1)]:
        parts = [shard_of(n, i, lam, epoch=0, seed=5) for i in range(lam)]
        assert {len(p) for p in parts} == {-(-n // lam)}  # as many each (the tail padded from the start)
        assert set(np.concatenate(parts)) == set(range(n))
        assert sum(len(set(p)) for p in parts) - n == sum(len(p) for p in parts) - n  # each part has no repeat
    assert not np.array_equal(shard_of(100, 0, 2, 0, 5), shard_of(100, 0, 2, 1, 5))  # a new order each epoch
    assert np.array_equal(shard_of(100, 1, 2, 3, 5), shard_of(100, 1, 2, 3, 5))  # the same on every learner
    batches = minibatches(10, 4, index=1, learners=2, seed=5)  # train's built-in data: learner 1's part
    taken = np.concatenate([next(batches) for _ in range(5)])
    assert set(taken[:5]) == set(shard_of(10, 1, 2, 0, 5)) and set(taken[:5]).isdisjoint(shard_of(10, 0, 2, 0, 5))


class FakeOptimizer:
    def __init__(self, index, learners):
        self.index, self.learners, self.stopped = index, learners, False


def test_the_sampler_follows_index_and_lambda_per_epoch_and_ends_with_the_run():
    opt = FakeOptimizer(0, 2)
    sampler = rt.ShardSampler(range(10), opt, seed=3)
    first = list(sampler)
    assert len(first) == len(sampler) == 5 and first == shard_of(10, 0, 2, 0, 3).tolist()
    opt.learners = 1  # the other learner left: from the next epoch, this one takes everything
    assert sorted(sampler) == list(range(10))
    it = iter(sampler)
    assert next(it) is not None
    opt.stopped = True  # the server's run is over: the loop over the loader ends
    assert list(it) == []
    loader = torch.utils.data.DataLoader(
        range(10), batch_size=4, sampler=rt.ShardSampler(range(10), FakeOptimizer(1, 2))
    )
    assert sorted(torch.cat(list(loader)).tolist()) == sorted(shard_of(10, 1, 2, 0, 0).tolist())


def test_a_scheduler_on_the_wrapper_or_on_the_optimizer_reaches_the_servers_rate_exactly():
    """One learner, async, constant policy, numpy kernel: the server's weights are those of
    torch's own SGD and StepLR run on the same gradients (docs/protocols.md: a push's lr is
    the groups' base rate from its update on)."""
    x, y = data()
    for on_wrapper in (True, False):
        model, reference = bn_net(), bn_net()
        with server_thread(protocol="async", momentum=0.9, kernel="numpy", lr_policy="constant") as ps:
            sgd = torch.optim.SGD(model[3].parameters(), lr=0.1, momentum=0.9)
            sgd.add_param_group({"params": model[1].parameters(), "lr": 0.05})
            opt = rt.DistributedOptimizer(model, ps.addresses[0], optimizer=sgd)
            scheduler = torch.optim.lr_scheduler.StepLR(opt if on_wrapper else sgd, step_size=2, gamma=0.5)
            grads = []
            for k in range(6):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[8 * k : 8 * k + 8]), y[8 * k : 8 * k + 8]).backward()
                grads.append([p.grad.clone() for group in sgd.param_groups for p in group["params"]])
                opt.step(samples=8)
                scheduler.step()
            assert ps.core.rates == (0.1 * 0.5**2, 0.05 * 0.5**2)  # the last push's: before the last scheduler step
            final = ps.core.store.weights.copy()
            opt.close()
        ref_sgd = torch.optim.SGD(reference[3].parameters(), lr=0.1, momentum=0.9)
        ref_sgd.add_param_group({"params": reference[1].parameters(), "lr": 0.05})
        ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_sgd, step_size=2, gamma=0.5)
        params = [p for group in ref_sgd.param_groups for p in group["params"]]
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g
            ref_sgd.step()
            ref_scheduler.step()
        expected = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
        np.testing.assert_allclose(final, expected, rtol=1e-6, atol=1e-7)


def test_state_dict_round_trips_and_loads_into_torch_sgd():
    x, y = data()
    with server_thread(protocol="async", momentum=0.9, kernel="numpy") as ps:
        model = bn_net()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = rt.DistributedOptimizer(model, ps.addresses[0], optimizer=sgd)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        train_steps(opt, model, 2, x, y)
        scheduler.step()
        saved = opt.state_dict()
        assert saved["param_groups"][0]["lr"] == 0.05 and set(saved) == {"state", "param_groups"}
        other_model = bn_net()
        other_sgd = torch.optim.SGD(other_model.parameters(), lr=0.1, momentum=0.9)
        other = rt.DistributedOptimizer(other_model, ps.addresses[0], optimizer=other_sgd)
        other.load_state_dict(saved)
        assert other.param_groups[0]["lr"] == 0.05 and other.param_groups[0] is other_sgd.param_groups[0]
        assert other.state_dict()["param_groups"] == saved["param_groups"]
        train_steps(other, other_model, 1, x, y)  # its first push carries the loaded rate
        assert ps.core.rates == (0.05,)
        plain = torch.optim.SGD(bn_net().parameters(), lr=1.0, momentum=0.9)
        plain.load_state_dict(saved)  # the usual model + optimizer checkpoint works both ways
        assert plain.param_groups[0]["lr"] == 0.05
        for o in (opt, other):
            o.close()


def test_frozen_parameters_and_buffers_are_the_runs_and_a_different_layout_is_refused_by_name(caplog):
    x, y = data()
    with server_thread(protocol="hardsync", momentum=0.9, kernel="numpy") as ps:
        first_model = bn_net()
        first = rt.DistributedOptimizer(first_model, ps.addresses[0])
        other_model = bn_net(frozen_seed=7)  # its frozen layer differs: it takes the run's
        with caplog.at_level(logging.WARNING, "rudra_async.learner.api"):
            second = rt.DistributedOptimizer(other_model, ps.addresses[0])
        assert "0.weight, 0.bias differed from the run's" in caplog.text
        assert torch.equal(other_model[0].weight, first_model[0].weight)
        with pytest.raises(RemoteError) as info:  # one more buffer than the run's: refused, naming it
            rt.DistributedOptimizer(nn.Sequential(*bn_net(), nn.BatchNorm1d(3)), ps.addresses[0])
        assert info.value.code == "layout_mismatch" and "4.running_mean" in str(info.value)
        threads = [threading.Thread(target=train_steps, args=(o, m, 3, x, y)) for o, m in ((first, first_model), (second, other_model))]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        first.close()
        second.close()
        run = ps.core.state
        names = [t.name for t in run.layout.tensors]
        assert names == ["0.weight", "0.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
        expected_mean = (first_model[1].running_mean + other_model[1].running_mean) / 2  # both reported at close
        np.testing.assert_allclose(run.values[2], expected_mean.numpy(), rtol=1e-6)


def test_a_checkpoint_holds_the_whole_model_and_evaluate_reproduces_the_learners_accuracy(tmp_path, monkeypatch):
    """One learner: the checkpoint's buffers are its own final ones, so ``evaluate --model
    --data`` on the checkpoint gives exactly the accuracy of the learner's model."""
    module = tmp_path / "bnmodel.py"
    module.write_text(
        "import torch\nfrom torch import nn\n"
        "def model():\n"
        "    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))\n"
        "def test():\n"
        "    g = torch.Generator().manual_seed(3)\n"
        "    x = torch.randn(200, 4, generator=g)\n"
        "    return [(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())]\n"
    )
    path = tmp_path / "run.ckpt"
    x, y = data(256)
    with server_thread(protocol="async", momentum=0.9, kernel="numpy", checkpoint=str(path)) as ps:
        model = bn_net()
        opt = rt.DistributedOptimizer(model, ps.addresses[0], optimizer=torch.optim.SGD(model.parameters(), 0.1, 0.9))
        train_steps(opt, model, 40, x, y)
        opt.close()
        assert ps.core.state.seeded
    ((tx, ty),) = runpy.run_path(str(module))["test"]()
    model.eval()
    with torch.no_grad():
        own = (model(tx).argmax(1) == ty).float().mean().item()
    proc = run_cli("evaluate", str(path), "--model", "bnmodel:model", "--data", "bnmodel:test", "--json",
                   env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["test_accuracy"] == pytest.approx(own, abs=1e-6) and out["dataset"] == "bnmodel:test"
    assert own > 0.6  # it learned something: the buffers matter for the result


def test_a_learner_waits_for_a_server_that_is_not_up_yet_within_reconnect():
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    with pytest.raises(Unreachable):  # without reconnect: at once
        rt.DistributedOptimizer(bn_net(), url)
    box = {}
    thread = threading.Thread(
        target=lambda: box.setdefault("opt", rt.DistributedOptimizer(bn_net(), url, reconnect=30))
    )
    thread.start()
    time.sleep(1.0)
    server = start_server(port, "--protocol", "async")
    try:
        thread.join(30)
        assert "opt" in box and box["opt"].learners == 1
        box["opt"].close()
    finally:
        server.kill()
        server.communicate()


def test_a_server_shutting_down_tells_its_learners_why():
    port = free_port()
    server = start_server(port, "--protocol", "async")
    x, y = data()
    model = bn_net()
    opt = rt.DistributedOptimizer(model, f"tcp://127.0.0.1:{port}")
    server.send_signal(signal.SIGINT)
    server.communicate(timeout=30)
    with pytest.raises(PeerGone, match="the server is shutting down: it got SIGINT"):
        train_steps(opt, model, 1, x, y)
    opt.close()


def test_after_the_run_is_over_step_trains_nothing_and_says_so_once(caplog):
    x, y = data()
    with server_thread(protocol="async", momentum=0.9, kernel="numpy", max_updates=3) as ps:
        model = bn_net()
        opt = rt.DistributedOptimizer(model, ps.addresses[0])
        results = []
        with caplog.at_level(logging.WARNING, "rudra_async.learner.api"):
            for _ in range(6):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
                results.append(opt.step())
        assert results == [True, True, False, False, False, False] and ps.clock == 3
        assert caplog.text.count("step() no longer trains") == 1
        opt.close()


def test_a_learner_whose_push_comes_after_the_end_takes_the_final_weights():
    """A learner that joined early and pushed only after the run was over kept the weights
    it joined with (a launched job's late learner reported 0.10 accuracy, the other 0.96)."""
    x, y = data()
    with server_thread(protocol="async", momentum=0.9, kernel="numpy", max_updates=4) as ps:
        early, late = bn_net(), bn_net()
        fast = rt.DistributedOptimizer(early, ps.addresses[0])
        slow = rt.DistributedOptimizer(late, ps.addresses[0])  # joins now, at update 0
        while not fast.stopped:
            train_steps(fast, early, 1, x, y)
        assert ps.clock == 4
        slow.zero_grad()
        nn.functional.cross_entropy(late(x[:8]), y[:8]).backward()
        assert slow.step() is False and slow.pushes == 0  # refused: the run is over
        final = ps.weights()
        trained = {name: p for name, p in late.named_parameters() if p.requires_grad}
        assert set(trained) == set(final)
        for name, param in trained.items():
            assert np.array_equal(param.detach().numpy(), final[name]), name  # the run's final weights
        fast.close()
        slow.close()


def test_threads_are_divided_among_a_hosts_learners():
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        torch.set_num_threads(cores)
        set_threads("auto", 2, "tcp://10.0.0.1:7000")  # a server elsewhere: left as it is
        assert torch.get_num_threads() == cores
        set_threads("auto", 2, "shm://x")
        assert torch.get_num_threads() == max(1, cores // 2)
        set_threads(3, 2, "shm://x")
        assert torch.get_num_threads() == 3
        torch.set_num_threads(cores)
        with contextlib.ExitStack() as stack:
            stack.enter_context(pytest.MonkeyPatch.context()).setenv("OMP_NUM_THREADS", "5")
            set_threads("auto", 2, "tcp://127.0.0.1:7000")  # the user chose: left alone
            assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)


def test_a_changed_momentum_in_a_group_is_a_clear_error():
    with server_thread(protocol="async", momentum=0.9, kernel="numpy") as ps:
        model = bn_net()
        opt = rt.DistributedOptimizer(model, ps.addresses[0], optimizer=torch.optim.SGD(model.parameters(), 0.1, 0.9))
        opt.param_groups[0]["momentum"] = 0.5
        x, y = data()
        with pytest.raises(LearnerError, match=r"param_groups\[0\]\['momentum'\] changed from 0.9 to 0.5"):
            train_steps(opt, model, 1, x, y)
        opt.close()


def test_the_wait_for_the_server_is_the_reconnect_window():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(Unreachable):
        rt.DistributedOptimizer(bn_net(), f"tcp://127.0.0.1:{port}", reconnect=1.0)
    assert 0.9 <= time.monotonic() - started < 10


def test_train_overlapping_with_the_defaults_trains_and_a_constant_rate_is_warned_about_first(tmp_path):
    """`train --overlap` with its defaults (λ = 4, async, momentum 0.9, α0 0.03): 0.15–0.27
    with a constant rate, now trained by the default policy; with --lr-policy constant the
    warning comes before the server starts."""
    out = tmp_path / "r.json"
    proc = run_cli("train", "-q", "--overlap", "--results", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["lr_policy"] == "compensated" and result["staleness_mean"] > 3
    # the bar is 0.95: 28 runs on 2026-12-07 gave 0.947-0.967, 27 of them >= 0.95 (median 0.961;
    # the order of asynchronous updates varies), so one run is held to 0.94 (docs/own_training.md)
    assert result["test_accuracy"] >= 0.94, result["test_accuracy"]
    assert "--lr-policy" not in proc.stderr
    proc = run_cli("--log-level", "DEBUG", "train", "-q", "--overlap", "--lr-policy", "constant", "--updates", "3")
    assert proc.returncode == 0, proc.stderr
    warning = proc.stderr.index("--lr-policy constant with --momentum 0.9 under --protocol async with --overlap")
    assert warning < proc.stderr.index("parameter server listening")


def test_shard_0_of_a_group_keeps_the_models_state_and_evaluate_joins_the_group(tmp_path):
    x, y = data()
    paths = [tmp_path / f"s{i}.ckpt" for i in range(2)]
    with contextlib.ExitStack() as stack:
        shards = [
            stack.enter_context(server_thread(kernel="numpy", shard=Shard(i, 2), checkpoint=str(paths[i])))
            for i in range(2)
        ]
        model = bn_net()
        opt = rt.DistributedOptimizer(model, [s.addresses[0] for s in shards])
        train_steps(opt, model, 4, x, y)
        opt.close()
        assert shards[0].core.state.seeded and shards[1].core.state is None
    module = tmp_path / "bnshards.py"
    module.write_text(
        "import torch\nfrom torch import nn\n"
        "def model():\n"
        "    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))\n"
        "def test():\n"
        "    x = torch.randn(50, 4, generator=torch.Generator().manual_seed(9))\n"
        "    return [(x, (x[:, 0] > 0).long())]\n"
    )
    from rudra_async.learner.evaluation import evaluate_checkpoint

    with pytest.MonkeyPatch.context() as m:
        m.syspath_prepend(str(tmp_path))
        out = evaluate_checkpoint([str(p) for p in paths], "bnshards:model", data="bnshards:test")
    assert out["clock"] == 4 and 0 <= out["test_accuracy"] <= 1

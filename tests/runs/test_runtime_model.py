"""The runtime model (rudra_async.runs.runtime_model) against cases whose answer is known by
hand: one learner (everything in series), learners bound by the cores, by the server, and
hardsync's rounds."""

import math
from dataclasses import replace

import pytest

from rudra_async.errors import ConfigError
from rudra_async.runs.runtime_model import Costs, gradients_per_update, simulate


def test_one_learner_runs_every_cost_in_series():
    costs = Costs(compute_s=0.010, client_s=0.002, server_s=0.001, update_s=0.003, latency_s=0.0005)
    got = simulate(costs, 1, "async", cores=2, batch_size=32, updates=500)
    period = 0.010 + 0.002 + 0.001 + 0.003 + 2 * 0.0005
    assert got.updates_per_s == pytest.approx(1 / period, rel=1e-6)
    assert got.samples_per_s == pytest.approx(32 / period, rel=1e-6)
    assert got.staleness_mean == 0


def test_learners_with_a_core_each_scale_and_see_the_others_updates_as_staleness():
    costs = Costs(compute_s=0.010, client_s=0.0, server_s=0.0001, update_s=0.0001)
    one = simulate(costs, 1, "async", cores=64, batch_size=1)
    eight = simulate(costs, 8, "async", cores=64, batch_size=1)
    assert eight.samples_per_s / one.samples_per_s == pytest.approx(8, rel=0.03)
    assert eight.staleness_mean == pytest.approx(7, abs=0.1)  # λ − 1


def test_more_learners_than_cores_share_them():
    costs = Costs(compute_s=0.010, client_s=0.0, server_s=0.0, update_s=0.0)
    got = simulate(costs, 4, "async", cores=2, batch_size=1)
    assert got.samples_per_s == pytest.approx(2 / 0.010, rel=0.01)  # two cores' worth of compute


def test_a_busy_server_bounds_the_updates():
    costs = Costs(compute_s=0.001, client_s=0.0, server_s=0.004, update_s=0.006)
    got = simulate(costs, 16, "async", cores=100, batch_size=1)
    assert got.updates_per_s == pytest.approx(1 / 0.010, rel=0.01)


def test_hardsync_rounds_wait_for_every_push_and_one_update():
    costs = Costs(compute_s=0.010, client_s=0.002, server_s=0.001, update_s=0.003, combine_s=0.0005)
    got = simulate(costs, 4, "hardsync", cores=100, batch_size=8, updates=300)
    # the pushes of a round arrive together and are handled one after another; the last one's
    # handling includes the update of 4 gradients
    period = 0.010 + 0.001 + 4 * 0.001 + 0.003 + 3 * 0.0005 + 0.001
    assert got.updates_per_s == pytest.approx(1 / period, rel=1e-6)
    assert got.samples_per_s == pytest.approx(4 * 8 / period, rel=1e-6)
    assert got.staleness_mean == 0


def test_softsync_makes_an_update_of_c_gradients_and_answers_at_once():
    costs = Costs(compute_s=0.010, client_s=0.0, server_s=0.0001, update_s=0.0001)
    got = simulate(costs, 8, "softsync", n=2, cores=64, batch_size=1)
    assert gradients_per_update("softsync", 8, 2) == 4
    assert got.samples_per_s / got.updates_per_s == pytest.approx(4, rel=0.01)
    # in lockstep, of each 4 pushes the first 3 are answered with the clock before their update
    # and the 4th after it: their next gradients are 2, 2, 2 and 1 updates stale
    assert got.staleness_mean == pytest.approx(1.75, abs=0.05)


def test_bad_costs_and_protocols_are_refused():
    with pytest.raises(ConfigError):
        Costs(compute_s=-1, client_s=0, server_s=0, update_s=0)
    with pytest.raises(ConfigError):
        simulate(Costs(0.01, 0, 0, 0), 2, "bounded", cores=2, batch_size=1)


def test_a_message_that_wakes_a_process_while_another_runs_pays_the_switch():
    free = Costs(compute_s=0.010, client_s=0.0, server_s=0.001, update_s=0.0)
    switching = Costs(compute_s=0.010, client_s=0.0, server_s=0.001, update_s=0.0, switch_s=0.002)
    alone = simulate(switching, 1, cores=2, batch_size=1)  # nothing else runs when it wakes
    assert alone.samples_per_s == pytest.approx(simulate(free, 1, cores=2, batch_size=1).samples_per_s)
    # 2 learners with a core each: the other one computes whenever a push or a reply wakes
    # the server or its learner, so each step pays twice
    two = simulate(switching, 2, cores=100, batch_size=1)
    assert two.samples_per_s == pytest.approx(2 / (0.010 + 0.001 + 2 * 0.002), rel=0.02)


def test_a_push_that_waited_in_the_queue_pays_no_switch():
    # 8 learners whose compute is short against the server's 1 ms: pushes always wait, and
    # the server reads one after another without a wake-up, 1,000 a second; each learner's
    # own wake-up (2 ms) is hidden behind the 7 pushes ahead of its next one
    costs = Costs(compute_s=0.0001, client_s=0.0, server_s=0.001, update_s=0.0, switch_s=0.002)
    got = simulate(costs, 8, cores=100, batch_size=1)
    assert got.updates_per_s == pytest.approx(1000, rel=0.01)


def test_a_hardsync_round_pays_the_hold_of_each_push_but_its_last():
    # 2 learners with a core each push at once after 10 ms; the server handles the first
    # (1 ms, held: 2 ms more), then the second, which completes the round (1 ms): 14 ms a round
    costs = Costs(compute_s=0.010, client_s=0.0, server_s=0.001, update_s=0.0, hold_s=0.002)
    got = simulate(costs, 2, "hardsync", cores=100, batch_size=1)
    assert 1 / got.updates_per_s == pytest.approx(0.014, rel=1e-6)
    unheld = simulate(costs, 2, "async", cores=100, batch_size=1)  # async holds nothing
    assert unheld.updates_per_s == pytest.approx(
        simulate(replace(costs, hold_s=0.0), 2, cores=100, batch_size=1).updates_per_s
    )


def test_a_woken_process_refills_its_caches_by_the_others_work_since_it_ran():
    costs = Costs(compute_s=0.0, client_s=0.0, server_s=0.0, update_s=0.0, cold_s=0.002, cold_tau_s=0.001)
    assert costs.refill_s(0.0) == 0.0
    assert costs.refill_s(0.001) == pytest.approx(0.002 * (1 - math.exp(-1)), rel=1e-12)
    assert costs.refill_s(1.0) == pytest.approx(0.002, rel=1e-12)  # all of it, once the others ran long
    with pytest.raises(ConfigError, match="cold_tau_s"):
        Costs(compute_s=0.0, client_s=0.0, server_s=0.0, update_s=0.0, cold_s=0.001)


def test_a_cache_refill_is_paid_at_each_wake_up_only_while_processes_outnumber_cores():
    mlp_like = Costs(compute_s=0.0002, client_s=0.0002, server_s=0.0003, update_s=0.0)
    cold = replace(mlp_like, cold_s=0.0002, cold_tau_s=1e-12)  # any work of the others evicts it all
    as_switch = replace(mlp_like, switch_s=0.0002)  # the same cost, at every wake-up while another runs
    for protocol in ("async", "hardsync", "softsync"):
        got = simulate(cold, 8, protocol, cores=2, batch_size=1).updates_per_s
        assert got == pytest.approx(simulate(as_switch, 8, protocol, cores=2, batch_size=1).updates_per_s, rel=1e-3)
        assert got < 0.9 * simulate(mlp_like, 8, protocol, cores=2, batch_size=1).updates_per_s
        # a core for each of the 9 processes: nothing evicts their caches
        alone = simulate(cold, 8, protocol, cores=9, batch_size=1).updates_per_s
        assert alone == simulate(mlp_like, 8, protocol, cores=9, batch_size=1).updates_per_s


@pytest.mark.parametrize("latency, period", [(0.004, 0.010), (0.008, 0.017)])
def test_overlap_hides_the_shorter_of_compute_and_exchange_and_adds_one_update_of_staleness(latency, period):
    costs = Costs(compute_s=0.010, client_s=0.0, server_s=0.001, update_s=0.0, latency_s=latency)
    alone = simulate(costs, 1, "async", cores=4, batch_size=1, updates=400)
    assert 1 / alone.updates_per_s == pytest.approx(0.010 + 2 * latency + 0.001, rel=1e-6)
    got = simulate(costs, 1, "async", cores=4, batch_size=1, updates=400, overlap=True)
    assert 1 / got.updates_per_s == pytest.approx(period, rel=1e-6)  # max(compute, exchange)
    assert got.staleness_mean == pytest.approx(1)  # computed on the weights before the last update

"""Protocols as pure state machines: feed events, check decisions. No sockets."""

import pytest

from rudra_async import ConfigError
from rudra_async.sync import AdaptiveSoftsync, Async, Backup, Bounded, Gradient, Hardsync, Softsync


def members(proto, *ids):
    for i in ids:
        proto.join(i)
    return proto


def learners_of(batches):
    return [[g.learner for g in b] for b in batches]


def test_async_updates_on_every_gradient():
    p = members(Async(), 0, 1, 2)
    for k in range(5):
        d = p.push(Gradient(k % 3, p.clock))
        assert learners_of(d.updates) == [[k % 3]]
    assert p.clock == 5


@pytest.mark.parametrize("lam, n, c", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (7, 2, 3), (3, 5, 1)])
def test_softsync_batches_c_gradients_from_any_learner(lam, n, c):
    p = members(Softsync(n), *range(lam))
    assert p.c == c
    decisions = [p.push(Gradient(0, 0)) for _ in range(c)]  # one learner may fill a batch alone
    assert [len(d.updates) for d in decisions] == [0] * (c - 1) + [1]
    assert p.clock == 1


def test_softsync_recomputes_c_when_learners_leave():
    p = members(Softsync(1), 0, 1, 2, 3)  # c = 4
    p.push(Gradient(0, 0))
    p.push(Gradient(1, 0))
    d = p.leave(3)  # c = 3: not yet
    assert d.updates == []
    d = p.leave(2)  # c = 2: the two pending gradients are a batch now
    assert learners_of(d.updates) == [[0, 1]] and p.clock == 1


def test_hardsync_one_gradient_per_learner_and_barrier():
    p = members(Hardsync(), 0, 1, 2)
    assert p.push(Gradient(0, 0)).updates == []
    assert p.pull_floor(0) == 0  # learner 0 waits for clock > 0
    dup = p.push(Gradient(0, 0))
    assert dup.dropped and not dup.updates  # a second gradient in the round is dropped
    p.push(Gradient(1, 0))
    d = p.push(Gradient(2, 0))
    assert learners_of(d.updates) == [[0, 1, 2]] and p.clock == 1
    late = p.push(Gradient(1, 0))  # stamped with an old clock
    assert late.dropped


def test_hardsync_leaver_mid_round_does_not_deadlock():
    p = members(Hardsync(), 0, 1, 2)
    p.push(Gradient(0, 0))
    p.push(Gradient(1, 0))
    d = p.leave(2)  # killed before pushing
    assert learners_of(d.updates) == [[0, 1]]
    p.push(Gradient(0, 1))
    assert learners_of(p.push(Gradient(1, 1)).updates) == [[0, 1]]  # c follows λ = 2


def test_hardsync_leaver_that_already_pushed_still_counts():
    p = members(Hardsync(), 0, 1, 2)
    p.push(Gradient(0, 0))
    p.leave(0)
    p.push(Gradient(1, 0))
    assert learners_of(p.push(Gradient(2, 0)).updates) == [[0, 1, 2]]


def test_hardsync_joiner_is_counted_from_the_next_update():
    p = members(Hardsync(), 0, 1)
    p.push(Gradient(0, 0))
    p.join(2)  # mid-round
    assert p.pull_floor(2) < p.clock  # its first pull is answered at once: it never waits
    assert [g.learner for g in p.push(Gradient(2, 0)).dropped] == [2]  # not part of round 0
    d = p.push(Gradient(1, 0))
    assert learners_of(d.updates) == [[0, 1]]  # the round did not wait for the newcomer
    assert p.pull_floor(2) < p.clock
    p.push(Gradient(0, 1))
    p.push(Gradient(1, 1))
    assert p.clock == 1  # the next round needs the newcomer too
    assert learners_of(p.push(Gradient(2, 1)).updates) == [[0, 1, 2]]


def test_hardsync_joiner_of_a_round_without_gradients_takes_part_in_it():
    p = members(Hardsync(), 0)
    p.push(Gradient(0, 0))  # round 0 = {0}: updates at once; round 1 = {0} has no gradient yet
    p.join(1)
    assert p.pull_floor(1) < p.clock  # the newcomer computes on clock 1 at once
    assert p.push(Gradient(0, 1)).updates == []  # round 1 waits for the newcomer
    assert learners_of(p.push(Gradient(1, 1)).updates) == [[0, 1]]


def test_hardsync_shards_do_not_deadlock_when_learners_join_in_different_orders():
    """Two shards, two learners pushing to both at once: on shard a, A joined alone and its
    first gradient made an update before B joined; on shard b both joined first. B must
    get shard a's weights at once, or A waits on b for B while B waits on a for A."""
    a, b = members(Hardsync(), "A"), members(Hardsync(), "A", "B")
    a.push(Gradient("A", 0))
    a.join("B")
    b.push(Gradient("A", 0))  # waits for B's
    assert a.pull_floor("B") < a.clock  # B's first pull on shard a is answered now
    assert learners_of(b.push(Gradient("B", 0)).updates) == [["A", "B"]]
    assert a.push(Gradient("A", 1)).updates == []
    assert learners_of(a.push(Gradient("B", 1)).updates) == [["A", "B"]]


def test_hardsync_shards_do_not_deadlock_when_three_learners_join_in_crossed_orders():
    """A runs; B and C say hello to both shards while A pushes. On shard a, C comes before A's
    gradient (it takes part in the round), B after; on shard b, B before, C after. Had a
    newcomer waited for the round in progress, B would wait on a for C's gradient while C
    waited on b for B's. Newcomers never wait: every first pull is answered, each round
    completes with its participants, and the newcomers' gradients for rounds they are not
    part of are dropped."""
    a, b = members(Hardsync(), "A"), members(Hardsync(), "A")
    for shard in (a, b):  # round 0 of {A} completes; round 1 = {A}, no gradient yet
        shard.push(Gradient("A", 0))
    a.join("C")
    b.join("B")
    a.push(Gradient("A", 1))
    b.push(Gradient("A", 1))
    a.join("B")
    b.join("C")
    assert all(shard.pull_floor(who) < shard.clock for shard in (a, b) for who in "BC")  # nobody waits
    assert learners_of(b.push(Gradient("B", 1)).updates) == [["A", "B"]]
    assert [g.learner for g in a.push(Gradient("B", 1)).dropped] == ["B"]
    assert learners_of(a.push(Gradient("C", 1)).updates) == [["A", "C"]]
    assert [g.learner for g in b.push(Gradient("C", 1)).dropped] == ["C"]
    assert a.clock == b.clock == 2 and a.round == b.round == {"A", "B", "C"}


def test_hardsync_newcomer_after_everyone_left_starts_at_once():
    p = members(Hardsync(), 0)
    p.push(Gradient(0, 0))
    p.leave(0)
    p.join(1)
    p.leave(1)  # the round of {1} loses its only participant
    p.join(2)
    assert p.pull_floor(2) < p.clock  # not waiting for a round nobody will finish
    assert learners_of(p.push(Gradient(2, p.clock)).updates) == [[2]]


@pytest.mark.parametrize("make", [Async, lambda: Softsync(2), Hardsync, lambda: Backup(1), lambda: Bounded(2)])
def test_every_protocol_continues_from_a_resumed_clock(make):
    p = make()
    p.start_at(40)
    members(p, 0, 1)
    assert p.pull_floor(0) < 40 and p.pull_floor(1) < 40  # the resumed weights may be pulled
    for learner in (0, 1):
        p.pulled(learner, 40)
    updates = []
    for learner in (0, 1):
        updates += p.push(Gradient(learner, 40)).updates
    assert updates and p.clock == 40 + len(updates)
    with pytest.raises(RuntimeError, match="before any learner"):
        p.start_at(0)


def test_backup_updates_after_lambda_minus_b_and_counts_drops():
    p = members(Backup(1), 0, 1, 2, 3)
    p.push(Gradient(0, 0))
    p.push(Gradient(1, 0))
    d = p.push(Gradient(2, 0))
    assert learners_of(d.updates) == [[0, 1, 2]]
    late = p.push(Gradient(3, 0))
    assert [g.learner for g in late.dropped] == [3]
    assert p.pull_floor(3) < p.clock  # the late learner gets the new weights at once


@pytest.mark.parametrize("s", [0, 1, 3])
def test_bounded_never_applies_staler_than_s(s):
    """Four learners at different speeds; every applied gradient has σ ≤ s."""
    p = members(Bounded(s), 0, 1, 2, 3)
    speed = {0: 1, 1: 1, 2: 2, 3: 5}  # ticks per gradient
    stamp = {i: 0 for i in speed}
    for i in speed:
        p.pulled(i, 0)
    due = {i: speed[i] for i in speed}
    held = set()
    applied_sigmas = []
    for tick in range(1, 200):
        for i in sorted(speed):
            if i in held or due[i] != tick:
                continue
            d = p.push(Gradient(i, stamp[i]))
            held.add(i)
            for batch in d.updates:
                clock = p.clock - len(d.updates) + d.updates.index(batch)
                applied_sigmas += [clock - g.stamp for g in batch]
                for g in batch:  # applied: its learner gets the newest weights
                    held.discard(g.learner)
            for j in list(speed):
                if j not in held and due[j] <= tick:
                    stamp[j] = p.clock
                    p.pulled(j, p.clock)
                    due[j] = tick + speed[j]
    assert applied_sigmas and max(applied_sigmas) <= s
    assert p.clock > 30  # and it made progress: no deadlock


def test_bounded_drops_a_gradient_that_arrives_staler_than_s():
    """Learner 1 computed on θ_0 without the protocol knowing (its weights were still on
    their way, or it overlaps its exchanges): by the time its gradient arrives the clock is 3,
    so applying it would break the bound (σ = 3 > s = 1). It is dropped, not applied."""
    p = members(Bounded(1), 0, 1)
    for t in range(3):
        p.pulled(0, t)
        assert learners_of(p.push(Gradient(0, t)).updates) == [[0]]
    late = p.push(Gradient(1, 0))
    assert late.updates == [] and [g.learner for g in late.dropped] == [1] and p.clock == 3
    assert learners_of(p.push(Gradient(1, 2)).updates) == [[1]]  # σ = 1: applied


def test_bounded_zero_is_a_barrier_not_a_deadlock():
    p = members(Bounded(0), 0, 1)
    p.pulled(0, 0)
    p.pulled(1, 0)
    d = p.push(Gradient(0, 0))
    assert d.updates == [] and d.wait_applied
    d = p.push(Gradient(1, 0))
    assert learners_of(d.updates) == [[0, 1]]


def test_bounded_leaver_unblocks_the_held():
    p = members(Bounded(1), 0, 1, 2)
    for i in range(3):
        p.pulled(i, 0)
    assert learners_of(p.push(Gradient(0, 0)).updates) == [[0]]  # clock 1: learner 2 at σ 1
    p.pulled(0, 1)
    assert p.push(Gradient(0, 1)).updates == []  # would leave learners 1, 2 at σ 2: held
    d = p.leave(1)
    assert d.updates == []  # learner 2 still computing on 0
    d = p.leave(2)
    assert learners_of(d.updates) == [[0]]


@pytest.mark.parametrize("make", [lambda: Softsync(0), lambda: Bounded(-1), lambda: Backup(-1)])
def test_invalid_parameters(make):
    with pytest.raises(ConfigError):
        make()


def round_robin(proto, lam, pushes):
    """λ learners pushing in turn, each on the weights it got with its last reply (softsync
    answers at once). The σ of every gradient applied, in update order."""
    members(proto, *range(lam))
    stamp = dict.fromkeys(range(lam), 0)
    sigmas = []
    turn = 0
    while len(sigmas) < pushes:
        learner = turn % lam
        turn += 1
        clock = proto.clock
        decision = proto.push(Gradient(learner, stamp[learner]))
        for k, batch in enumerate(decision.updates):
            sigmas += [clock + k - g.stamp for g in batch]
        stamp[learner] = proto.clock
    return sigmas


@pytest.mark.parametrize("target", [1, 3, 6])
def test_adaptive_softsync_steers_its_n_until_the_mean_staleness_is_in_the_target_band(target):
    proto = AdaptiveSoftsync(target)
    sigmas = round_robin(proto, 12, 4000)
    late = sigmas[-AdaptiveSoftsync.WINDOW * 4 :]
    assert abs(sum(late) / len(late) - target) <= AdaptiveSoftsync.BAND * target
    assert proto.trajectory[0] == (0, int(target + 1.5))
    assert [n for _, n in proto.trajectory] == [n for _, n in sorted(proto.trajectory)]  # in clock order
    assert proto.statistics() == {"n_trajectory": [list(p) for p in proto.trajectory]}
    assert proto.describe() == {"protocol": "adaptive", "n": proto.n, "staleness_target": float(target)}


def test_adaptive_softsync_decides_only_at_the_end_of_a_window_and_by_the_documented_rule():
    proto = AdaptiveSoftsync(1.0)  # n starts at 2: c = 8 of λ = 16, σ ≈ 1
    assert proto.n == 2
    members(proto, *range(16))
    for _ in range(AdaptiveSoftsync.WINDOW - 1):  # every gradient of the window 6 updates stale
        for learner in range(proto.c):
            proto.push(Gradient(learner, max(0, proto.clock - 6)))
    assert proto.n == 2 and proto.clock == AdaptiveSoftsync.WINDOW - 1
    stamps = [max(0, proto.clock - 6)] * proto.c
    for learner, stamp in enumerate(stamps):
        proto.push(Gradient(learner, stamp))
    # the window's mean σ m: 6 but for the first updates' smaller σ (stamps clipped at 0)
    sigmas = [min(6, t) for t in range(AdaptiveSoftsync.WINDOW)]
    mean = sum(sigmas) / len(sigmas)
    clock = AdaptiveSoftsync.WINDOW
    assert proto.n == max(1, int(2 * 1.0 / mean + 0.5)) == 1
    assert proto.trajectory == [(0, 2), (clock, 1)]


def test_adaptive_softsync_refuses_a_bad_target():
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            AdaptiveSoftsync(bad)

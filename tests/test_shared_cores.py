"""Processor sharing and wake-up latency (schedules.shared_cores) against hand computation."""
from __future__ import annotations

import random

import pytest

import schedules
from schedules.cluster import Cluster
from schedules.hybrid import StageWork, simulate_hybrid
from schedules.overheads import RuntimeOverheads
from schedules.simulate import simulate_shared

GPIPE_2x2 = schedules.build("gpipe", 2, 2)  # 0: F0 F1 B0 B1; 1: F0 F1 B0 B1 (with messages)


def test_two_stages_on_one_core_share_it_by_hand():
    r = simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1)[0]
    # 0-1 stage 0 F0 alone; 1-3 stage 0 F1 and stage 1 F0 at half speed; 3-4 stage 1 F1 alone;
    # 4-6 its B0 alone; 6-10 stage 0 B0 and stage 1 B1 at half speed; 10-12 stage 0 B1 alone
    computes = lambda k: [i for i, a in enumerate(GPIPE_2x2.actions[k]) if a.kind.value in "FB"]  # noqa: E731
    spans = lambda k: [t for i in computes(k) for t in (r.start[k][i], r.end[k][i])]  # noqa: E731
    assert spans(0) == pytest.approx([0, 1, 1, 3, 6, 10, 10, 12])
    assert spans(1) == pytest.approx([1, 3, 3, 4, 4, 6, 6, 10])
    assert r.makespan == pytest.approx(12.0)  # the one core never idles: all 12 s of work
    own = simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=2)[0]
    assert own.makespan == pytest.approx(3 * 3.0)  # (m + p - 1)(f + b) with a core each


def test_wakeup_delays_a_sleeping_receiver_only_while_the_cores_are_busy_by_hand():
    r = simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1, wakeup=0.5)[0]
    f0_1 = GPIPE_2x2.actions[1].index(schedules.Action.parse("F0", 1))
    b0_0 = GPIPE_2x2.actions[0].index(schedules.Action.parse("B0", 0))
    b1_0 = GPIPE_2x2.actions[0].index(schedules.Action.parse("B1", 0))
    # act 0 arrives at 1 while stage 0 runs F1 on the only core: stage 1 starts at 1.5; then
    # F1 of stage 0 (0.5 left) and F0 of stage 1 share the core until 2.5
    assert r.start[1][f0_1] == pytest.approx(1.5) and r.end[1][f0_1] == pytest.approx(3.0)
    # grad 0 arrives at 6 while stage 1 runs B1: stage 0 wakes at 6.5
    assert r.start[0][b0_0] == pytest.approx(6.5)
    # grad 1 arrives at 9.5 while stage 0 is still busy (awake): no wake-up to pay
    assert r.start[0][b1_0] == pytest.approx(10.0)
    own = simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=2, wakeup=0.5)[0]
    assert own.makespan == pytest.approx(9.0)  # never more running than cores: nothing waits


@pytest.mark.parametrize("kind,options", [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {}),
                                          ("zb-h1", {}), ("async-1f1b", {"mini_batches": 3})])
def test_enough_cores_reproduce_simulate(kind, options):
    rng = random.Random(kind)
    p = 4
    sched = schedules.build(kind, p, 8, **options)
    costs = schedules.Costs([rng.uniform(0.5, 2) for _ in range(p)], [rng.uniform(1, 3) for _ in range(p)],
                            weight=[rng.uniform(0, 1) for _ in range(p)], comm=[rng.uniform(0, 0.3) for _ in range(p)])
    ref = schedules.simulate(sched, costs)
    for got in simulate_shared(sched, costs, [[0, 0, 1, 1], [1, 1, 0, 0]], cores=4, wakeup=0.7):
        assert got.makespan == pytest.approx(ref.makespan)
        for k in range(p):
            assert got.start[k] == pytest.approx(ref.start[k]) and got.end[k] == pytest.approx(ref.end[k])
        assert got.utilisation == pytest.approx(ref.utilisation)


def _cluster(cores, **overheads) -> Cluster:
    return Cluster(nodes=1, devices_per_node=4, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                   inter_latency=0.0, cores=cores, overheads=RuntimeOverheads(**overheads))


def test_hybrid_without_cores_is_unchanged_and_with_enough_cores_equal():
    work = [StageWork(1.0, 2.0, grad_bytes=(1e6,), update=0.1), StageWork(1.5, 2.5, grad_bytes=(2e6,), update=0.2)]
    old = simulate_hybrid(work, _cluster(None, step=0.3), replicas=2, micro_batches=4)
    assert old.pipeline_time == schedules.simulate(schedules.build("1f1b", 2, 4),
                                                   schedules.Costs([1.0, 1.5], [2.0, 2.5])).makespan
    same = simulate_hybrid(work, _cluster(4, step=0.3), replicas=2, micro_batches=4)
    assert same.step_time == pytest.approx(old.step_time)
    assert same.reduction_exposed == pytest.approx(old.reduction_exposed)


def test_hybrid_replicas_share_the_node_and_the_tail_by_hand():
    # two replicas of a one-stage pipeline on one core: each runs F and B at half speed
    work = [StageWork(1.0, 2.0, update=0.25)]
    r = simulate_hybrid(work, _cluster(1, step=0.1), replicas=2, micro_batches=1)
    assert r.pipeline_time == pytest.approx(6.0)
    # both ranks' optimizer update and the fixed step work share the core too: x 2
    assert r.step_time == pytest.approx(6.0 + 2 * 0.25 + 2 * 0.1)


def test_bad_cores_and_wakeup_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="Cluster.cores"):
        _cluster(0)
    with pytest.raises(ValueError, match="Cluster.wakeup"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, cores=2, wakeup=-1.0)
    with pytest.raises(ValueError, match="set Cluster.cores"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, wakeup=1e-3)
    with pytest.raises(ValueError, match="cores > 0"):
        simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=0)
    round_trip = Cluster(1, 4, 1e9, 0.0, 1e9, 0.0, cores=1.5, wakeup=2e-3)
    assert Cluster.from_json(round_trip.to_json()) == round_trip

"""Processor sharing and wake-up latency (schedules.cluster.shared_cores) against hand computation."""
from __future__ import annotations

import random

import pytest

import schedules
from schedules.cluster import Cluster
from schedules.cluster.step import StageWork, simulate_cluster_step
from schedules.cluster.overheads import RuntimeOverheads
from schedules.cluster.shared_cores import simulate_shared

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


def test_message_cpu_occupies_the_senders_and_the_receivers_core_by_hand():
    A = schedules.ActionKind
    send = [{A.SEND_ACT: 0.5, A.SEND_GRAD: 0.5}] * 2
    take = [{A.FORWARD: 0.25, A.BACKWARD: 0.25}] * 2
    r = simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1, send_cpu=send, recv_cpu=take)[0]
    at = lambda k, text: GPIPE_2x2.actions[k].index(schedules.Action.parse(text, k))  # noqa: E731
    span = lambda k, *texts: [t for x in texts for t in (r.start[k][at(k, x)], r.end[k][at(k, x)])]  # noqa: E731
    # 0-1 F0; 1-1.5 SEND_ACT0 alone; 1.5-2 stage 1 takes act 0 (0.25) beside F1 at half speed;
    # 2-3.5 F1 (0.75 left) and stage 1 F0 share; 3.5-4 F0 (0.25 left) and SEND_ACT1; 4-4.25 the
    # send alone; stage 1 takes act 1 until 4.5, F1 4.5-5.5, B0 5.5-7.5, SEND_GRAD0 7.5-8
    assert span(0, "F0", "SEND_ACT0", "F1", "SEND_ACT1") == pytest.approx([0, 1, 1, 1.5, 1.5, 3.5, 3.5, 4.25])
    assert span(1, "F0", "F1", "B0", "SEND_GRAD0") == pytest.approx([2, 4, 4.5, 5.5, 5.5, 7.5, 7.5, 8])
    # 8-8.5 stage 0 takes grad 0 beside B1; 8.5-12 B0 and B1 (1.75 left) share; 12-12.5 B0 (0.25
    # left) and SEND_GRAD1; 12.5-12.75 the send alone; 12.75-13 stage 0 takes it; B1 13-15
    assert span(1, "B1", "SEND_GRAD1") == pytest.approx([8, 12, 12, 12.75])
    assert span(0, "B0", "B1") == pytest.approx([8.5, 12.5, 13, 15])
    assert r.makespan == pytest.approx(12.0 + 4 * (0.5 + 0.25))  # the one core never idles
    assert r.utilisation[0] == pytest.approx(6.0 / 15.0)  # busy counts compute, not message CPU


def test_hybrid_charges_message_cpu_by_bytes_by_hand():
    # 2 stages x 1 micro-batch on one core, 1000 B each way: send 0.1 + 1000 x 1e-4 = 0.2 and
    # receive 0.05 + 1000 x 5e-5 = 0.1 of CPU per message; nothing overlaps, so all adds up
    work = [StageWork(1.0, 2.0, send_bytes=1000.0), StageWork(1.0, 2.0)]
    cluster = Cluster(nodes=1, devices_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                      inter_latency=0.0, cores=1, send_cpu=0.1, send_cpu_byte=1e-4, recv_cpu=0.05,
                      recv_cpu_byte=5e-5)
    assert cluster.message_cpu(1000.0) == pytest.approx((0.2, 0.1))
    r = simulate_cluster_step(work, cluster, micro_batches=1, schedule="gpipe")
    assert r.pipeline_time == pytest.approx(6.0 + 2 * (0.2 + 0.1))


def test_interference_scales_module_compute_not_overheads_by_hand():
    # 2 stages x 2 micro-batches (gpipe) on one core, f = 1, b = 2, action 0.25, interference 1.5:
    # each F is 1.5 + 0.25 = 1.75 and each B 3 + 0.25 = 3.25 of work; the one core never idles
    # (stage 1 waits only for stage 0's first F), so the pipeline is all 4 x (1.75 + 3.25) = 20
    work = [StageWork(1.0, 2.0), StageWork(1.0, 2.0)]
    base = dict(nodes=1, devices_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                inter_latency=0.0, cores=1, overheads=RuntimeOverheads(action=0.25))
    r = simulate_cluster_step(work, Cluster(**base, interference=1.5), micro_batches=2, schedule="gpipe")
    assert r.pipeline_time == pytest.approx(20.0)
    assert simulate_cluster_step(work, Cluster(**base), micro_batches=2, schedule="gpipe").pipeline_time == \
        pytest.approx(4 * (1.25 + 2.25))  # interference 1 (default): the profiled compute
    # with a core each: (m + p - 1)(F + B) = 3 x (1.75 + 3.25)
    own = simulate_cluster_step(work, Cluster(**{**base, "cores": 2}, interference=1.5), micro_batches=2, schedule="gpipe")
    assert own.pipeline_time == pytest.approx(15.0)


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
    old = simulate_cluster_step(work, _cluster(None, step=0.3), replicas=2, micro_batches=4)
    assert old.pipeline_time == schedules.simulate(schedules.build("1f1b", 2, 4),
                                                   schedules.Costs([1.0, 1.5], [2.0, 2.5])).makespan
    same = simulate_cluster_step(work, _cluster(4, step=0.3), replicas=2, micro_batches=4)
    assert same.step_time == pytest.approx(old.step_time)
    assert same.reduction_exposed == pytest.approx(old.reduction_exposed)


def test_hybrid_replicas_share_the_node_and_the_tail_by_hand():
    # two replicas of a one-stage pipeline on one core: each runs F and B at half speed
    work = [StageWork(1.0, 2.0, update=0.25)]
    r = simulate_cluster_step(work, _cluster(1, step=0.1), replicas=2, micro_batches=1)
    assert r.pipeline_time == pytest.approx(6.0)
    # both ranks' optimizer update and the fixed step work share the core too: x 2
    assert r.step_time == pytest.approx(6.0 + 2 * 0.25 + 2 * 0.1)


def test_reduce_cpu_occupies_the_devices_core_by_hand():
    plan = schedules.with_reductions(schedules.build("gpipe", 2, 2))  # ... B0 B1 REDUCE0 STEP0 on each stage
    r = simulate_shared(plan, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1, reduce_cpu=[1.0, 0.5])[0]
    at = lambda k, text: plan.actions[k].index(schedules.Action.parse(text, k))  # noqa: E731
    span = lambda k, text: (r.start[k][at(k, text)], r.end[k][at(k, text)])  # noqa: E731
    # as in the first test until 10; then stage 1's REDUCE (0.5) and stage 0's B1 (2 left) share
    # the core until 11; B1 (1.5 left) alone until 12.5; stage 0's REDUCE (1.0) alone until 13.5
    assert span(1, "REDUCE0") == pytest.approx((10.0, 11.0))
    assert span(0, "B1") == pytest.approx((10.0, 12.5))
    assert span(0, "REDUCE0") == pytest.approx((12.5, 13.5))
    assert r.makespan == pytest.approx(12.0 + 1.5)  # the one core never idles
    with pytest.raises(ValueError, match="reduce_cpu as seconds"):
        simulate_shared(plan, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1, reduce_cpu=[-1.0, 0.0])


def test_hybrid_charges_the_reducers_cpu_on_the_shared_core_by_hand():
    # two replicas of a one-stage pipeline on one core, 1000 B of gradients: each rank's reducer
    # works reduce_call + 1000 x reduce_byte = 0.2 s, both at once on the core: 0.4 s; then the
    # 2-rank ring moves 2 x 1/2 x 1000 B at 1e9 B/s
    work = [StageWork(1.0, 2.0, grad_bytes=(1000.0,), update=0.25)]
    cluster = Cluster(nodes=1, devices_per_node=2, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                      inter_latency=0.0, cores=1, overheads=RuntimeOverheads(step=0.1, reduce_call=0.1,
                                                                             reduce_byte=1e-4))
    r = simulate_cluster_step(work, cluster, replicas=2, micro_batches=1)
    assert r.pipeline_time == pytest.approx(6.0 + 0.4)
    assert r.reduction_exposed == pytest.approx([0.4 + 1e-6])
    assert r.step_time == pytest.approx(6.0 + 0.4 + 1e-6 + 2 * 0.25 + 2 * 0.1)


def test_bad_cores_and_wakeup_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="Cluster.cores"):
        _cluster(0)
    with pytest.raises(ValueError, match="Cluster.wakeup"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, cores=2, wakeup=-1.0)
    with pytest.raises(ValueError, match="set Cluster.cores"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, wakeup=1e-3)
    with pytest.raises(ValueError, match="cores > 0"):
        simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=0)
    with pytest.raises(ValueError, match="Cluster.send_cpu_byte"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, cores=2, send_cpu_byte=-1e-9)
    with pytest.raises(ValueError, match="recv_cpu only applies.*set Cluster.cores"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, recv_cpu=1e-4)
    with pytest.raises(ValueError, match="send_cpu as one dict"):
        simulate_shared(GPIPE_2x2, schedules.Costs(1.0, 2.0), [[0, 0]], cores=1, send_cpu=[{}])
    with pytest.raises(ValueError, match="Cluster.interference must be a finite number >= 1"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, cores=2, interference=0.9)
    with pytest.raises(ValueError, match="interference only applies.*set Cluster.cores"):
        Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, interference=1.2)
    round_trip = Cluster(1, 4, 1e9, 0.0, 1e9, 0.0, cores=1.5, wakeup=2e-3, send_cpu=1e-4, recv_cpu_byte=1e-9,
                         interference=1.2)
    assert Cluster.from_json(round_trip.to_json()) == round_trip

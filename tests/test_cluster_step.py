"""simulate_cluster_step: pipeline makespan plus data-parallel reduction, against hand computation."""
from __future__ import annotations

import pytest

import schedules
from schedules.cluster import Cluster
from schedules.cluster.reductions import Reduction, ring_allreduce_time
from schedules.cluster.step import StageWork, simulate_cluster_step

ONE_NODE = Cluster(nodes=1, devices_per_node=8, intra_bandwidth=1e9, intra_latency=1e-3,
                   inter_bandwidth=1e8, inter_latency=1e-2)


def test_one_replica_is_the_pipeline_and_efficiency_by_hand():
    work = [StageWork(1.0, 2.0), StageWork(1.0, 2.0)]
    r = simulate_cluster_step(work, ONE_NODE, micro_batches=4, schedule="gpipe")
    # GPipe, free messages: (m + p - 1) (f + b) = 5 x 3 = 15; one device: 4 x 6 = 24
    assert r.step_time == pytest.approx(15.0 + 2 * 1e-3)  # one latency each way on the critical path
    assert r.single_device_time == pytest.approx(24.0)
    assert r.scaling_efficiency == pytest.approx(24.0 / (2 * r.step_time))
    assert r.reduction_exposed == [0.0, 0.0]


def test_pipeline_messages_pay_the_link_they_cross():
    one_per_node = Cluster(nodes=2, devices_per_node=1, intra_bandwidth=1e9, intra_latency=0.0,
                           inter_bandwidth=1e6, inter_latency=0.5)
    work = [StageWork(1.0, 2.0, send_bytes=1e6), StageWork(1.0, 2.0)]
    r = simulate_cluster_step(work, one_per_node, micro_batches=1)
    # F0, send (0.5 s + 1 MB / 1 MB/s), F1 B1, gradient back (same), B0
    assert r.step_time == pytest.approx(1.0 + 1.5 + 3.0 + 1.5 + 2.0)


def test_data_parallel_without_overlap_adds_the_ring_by_hand():
    grads = (4e6, 4e6)
    work = [StageWork(0.1, 0.2, grad_bytes=grads)]
    r = simulate_cluster_step(work, ONE_NODE, replicas=4, micro_batches=2)
    ring = ring_allreduce_time(4e6, 4, 1e9, 1e-3)
    assert r.step_time == pytest.approx(2 * 0.3 + 2 * ring)
    assert r.reduction_exposed[0] == pytest.approx(2 * ring)
    fused = simulate_cluster_step(work, ONE_NODE, replicas=4, micro_batches=2, reduction=Reduction(bucket_bytes=1e9))
    assert fused.step_time == pytest.approx(0.6 + ring_allreduce_time(8e6, 4, 1e9, 1e-3))


def test_overlap_hides_the_first_buckets_behind_the_last_backward():
    work = [StageWork(0.1, 0.2, grad_bytes=(4e6, 4e6), ready_fraction=(0.5, 1.0))]
    r = simulate_cluster_step(work, ONE_NODE, replicas=4, micro_batches=1, reduction=Reduction(overlap=True))
    ring = ring_allreduce_time(4e6, 4, 1e9, 1e-3)
    # first tensor starts at 0.1 + 0.1 (half the backward), second at max(0.3, that + ring)
    assert r.step_time == pytest.approx(max(0.3, 0.2 + ring) + ring)


def test_zero_bubble_by_hand():
    free = Cluster(nodes=1, devices_per_node=8, intra_bandwidth=1e9, intra_latency=0.0, inter_bandwidth=1e9,
                   inter_latency=0.0)
    work = [StageWork(1.0, 2.0)] * 4  # forward 1; backward 2 = input-gradient 1 + weight-gradient 1
    # 1F1B: (m + p - 1)(f + b) = 11 x 3; ZB-H1 with F = B = W: 3m + p - 1 (W fills the drain bubble)
    assert simulate_cluster_step(work, free, micro_batches=8, schedule="1f1b").step_time == pytest.approx(33.0)
    assert simulate_cluster_step(work, free, micro_batches=8, schedule="zb-h1").step_time == pytest.approx(27.0)
    # a backward that cannot be split is 1F1B again
    whole = [StageWork(1.0, 2.0, weight_fraction=0.0)] * 4
    assert simulate_cluster_step(whole, free, micro_batches=8, schedule="zb-h1").step_time == pytest.approx(33.0)
    # with replicas the reduction waits for the last W even when asked to overlap (as the runtime does)
    grads = [StageWork(0.1, 0.2, grad_bytes=(4e6, 4e6), ready_fraction=(0.5, 1.0))]
    r = simulate_cluster_step(grads, ONE_NODE, replicas=4, micro_batches=1, schedule="zb-h1",
                        reduction=Reduction(overlap=True))
    assert r.step_time == pytest.approx(0.3 + 2 * ring_allreduce_time(4e6, 4, 1e9, 1e-3))


def test_stage_groups_follow_the_rank_layout():
    """2 stages x 2 replicas on nodes of 2: a pipeline per node, so each stage reduces across nodes."""
    cluster = Cluster(nodes=2, devices_per_node=2, intra_bandwidth=1e9, intra_latency=0.0,
                      inter_bandwidth=1e8, inter_latency=1e-2)
    work = [StageWork(1.0, 1.0, grad_bytes=(1e6,)), StageWork(1.0, 1.0, grad_bytes=(1e6,))]
    r = simulate_cluster_step(work, cluster, replicas=2, micro_batches=1, schedule="1f1b")
    pipeline = schedules.simulate(schedules.build("1f1b", 2, 1), schedules.Costs(1.0, 1.0)).makespan
    inter_ring = ring_allreduce_time(1e6, 2, 1e8, 1e-2)
    assert r.pipeline_time == pytest.approx(pipeline)
    assert r.step_time == pytest.approx(pipeline + inter_ring)  # stage 0's backward ends last
    assert r.devices == 4


def test_speed_divides_compute_and_memory_counts_in_flight():
    work = [StageWork(1.0, 2.0, memory=100.0, activation_memory=10.0)] * 2
    fast = simulate_cluster_step(work, Cluster(1, 2, 1e9, 0.0, 1e9, 0.0, speed=2.0), micro_batches=4,
                           schedule="gpipe")
    assert fast.step_time == pytest.approx(7.5)
    assert fast.memory == [140.0, 140.0]  # GPipe holds all 4 micro-batches
    onefb = simulate_cluster_step(work, Cluster(1, 2, 1e9, 0.0, 1e9, 0.0), micro_batches=4)
    assert onefb.memory == [120.0, 110.0]  # 1F1B: p - k in flight


def test_bad_requests():
    work = [StageWork(1.0, 1.0)] * 2
    with pytest.raises(ValueError, match="devices"):
        simulate_cluster_step(work, ONE_NODE, replicas=5)
    with pytest.raises(ValueError, match="supports schedules"):
        simulate_cluster_step(work, ONE_NODE, schedule="async-1f1b")
    with pytest.raises(ValueError, match="ready fractions"):
        simulate_cluster_step([StageWork(1.0, 1.0, grad_bytes=(1.0,), ready_fraction=(0.5, 1.0))], ONE_NODE,
                        replicas=2)

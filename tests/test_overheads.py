"""Runtime overhead terms of the cost model (schedules.cluster.overheads) against hand computation."""
from __future__ import annotations

import json

import pytest

from schedules.cluster import Cluster
from schedules.cluster.reductions import Group, Reduction, reduction_finish, ring_allreduce_time
from schedules.cluster.step import StageWork, simulate_cluster_step
from schedules.cluster.overheads import RuntimeOverheads, contention


def _cluster(**overheads: float) -> Cluster:
    return Cluster(nodes=1, devices_per_node=4, intra_bandwidth=1e9, intra_latency=1e-3, inter_bandwidth=1e9,
                   inter_latency=1e-3, overheads=RuntimeOverheads(**overheads))


def test_action_overhead_is_paid_by_every_forward_and_backward_by_hand():
    work = [StageWork(1.0, 2.0), StageWork(1.0, 2.0)]
    r = simulate_cluster_step(work, _cluster(action=0.5), micro_batches=4, schedule="gpipe")
    # GPipe, (m + p - 1) (f + b) with f = 1.5, b = 2.5, plus one latency each way
    assert r.step_time == pytest.approx(5 * 4.0 + 2e-3)
    assert r.step_overhead == 0.0


def test_step_cost_update_and_report_allreduce_by_hand():
    work = [StageWork(1.0, 2.0, update=0.25), StageWork(1.0, 2.0, update=0.5)]
    r = simulate_cluster_step(work, _cluster(step=0.1, report_bytes=8e3), replicas=2, micro_batches=1,
                        schedule="1f1b")
    # F0, msg, F1 B1 (stage 1 ends at 4.001 + update 0.5), msg, B0 ends at 6.002 + update 0.25
    report = ring_allreduce_time(8e3, 4, 1e9, 1e-3)  # over all 2 x 2 ranks of the job
    assert r.step_overhead == pytest.approx(0.1 + report)
    assert r.step_time == pytest.approx(6.002 + 0.25 + 0.1 + report)
    # one device: every micro-batch of both replicas plus one optimizer step over all parameters
    assert r.single_device_time == pytest.approx(2 * 6.0 + 0.75)


def test_reduction_pays_the_runtime_cost_per_bucket_by_hand():
    cluster = _cluster(reduce_call=0.01, reduce_byte=1e-9)
    group = Group(1, 4)
    ring = lambda n: ring_allreduce_time(n, 4, 1e9, 1e-3)  # noqa: E731
    sizes, ready = [1e6, 2e6], [1.0, 2.0]
    # per tensor: two buckets, each pays 0.01 s + its bytes x 1 ns
    assert reduction_finish(sizes, ready, group, cluster, Reduction()) == pytest.approx(
        2.0 + ring(1e6) + 0.01 + 1e-3 + ring(2e6) + 0.01 + 2e-3)
    # fused: one bucket of 3 MB
    assert reduction_finish(sizes, ready, group, cluster, Reduction(bucket_bytes=1e9)) == pytest.approx(
        2.0 + ring(3e6) + 0.01 + 3e-3)
    # one rank reduces nothing, so no runtime cost either
    assert reduction_finish(sizes, ready, Group(1, 1), cluster, Reduction()) == 2.0


def test_zero_overheads_change_nothing():
    work = [StageWork(1.0, 2.0, grad_bytes=(1e6,)), StageWork(1.0, 2.0, grad_bytes=(1e6,))]
    bare = Cluster(nodes=1, devices_per_node=4, intra_bandwidth=1e9, intra_latency=1e-3,
                   inter_bandwidth=1e9, inter_latency=1e-3)
    a = simulate_cluster_step(work, bare, replicas=2, micro_batches=4)
    b = simulate_cluster_step(work, _cluster(), replicas=2, micro_batches=4)
    assert a.step_time == b.step_time and a.step_overhead == 0.0


def test_overheads_round_trip_through_cluster_json():
    cluster = _cluster(action=2e-4, step=1e-3, report_bytes=80.0, reduce_call=5e-4, reduce_byte=1e-9)
    assert Cluster.from_json(cluster.to_json()) == cluster
    # JSON written before overheads existed still loads, with zero overheads
    old = json.loads(cluster.to_json())
    del old["overheads"]
    assert Cluster.from_json(json.dumps(old)).overheads == RuntimeOverheads()


def test_bad_overheads_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="RuntimeOverheads.action"):
        RuntimeOverheads(action=-1.0)
    with pytest.raises(ValueError, match="RuntimeOverheads.step"):
        RuntimeOverheads(step=float("nan"))
    with pytest.raises(ValueError, match="unknown overhead key"):
        RuntimeOverheads.from_dict({"latency": 1.0})
    with pytest.raises(TypeError, match="Cluster.overheads"):
        Cluster(1, 1, 1e9, 0.0, 1e9, 0.0, overheads={"action": 1.0})


def test_contention_is_fair_sharing_by_hand():
    assert contention(1, 2) == 1.0
    assert contention(2, 2) == 1.0
    assert contention(4, 2) == 2.0
    assert contention(3, 2) == 1.5
    with pytest.raises(ValueError, match="processes > 0"):
        contention(0, 2)

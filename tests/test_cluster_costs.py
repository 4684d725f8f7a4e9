"""Cluster description and all-reduce cost formulas against hand computation."""
from __future__ import annotations

import json
import random

import pytest

from schedules.cluster import GBIT, PRESETS, Cluster, load_cluster
from schedules.cluster.reductions import (Group, Reduction, allreduce_time, buckets, flat_allreduce_time, prefers_hierarchical,
                                        hierarchical_allreduce_time, reduction_finish, report_time,
                                        ring_allreduce_time)

TWO_NODES = Cluster(nodes=2, devices_per_node=4, intra_bandwidth=10e9, intra_latency=1e-6,
                    inter_bandwidth=1e9, inter_latency=1e-5)


def test_ring_allreduce_by_hand():
    # 2 (p-1) alpha + 2 (p-1)/p n / beta with p=4, n=8 MB, beta=1 GB/s, alpha=10 us
    assert ring_allreduce_time(8e6, 4, 1e9, 1e-5) == pytest.approx(6e-5 + 1.5 * 8e-3)
    assert ring_allreduce_time(8e6, 1, 1e9, 1e-5) == 0.0
    assert ring_allreduce_time(0.0, 2, 1e9, 1e-5) == pytest.approx(2e-5)


def test_flat_ring_across_nodes_pays_the_slow_link_by_hand():
    group = Group(nodes=2, per_node=4)
    n = 4e6
    assert flat_allreduce_time(n, group, TWO_NODES) == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * n / 1e9)
    inside = Group(nodes=1, per_node=4)
    assert flat_allreduce_time(n, inside, TWO_NODES) == pytest.approx(2 * 3 * 1e-6 + 2 * 3 / 4 * n / 10e9)


def test_hierarchical_by_hand():
    n = 4e6
    expected = (2 * 3 * 1e-6 + 2 * 3 / 4 * n / 10e9) + (2 * 1 * 1e-5 + 2 * 1 / 2 * n / 1e9)
    assert hierarchical_allreduce_time(n, Group(2, 4), TWO_NODES) == pytest.approx(expected)
    # one rank per node: only the inter-node ring; one node: only the intra-node ring
    assert hierarchical_allreduce_time(n, Group(2, 1), TWO_NODES) == pytest.approx(2e-5 + n / 1e9)
    assert allreduce_time(n, Group(1, 4), TWO_NODES, True) == pytest.approx(
        allreduce_time(n, Group(1, 4), TWO_NODES, False))


def test_group_of_ranks():
    assert Group.of_ranks([0, 1, 2, 3, 4, 5, 6, 7], TWO_NODES) == Group(2, 4)
    assert Group.of_ranks([1, 5], TWO_NODES) == Group(2, 1)
    assert Group.of_ranks([0, 2], TWO_NODES) == Group(1, 2)


def test_buckets_pack_until_the_threshold():
    assert buckets([3, 3, 3, 3, 3], 6) == [[0, 1], [2, 3], [4]]
    assert buckets([10, 1, 1], 5) == [[0], [1, 2]]
    assert buckets([1, 2], None) == [[0], [1]]


def test_reduction_finish_by_hand():
    group = Group(1, 4)
    c = lambda n: ring_allreduce_time(n, 4, 10e9, 1e-6)  # noqa: E731
    sizes, ready = [1e6, 2e6], [1.0, 2.0]
    # per tensor, overlapped: first starts at 1.0, second at max(2.0, 1.0 + c1)
    assert reduction_finish(sizes, ready, group, TWO_NODES, Reduction(overlap=True)) == pytest.approx(
        max(2.0, 1.0 + c(1e6)) + c(2e6))
    # not overlapped: both after 2.0, one after the other
    assert reduction_finish(sizes, ready, group, TWO_NODES, Reduction()) == pytest.approx(2.0 + c(1e6) + c(2e6))
    # fused: one message of 3 MB at 2.0
    assert reduction_finish(sizes, ready, group, TWO_NODES, Reduction(bucket_bytes=1e9)) == pytest.approx(
        2.0 + c(3e6))
    # a single rank reduces nothing
    assert reduction_finish(sizes, ready, Group(1, 1), TWO_NODES, Reduction()) == 2.0
    with pytest.raises(ValueError, match="ready times"):
        reduction_finish(sizes, [1.0], group, TWO_NODES, Reduction())


def _latency_bound_cases(count: int):
    """Random clusters where messages cost latency only (huge bandwidth), intra <= inter latency."""
    rng = random.Random(0)
    for _ in range(count):
        inter = rng.uniform(1e-6, 1e-4)
        cluster = Cluster(nodes=rng.randint(1, 16), devices_per_node=rng.choice([1, 2, 4, 8]),
                          intra_bandwidth=1e30, intra_latency=inter * rng.uniform(0.0, 1.0),
                          inter_bandwidth=1e30, inter_latency=inter)
        sizes = [rng.uniform(1e3, 1e7) for _ in range(rng.randint(1, 40))]
        ready = sorted(rng.uniform(0.0, 1e-2) for _ in sizes)
        yield cluster, sizes, ready, rng.uniform(1e4, 1e8)


@pytest.mark.parametrize("overlap", [False, True])
def test_fusion_and_hierarchy_never_slower_than_flat_per_tensor_when_latency_dominates(overlap):
    for cluster, sizes, ready, bucket in _latency_bound_cases(300):
        group = Group(cluster.nodes, cluster.devices_per_node)
        flat = reduction_finish(sizes, ready, group, cluster, Reduction(overlap=overlap))
        for reduction in (Reduction(bucket_bytes=bucket, overlap=overlap),
                          Reduction(hierarchical=True, overlap=overlap),
                          Reduction(bucket_bytes=bucket, hierarchical=True, overlap=overlap)):
            assert reduction_finish(sizes, ready, group, cluster, reduction) <= flat * (1 + 1e-12), reduction


def test_small_messages_on_a_real_preset_fusion_and_hierarchy_win():
    cluster = PRESETS["jia-p40"]
    group = Group(cluster.nodes, cluster.devices_per_node)
    sizes = [4e3] * 100  # 100 x 4 KB: latency dominates
    ready = [1.0] * 100
    flat = reduction_finish(sizes, ready, group, cluster, Reduction())
    best = reduction_finish(sizes, ready, group, cluster, Reduction(bucket_bytes=1e6, hierarchical=True))
    assert best - 1.0 < (flat - 1.0) / 100  # time spent reducing, after the last gradient


def test_cluster_json_round_trip_and_errors(tmp_path):
    c = PRESETS["nvlink8-100g"]
    assert Cluster.from_json(c.to_json()) == c
    assert c.inter_bandwidth == 100 * GBIT and c.devices == 32
    path = tmp_path / "c.json"
    path.write_text(TWO_NODES.to_json())
    assert load_cluster(str(path)) == TWO_NODES
    assert load_cluster("jia-p40").devices == 1024
    with pytest.raises(ValueError, match="unknown cluster key"):
        Cluster.from_json(json.dumps({**json.loads(c.to_json()), "gpus": 3}))
    with pytest.raises(ValueError, match="lacks"):
        Cluster.from_json(json.dumps({"nodes": 1}))
    with pytest.raises(ValueError, match="neither a preset"):
        load_cluster(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="devices_per_node"):
        Cluster(1, 0, 1e9, 0.0, 1e9, 0.0)
    with pytest.raises(ValueError, match="inter_latency"):
        Cluster(1, 1, 1e9, 0.0, 1e9, -1.0)
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo"):
        Cluster(1, 1, 1e9, 0.0, 1e9, 0.0, backend="mpi")


def test_report_time_by_hand():
    n = 272.0  # the runtime's report at 4 stages: 2 + 8 x 4 float64
    # NCCL: the flat ring all-reduce over every rank of the job
    assert report_time(n, 8, TWO_NODES) == pytest.approx(flat_allreduce_time(n, Group(2, 4), TWO_NODES))
    assert report_time(n, 1, TWO_NODES) == 0.0
    # gloo: gather to rank 0 and broadcast back over the farthest link (inter-node), rank 0
    # moving 7 messages each way and paying 7 x (send + receive) CPU
    cpu = Cluster(nodes=2, devices_per_node=4, intra_bandwidth=10e9, intra_latency=1e-6, inter_bandwidth=1e9,
                  inter_latency=1e-5, cores=2, send_cpu=1e-4, send_cpu_byte=1e-9, recv_cpu=2e-4, backend="gloo")
    assert report_time(n, 8, cpu) == pytest.approx(2 * 1e-5 + 7 * (2 * n / 1e9 + (1e-4 + n * 1e-9) + 2e-4))
    assert report_time(n, 4, cpu) == pytest.approx(2 * 1e-6 + 3 * (2 * n / 10e9 + (1e-4 + n * 1e-9) + 2e-4))


def test_link_inside_and_between_nodes():
    assert TWO_NODES.link(0, 3) == (10e9, 1e-6)
    assert TWO_NODES.link(3, 4) == (1e9, 1e-5)


def test_hybrid_reduction_takes_the_cheaper_algorithm_per_bucket():
    # jia-p40: PCIe inside a node (10 GB/s) is slower than the 100 Gb/s network, so hierarchy wins on
    # latency (small buckets) and loses on bandwidth (large ones): the opposite of a size threshold
    # that sends small buckets flat.
    cluster, group = PRESETS["jia-p40"], Group(2, 8)
    flat = lambda n: flat_allreduce_time(n, group, cluster)  # noqa: E731
    hier = lambda n: hierarchical_allreduce_time(n, group, cluster)  # noqa: E731
    for n in (1e3, 1e5, 25e6, 1e8):
        assert prefers_hierarchical(n, group, cluster) == (hier(n) < flat(n))
        assert allreduce_time(n, group, cluster, None) == pytest.approx(min(flat(n), hier(n)))
    assert prefers_hierarchical(1e3, group, cluster) and not prefers_hierarchical(1e8, group, cluster)
    # NVLink inside a node: hierarchical for every size; one node: always flat.
    assert all(prefers_hierarchical(n, Group(2, 8), PRESETS["nvlink8-100g"]) for n in (1e3, 1e8))
    assert not prefers_hierarchical(1e3, Group(1, 8), PRESETS["nvlink8-100g"])
    assert Reduction(hierarchical=None).label() == "per-tensor + flat/hierarchical per bucket"

"""plan_replicas(): stage count and per-stage replication against exhaustive search."""
from __future__ import annotations

import itertools
import math

import pytest

import partitioners
from partitioners import PartitionError
from _partitioner_graphs import random_dag, stage_cost


def compositions(total: int, parts: int):
    """Every tuple of `parts` positive integers summing to at most `total`."""
    for reps in itertools.product(range(1, total + 1), repeat=parts):
        if sum(reps) <= total:
            yield reps


def replicated_stage_time(g, lo: int, hi: int, r: int, bandwidth: float, ar_bandwidth: float) -> float:
    busy, _ = stage_cost(g, lo, hi, bandwidth)
    params = sum(g.nodes[v]["param_bytes"] for v in range(lo, hi))
    ring = 2 * (r - 1) / r * params / ar_bandwidth  # ring all-reduce: 2 (r - 1) / r of the bytes per rank
    return max(busy, ring) / r


def brute_replicas(g, devices: int, bandwidth: float, ar_bandwidth: float,
                 uniform: bool = False) -> float:
    n = g.number_of_nodes()
    best = math.inf
    for stages in range(1, min(n, devices) + 1):
        for inner in itertools.combinations(range(1, n), stages - 1):
            cuts = (0, *inner, n)
            options = ([(devices // stages,) * stages] if uniform and devices % stages == 0
                       else [] if uniform else compositions(devices, stages))
            for reps in options:
                worst = max(replicated_stage_time(g, cuts[k], cuts[k + 1], reps[k], bandwidth, ar_bandwidth)
                            for k in range(stages))
                best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("devices", [1, 3, 4])
def test_hybrid_is_optimal(seed: int, devices: int) -> None:
    g = random_dag(6, seed, skip_prob=0.4)
    bw, ar_bw = [(20.0, 50.0), (200.0, 5.0), (5.0, 500.0)][seed % 3]
    plan = partitioners.plan_replicas(g, devices, bandwidth=bw, allreduce_bandwidth=ar_bw)
    assert sum(plan.replicas) <= devices and len(plan.replicas) == plan.num_stages
    assert plan.bottleneck == pytest.approx(brute_replicas(g, devices, bw, ar_bw), rel=1e-9)
    direct = [replicated_stage_time(g, plan.cuts[k], plan.cuts[k + 1], plan.replicas[k], bw, ar_bw)
              for k in range(plan.num_stages)]
    assert plan.stage_times == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_uniform_replicas_is_optimal(seed: int) -> None:
    g = random_dag(6, seed, skip_prob=0.4)
    plan = partitioners.plan_replicas(g, 4, bandwidth=20.0, allreduce_bandwidth=30.0,
                                    uniform_replicas=True)
    assert len(set(plan.replicas)) == 1 and plan.num_stages * plan.replicas[0] == 4
    assert plan.bottleneck == pytest.approx(brute_replicas(g, 4, 20.0, 30.0, uniform=True), rel=1e-9)


def test_cheap_allreduce_prefers_replication_costly_prefers_pipeline() -> None:
    g = random_dag(12, 1, skip_prob=0.0)
    for n in g:
        g.nodes[n]["param_bytes"] = 1000
    replicated = partitioners.plan_replicas(g, 4, bandwidth=10.0, allreduce_bandwidth=1e12)
    assert replicated.num_stages == 1 and replicated.replicas == [4]
    piped = partitioners.plan_replicas(g, 4, bandwidth=1e12, allreduce_bandwidth=1.0)
    assert piped.replicas == [1, 1, 1, 1]


def test_many_positions_are_thinned() -> None:
    g = random_dag(600, 2, skip_prob=0.2)
    plan = partitioners.plan_replicas(g, 8, bandwidth=50.0, allreduce_bandwidth=50.0,
                                    max_positions=64)
    assert sum(plan.replicas) <= 8
    exact_pipeline = partitioners.partition(g, plan.num_stages, replicas=plan.replicas,
                                            bandwidth=50.0, allreduce_bandwidth=50.0)
    assert exact_pipeline.bottleneck <= plan.bottleneck + 1e-12


def test_bad_device_counts_and_memory() -> None:
    g = random_dag(5, 0)
    for devices in (0, -2, 1.5):
        with pytest.raises(PartitionError, match="devices must be an integer >= 1"):
            partitioners.plan_replicas(g, devices)
    with pytest.raises(PartitionError, match="memory_limit"):
        partitioners.plan_replicas(g, 4, memory_limit=1.0)
    with pytest.raises(PartitionError, match="memory_limit"):
        partitioners.plan_replicas(g, 4, memory_limit=1.0, uniform_replicas=True)

"""partition(): optimality against exhaustive search, the balanced methods, bad input, JSON."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

import partitioners
from partitioners import PartitionError
from _partitioner_graphs import random_dag, stage_cost


def brute_force(g, stages: int, bandwidth: float, memory_limit: float = math.inf,
                replicas: list[int] | None = None) -> float:
    n = g.number_of_nodes()
    reps = replicas or [1] * stages
    best = math.inf
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = (0, *inner, n)
        costs = [stage_cost(g, cuts[k], cuts[k + 1], bandwidth) for k in range(stages)]
        if all(mem <= memory_limit for _, mem in costs):
            best = min(best, max(t / reps[k] for k, (t, _) in enumerate(costs)))
    return best


CASES = [(n, p, seed) for seed in range(6) for n, p in [(6, 2), (8, 3), (9, 4)]]


@pytest.mark.parametrize("n,stages,seed", CASES)
def test_time_is_optimal(n: int, stages: int, seed: int) -> None:
    g = random_dag(n, seed, skip_prob=0.0 if seed % 2 else 0.4)  # chains and DAGs
    plan = partitioners.partition(g, stages, method="time")
    assert max(plan.compute_times) == pytest.approx(brute_force(g, stages, math.inf), rel=1e-9)


@pytest.mark.parametrize("n,stages,seed", CASES)
def test_graph_is_optimal(n: int, stages: int, seed: int) -> None:
    g = random_dag(n, seed, skip_prob=0.0 if seed % 2 else 0.6)
    bandwidth = [5.0, 30.0, 200.0][seed % 3]
    plan = partitioners.partition(g, stages, method="graph", bandwidth=bandwidth)
    assert plan.bottleneck == pytest.approx(brute_force(g, stages, bandwidth), rel=1e-9)
    cuts = plan.cuts
    direct = [stage_cost(g, cuts[k], cuts[k + 1], bandwidth)[0] for k in range(stages)]
    assert plan.stage_times == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_graph_respects_memory_limit_optimally(seed: int) -> None:
    g = random_dag(9, seed, skip_prob=0.5)
    free = brute_force(g, 3, 20.0)
    limits = sorted(stage_cost(g, 0, k, 20.0)[1] for k in range(2, 8))
    limit = limits[len(limits) // 2]
    expected = brute_force(g, 3, 20.0, memory_limit=limit)
    if math.isinf(expected):
        with pytest.raises(PartitionError, match="memory_limit"):
            partitioners.partition(g, 3, bandwidth=20.0, memory_limit=limit)
        return
    plan = partitioners.partition(g, 3, bandwidth=20.0, memory_limit=limit)
    assert plan.bottleneck == pytest.approx(expected, rel=1e-9) and plan.bottleneck >= free
    for k in range(3):
        assert stage_cost(g, plan.cuts[k], plan.cuts[k + 1], 20.0)[1] <= limit


def test_replicas_divide_stage_time_optimally() -> None:
    g = random_dag(8, 11, skip_prob=0.3)
    plan = partitioners.partition(g, 3, replicas=[1, 3, 2], bandwidth=50.0)
    assert plan.replicas == [1, 3, 2]
    assert plan.bottleneck == pytest.approx(brute_force(g, 3, 50.0, replicas=[1, 3, 2]), rel=1e-9)


def test_long_skip_connections_large_graph() -> None:
    # every node also feeds the last node: a DAG whose antichains would explode PipeDream's DP
    n = 400
    g = random_dag(n, 3, skip_prob=0.0)
    for v in range(n - 2):
        g.add_edge(v, n - 1, bytes=g.nodes[v]["act_bytes"])
    plan = partitioners.partition(g, 8, bandwidth=100.0)
    assert plan.num_stages == 8
    assert plan.bottleneck >= max(plan.compute_times)
    assert len(plan.stage_inputs(7)) >= n - 2 - (plan.cuts[7])  # all skips reach the last stage


def test_uniform_balances_node_counts() -> None:
    g = random_dag(12, 0)
    plan = partitioners.partition(g, 4, method="uniform")
    assert [len(plan.nodes(k)) for k in range(4)] == [3, 3, 3, 3]


def test_params_balances_parameter_bytes() -> None:
    g = random_dag(8, 0)
    for i, b in enumerate([10, 0, 10, 0, 10, 0, 10, 0]):
        g.nodes[i]["param_bytes"] = b
    plan = partitioners.partition(g, 2, method="params")
    assert plan.param_bytes == [20, 20]


def test_methods_compare_on_costs() -> None:
    g = random_dag(30, 5, skip_prob=0.5)
    graph_plan = partitioners.partition(g, 4, bandwidth=10.0)
    for method in ("uniform", "params", "time"):
        other = partitioners.partition(g, 4, method=method, bandwidth=10.0)
        assert graph_plan.bottleneck <= other.bottleneck + 1e-12
    time_plan = partitioners.partition(g, 4, method="time", bandwidth=10.0)
    assert max(time_plan.compute_times) <= max(graph_plan.compute_times) + 1e-12


@pytest.mark.parametrize("stages", [0, -1, 2.5, True, "2"])
def test_bad_stage_count(stages) -> None:
    with pytest.raises(PartitionError, match="stages must be an integer >= 1"):
        partitioners.partition(random_dag(5, 0), stages)


def test_more_stages_than_nodes() -> None:
    with pytest.raises(PartitionError, match="only 5 positions"):
        partitioners.partition(random_dag(5, 0), 6)


def test_memory_limit_no_split_satisfies() -> None:
    g = random_dag(6, 0)
    with pytest.raises(PartitionError, match="memory_limit=.*no split into 3 stages"):
        partitioners.partition(g, 3, memory_limit=1.0)
    with pytest.raises(PartitionError, match="method 'uniform' puts"):
        partitioners.partition(g, 3, method="uniform", memory_limit=1.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "fastest"}, "unknown method"),
    ({"replicas": [1]}, "replicas must list"),
    ({"replicas": [1, 0]}, "replicas must list"),
    ({"bandwidth": 0}, "bandwidth must be > 0"),
    ({"memory_limit": -5}, "memory_limit must be > 0"),
])
def test_bad_options(kwargs, match) -> None:
    with pytest.raises(PartitionError, match=match):
        partitioners.partition(random_dag(5, 0), 2, **kwargs)


def test_cycle_rejected() -> None:
    g = random_dag(4, 0)
    g.add_edge(3, 0, bytes=1)
    with pytest.raises(PartitionError, match="cycle"):
        partitioners.partition(g, 2)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x))))) + x


def test_split_points() -> None:
    cg = partitioners.trace(_Net(), torch.randn(2, 4), profile=False)
    plan = partitioners.partition(cg, 3, method=["b", "c"])
    assert plan.nodes(1)[0] == "b" and plan.nodes(2)[0] == "c"
    assert plan.method == ["b", "c"]
    with pytest.raises(PartitionError, match="make 3 stages, not stages=2"):
        partitioners.partition(cg, 2, method=["b", "c"])
    with pytest.raises(PartitionError, match="names no traced module"):
        partitioners.partition(cg, 2, method=["nope"])
    with pytest.raises(PartitionError, match="forward\\(\\) order"):
        partitioners.partition(cg, 3, method=["c", "b"])


def test_json_round_trip_and_table() -> None:
    model = _Net()
    x = torch.randn(2, 4)
    cg = partitioners.trace(model, x, profile=False)
    plan = partitioners.partition(cg, 3, method="time")
    text = plan.to_json()
    loaded = partitioners.Plan.from_json(text)
    assert json.loads(loaded.to_json()) == json.loads(text)
    for k in range(3):
        assert loaded.stage_inputs(k) == plan.stage_inputs(k)
        assert loaded.stage_outputs(k) == plan.stage_outputs(k)
    assert loaded.bottleneck == plan.bottleneck
    assert loaded.consumers("x") == plan.consumers("x") == [2]
    with pytest.raises(PartitionError, match="needs the traced model"):
        loaded.build_stage(0)
    attached = partitioners.Plan.from_json(text, graph=cg)
    assert torch.equal(attached.build_stage(0).a.weight, model.a.weight)
    other = partitioners.trace(torch.nn.Sequential(torch.nn.Linear(4, 4)), x, profile=False)
    with pytest.raises(PartitionError, match="another model"):
        partitioners.Plan.from_json(text, graph=other)
    table = str(plan)
    assert "bottleneck: stage" in table and len(table.splitlines()) == 3 + 3

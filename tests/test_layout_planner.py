"""Layout search: equals exhaustive search on small synthetic graphs; honours memory."""
from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from partitioners.errors import PartitionError
from partitioners.planners.layout import (MICRO_BATCHES, evaluate_layout, explain_choice, format_bytes,
                                          format_ranking, plan_layout, search_layouts)
from schedules.cluster import Cluster
from schedules.cluster.reductions import Reduction
from schedules.cluster.step import CLUSTER_SCHEDULES

CLUSTER = Cluster(nodes=2, devices_per_node=2, intra_bandwidth=1e9, intra_latency=1e-4,
                  inter_bandwidth=1e8, inter_latency=1e-3)


def chain_graph(n: int, seed: int) -> nx.DiGraph:
    rng = random.Random(seed)
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, op="call_function", fwd_time=rng.uniform(1e-3, 1e-2), bwd_time=rng.uniform(1e-3, 2e-2),
                   param_bytes=rng.choice([0, 1e5, 1e6, 4e6]), act_bytes=rng.uniform(1e4, 1e6))
    for i in range(1, n):
        g.add_edge(i - 1, i, bytes=g.nodes[i - 1]["act_bytes"])
    return g


def brute_force(g: nx.DiGraph, cluster: Cluster, batch: int, reduction: Reduction):
    """Every cut of the order, every stages x replicas <= devices, micro-batch count, schedule."""
    n, best = g.number_of_nodes(), None
    for stages in range(1, min(n, cluster.devices) + 1):
        for inner in itertools.combinations(range(1, n), stages - 1):
            cuts = [0, *inner, n]
            for replicas in range(1, cluster.devices // stages + 1):
                for m in MICRO_BATCHES:
                    if batch % (replicas * m):
                        continue
                    for kind in CLUSTER_SCHEDULES:
                        lay = evaluate_layout(g, cluster, cuts, replicas=replicas, micro_batches=m,
                                              schedule=kind, batch_size=batch, profiled_batch=4,
                                              reduction=reduction)
                        if lay.fits and (best is None or lay.step_time < best.step_time - 1e-15):
                            best = lay
    return best


@pytest.mark.parametrize("seed", range(4))
def test_planner_equals_exhaustive_search(seed):
    g = chain_graph(5, seed)
    reduction = [Reduction(), Reduction(bucket_bytes=2e6, hierarchical=True, overlap=True)][seed % 2]
    memory = None if seed < 2 else 2.5e7  # the later seeds also exclude layouts over memory
    cluster = Cluster(**{**CLUSTER.__dict__, "memory": memory})
    expected = brute_force(g, cluster, 32, reduction)
    got = plan_layout(g, cluster, batch_size=32, profiled_batch=4, reduction=reduction)
    assert got.step_time == pytest.approx(expected.step_time, rel=1e-12)
    assert got.fits


def test_memory_limit_changes_the_choice_and_none_fitting_is_an_error():
    g = chain_graph(5, 7)
    free = plan_layout(g, CLUSTER, batch_size=32, profiled_batch=4)
    need = max(free.result.memory)
    tight = Cluster(**{**CLUSTER.__dict__, "memory": need * 0.999})
    chosen = plan_layout(g, tight, batch_size=32, profiled_batch=4)
    assert max(chosen.result.memory) <= need * 0.999
    assert chosen.step_time >= free.step_time
    with pytest.raises(PartitionError, match=r"no layout fits .* a predicted peak of .* bytes on stage \d"):
        plan_layout(g, Cluster(**{**CLUSTER.__dict__, "memory": 1.0}), batch_size=32, profiled_batch=4)


def test_stage_work_by_hand():
    g = nx.DiGraph()
    g.add_node("a", fwd_time=1.0, bwd_time=2.0, param_bytes=10.0, act_bytes=5.0)
    g.add_node("b", fwd_time=3.0, bwd_time=4.0, param_bytes=20.0, act_bytes=7.0)
    g.add_edge("a", "b", bytes=5.0)
    lay = evaluate_layout(g, CLUSTER, [0, 1, 2], replicas=1, micro_batches=2, schedule="gpipe",
                          batch_size=8, profiled_batch=2, optimizer="sgd-momentum")
    sim = lay.result.sim
    # micro-batches of 4 samples = 2 x the profiled size: forward 2 and 6, backward 4 and 8
    assert sim.costs.forward == [2.0, 6.0] and sim.costs.backward == [4.0, 8.0]
    assert sim.costs.comm[0] == pytest.approx(1e-4 + 2 * 5.0 / 1e9)
    assert lay.result.memory == [10 * 3 + 2 * (5 * 2), 20 * 3 + 2 * (7 + 5) * 2]


def test_ranking_and_bad_input():
    g = chain_graph(4, 1)
    layouts = search_layouts(g, CLUSTER, batch_size=16, profiled_batch=4)
    assert [lay.step_time for lay in layouts] == sorted(lay.step_time for lay in layouts)
    text = format_ranking(layouts, top=3)
    assert len(text.splitlines()) == 4 and "efficiency" in text
    with pytest.raises(ValueError, match="batch_size"):
        search_layouts(g, CLUSTER, batch_size=0, profiled_batch=4)
    with pytest.raises(ValueError, match="cannot be planned"):
        search_layouts(g, CLUSTER, batch_size=16, profiled_batch=4, schedules=["async-1f1b"])


def test_the_choice_is_explained_against_the_next_layout():
    g = chain_graph(5, 7)
    layouts = search_layouts(g, CLUSTER, batch_size=32, profiled_batch=4, schedules=["1f1b"])  # gpipe would tie
    best, nxt = layouts[:2]
    assert nxt.step_time > best.step_time
    pct = 100 * (nxt.step_time / best.step_time - 1)
    assert explain_choice(layouts, CLUSTER) == f"chosen {best.label()}: {pct:.1f}% faster step than the next, {nxt.label()}"
    # GPipe with 4 micro-batches on one device holds all four; recomputed, their inputs and one whole.
    shape = dict(replicas=1, micro_batches=4, schedule="gpipe", batch_size=32, profiled_batch=4)
    plain = evaluate_layout(g, CLUSTER, [0, 5], **shape)
    again = evaluate_layout(g, CLUSTER, [0, 5], recompute="always", **shape)
    assert max(again.result.memory) < max(plain.result.memory) and again.step_time > plain.step_time
    # Memory between the two: that shape fits only recomputing, and says what the cheaper option needs.
    tight = Cluster(**{**CLUSTER.__dict__, "memory": (max(again.result.memory) + max(plain.result.memory)) / 2})
    found = search_layouts(g, tight, batch_size=32, profiled_batch=4, recomputes=("none", "always"), max_stages=1,
                           micro_batches=[4], schedules=["gpipe"])
    same = [lay for lay in found if lay.replicas == 1]
    assert same[0].fits and same[0].recompute == "always" and same[0].step_time == again.step_time
    assert same[0].needs == f"zero=0 recompute=none needs {format_bytes(max(plain.result.memory))}"

"""Random cost graphs and a direct stage-cost definition for the partitioner tests."""
from __future__ import annotations

import random

import networkx as nx


def random_dag(n: int, seed: int, skip_prob: float = 0.3) -> nx.DiGraph:
    """A chain plus random forward skip edges; insertion order is topological."""
    rng = random.Random(seed)
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, op="call_function", fwd_time=rng.uniform(0.1, 1.0),
                   bwd_time=rng.uniform(0.0, 2.0), param_bytes=rng.randint(0, 100),
                   act_bytes=rng.randint(1, 50))
    for i in range(1, n):
        g.add_edge(i - 1, i)
        for j in range(i + 1, n):
            if rng.random() < skip_prob / (j - i):
                g.add_edge(i - 1, j)
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = g.nodes[u]["act_bytes"]
    return g


def stage_cost(g: nx.DiGraph, lo: int, hi: int, bandwidth: float) -> tuple[float, float]:
    """(time, memory) of nodes lo..hi-1, straight from the definition."""
    members = set(range(lo, hi))
    compute = sum(g.nodes[v]["fwd_time"] + g.nodes[v]["bwd_time"] for v in members)
    received = {u for u, v in g.edges if u < lo and v in members}
    sent = {u for u, v in g.edges if u in members and v >= hi}
    recv_bytes = sum(g.nodes[u]["act_bytes"] for u in received)
    sent_bytes = sum(g.nodes[u]["act_bytes"] for u in sent)
    memory = sum(g.nodes[v]["param_bytes"] + g.nodes[v]["act_bytes"] for v in members) + recv_bytes
    return compute + (recv_bytes + sent_bytes) / bandwidth, memory

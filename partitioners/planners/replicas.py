"""plan_replicas(): choose the stage count and each stage's replication for a device budget.

The idea of PipeDream's hierarchical planner: a stage may run on r devices (data parallel
inside the stage), which divides its time by r but adds a gradient all-reduce. A dynamic
program over (prefix of the order, devices used) picks cuts and replica counts together
to minimise the slowest stage (chain.py's cost model).
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from ..algorithms import SegmentCosts
from ..chain import DEFAULT_BANDWIDTH, Chain, allreduce_time
from ..errors import PartitionError
from ..graph import CostGraph
from ..partition import partition
from ..plan import Plan


def plan_replicas(graph: CostGraph | nx.DiGraph, devices: int, *, bandwidth: float | None = None,
                allreduce_bandwidth: float | None = None, memory_limit: float | None = None,
                uniform_replicas: bool = False, max_positions: int = 256) -> Plan:
    """Best pipeline for `devices` devices: stage count, cuts and per-stage replicas.

    uniform_replicas=True gives every stage the same replica count (the runtime's
    data_parallel mode: devices = stages x replicas). The general search is exact over
    the allowed cut positions when there are at most max_positions of them; beyond that
    it considers max_positions cuts spread evenly by compute time.
    allreduce_bandwidth defaults to bandwidth (bytes/s; default DEFAULT_BANDWIDTH).
    """
    if isinstance(devices, bool) or not isinstance(devices, (int, np.integer)) or devices < 1:
        raise PartitionError(f"devices must be an integer >= 1, got {devices!r}")
    bw = DEFAULT_BANDWIDTH if bandwidth is None else float(bandwidth)
    ar_bw = bw if allreduce_bandwidth is None else float(allreduce_bandwidth)
    if not (bw > 0 and ar_bw > 0):
        raise PartitionError("bandwidth and allreduce_bandwidth must be > 0 bytes/s")
    if uniform_replicas:
        return _uniform(graph, int(devices), bw, ar_bw, memory_limit)
    chain = Chain.from_graph(graph)
    cands = _candidates(chain, max_positions)
    cuts, reps = _search(chain, cands, int(devices), bw, ar_bw, memory_limit)
    return Plan.from_cuts(graph, chain, cuts, method="hybrid", bandwidth=bw, replicas=reps,
                          allreduce_bandwidth=ar_bw)


def _uniform(graph: CostGraph | nx.DiGraph, devices: int, bw: float, ar_bw: float,
             memory_limit: float | None) -> Plan:
    best: Plan | None = None
    for r in range(devices, 0, -1):  # fewest stages first: ties keep the shorter pipeline
        if devices % r:
            continue
        stages = devices // r
        try:
            plan = partition(graph, stages, method="graph", replicas=[r] * stages, bandwidth=bw,
                             memory_limit=memory_limit, allreduce_bandwidth=ar_bw)
        except PartitionError:
            continue  # too many stages for the graph, or over the memory limit
        if best is None or plan.bottleneck < best.bottleneck:
            best = plan
    if best is None:
        raise PartitionError(f"no stages x replicas = {devices} layout fits memory_limit="
                             f"{memory_limit}; fix: raise the limit or add devices")
    best.method = "hybrid"
    return best


def _candidates(chain: Chain, limit: int) -> np.ndarray:
    """Stage-start positions to consider (all allowed ones, or `limit` spread by compute)."""
    starts = np.flatnonzero(chain.cuttable[:chain.n])
    if len(starts) > limit:
        prefix = np.concatenate([[0.0], np.cumsum(chain.time)])[starts]
        targets = np.linspace(0.0, prefix[-1], limit)
        picks = np.clip(np.searchsorted(prefix, targets), 0, len(starts) - 1)
        starts = np.unique(np.concatenate([[starts[0]], starts[picks]]))
    return np.concatenate([starts, [chain.n]])


def _search(chain: Chain, cands: np.ndarray, devices: int, bw: float, ar_bw: float,
            memory_limit: float | None) -> tuple[list[int], list[int]]:
    """g[d, b]: best bottleneck covering [0, cands[b]) with d devices in total."""
    rows = SegmentCosts(chain)
    m = len(cands)
    busy = np.full((m, m), np.inf)
    params = np.zeros((m, m))
    for a in range(m - 1):
        compute, moved, par, memory = rows.costs(int(cands[a]), chain.n)
        ends = cands[a + 1:] - cands[a] - 1
        busy[a, a + 1:] = compute[ends] + moved[ends] / bw
        params[a, a + 1:] = par[ends]
        if memory_limit is not None:
            busy[a, a + 1:][memory[ends] > memory_limit] = np.inf
    g = np.full((devices + 1, m), np.inf)
    g[0, 0] = 0.0
    parent = np.zeros((devices + 1, m, 2), dtype=np.int64)  # (start index, replicas)
    for d in range(1, devices + 1):
        for r in range(1, d + 1):
            ring = allreduce_time(params, r, ar_bw)
            cost = np.maximum(busy, ring) / r
            cand = np.maximum(g[d - r][:, None], cost)  # [a, b]
            a_best = np.argmin(cand, axis=0)
            val = cand[a_best, np.arange(m)]
            better = val < g[d]
            g[d][better] = val[better]
            parent[d][better] = np.stack([a_best[better], np.full(better.sum(), r)], axis=1)
    d = int(np.argmin(g[:, m - 1]))  # ties: fewest devices
    if not np.isfinite(g[d, m - 1]):
        raise PartitionError(f"no pipeline on up to {devices} devices fits memory_limit="
                             f"{memory_limit}; fix: raise the limit or add devices")
    cuts, reps, b = [int(cands[-1])], [], m - 1
    while b > 0:
        a, r = (int(v) for v in parent[d, b])
        cuts.append(int(cands[a]))
        reps.append(r)
        d, b = d - r, a
    return cuts[::-1], reps[::-1]

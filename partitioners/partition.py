"""partition(): cost graph + stage count -> Plan, by one of four methods or split points."""
from __future__ import annotations

import math
from typing import Sequence

import networkx as nx
import numpy as np

from .algorithms import balanced_cuts, optimal_cuts
from .chain import COMPUTE_OPS, DEFAULT_BANDWIDTH, Chain
from .errors import PartitionError
from .graph import CostGraph
from .memory_model import MemoryModel
from .plan import Plan

METHODS = ("graph", "time", "params", "uniform")


def partition(graph: CostGraph | nx.DiGraph, stages: int, *, method: str | Sequence[str] = "graph",
              replicas: Sequence[int] | None = None, bandwidth: float | None = None,
              memory_limit: float | None = None,
              allreduce_bandwidth: float | None = None, memory: MemoryModel | None = None) -> Plan:
    """Split `graph` into `stages` contiguous stages of its topological order.

    method: "uniform" (equal counts of compute nodes), "params" (equal parameter bytes),
    "time" (optimal: minimise the slowest stage's compute), "graph" (optimal: minimise
    the slowest stage's compute + communication at `bandwidth` bytes/s, default
    DEFAULT_BANDWIDTH), or a list of module names to start stages 1.. at.
    replicas[k] copies of stage k share its work (data parallel within the stage);
    memory_limit (bytes per stage) is honoured by "time" and "graph" and checked for the
    others. Stage times always include communication at `bandwidth`.
    memory (a MemoryModel: the schedule's in-flight micro-batches, optimizer state, weight
    versions, recomputation) makes the plan predict each stage's peak (Plan.stage_memory) and
    is what memory_limit is checked against; without it a stage's memory is its parameters,
    output activations and received bytes.
    """
    chain = Chain.from_graph(graph)
    starts = int(chain.cuttable[:chain.n].sum())
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise PartitionError(f"stages must be an integer >= 1, got {stages!r}")
    if stages > starts:
        raise PartitionError(
            f"stages={stages} but the graph has only {starts} positions where a stage can start "
            f"({chain.n} nodes); fix: use at most {starts} stages")
    reps = _replicas(replicas, stages)
    bw = DEFAULT_BANDWIDTH if bandwidth is None else float(bandwidth)
    if not bw > 0:
        raise PartitionError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    if memory_limit is not None and not memory_limit > 0:
        raise PartitionError(f"memory_limit must be > 0 bytes, got {memory_limit!r}")
    if isinstance(method, (list, tuple)):
        cuts = split_point_cuts(graph, chain, list(method), stages)
        label: object = list(method)
    elif method == "uniform":
        cuts = balanced_cuts(np.isin(chain.ops, COMPUTE_OPS).astype(float), stages, chain.cuttable)
        label = method
    elif method == "params":
        cuts = balanced_cuts(chain.params, stages, chain.cuttable)
        label = method
    elif method in ("time", "graph"):
        cuts = optimal_cuts(chain, stages, bandwidth=math.inf if method == "time" else bw,
                            replicas=reps, allreduce_bandwidth=allreduce_bandwidth,
                            memory_limit=memory_limit, memory=memory)
        label = method
    else:
        raise PartitionError(f"unknown method {method!r}; fix: use one of {METHODS} or a list "
                             "of module names to split before")
    plan = Plan.from_cuts(graph, chain, cuts, method=label, bandwidth=bw, replicas=reps,
                          allreduce_bandwidth=allreduce_bandwidth)
    if memory is not None:
        recompute, stage_memory = _predict_memory(plan, chain, memory, memory_limit)
        plan = plan.replaced(recompute=recompute, stage_memory=stage_memory)
    elif memory_limit is not None and method not in ("time", "graph"):
        for k in range(stages):
            need = chain.segment(cuts[k], cuts[k + 1])["memory"]
            if need > memory_limit:
                raise PartitionError(
                    f"method {label!r} puts {need:.4g} bytes on stage {k}, over memory_limit="
                    f"{memory_limit:.4g}; fix: use method='graph' or 'time', which honour the limit")
    return plan


def _predict_memory(plan: Plan, chain: Chain, memory: MemoryModel,
                    memory_limit: float | None) -> tuple[list[str], list[float]]:
    """Each stage's recomputation setting and predicted peak; a stage over the limit is an error."""
    recompute, stage_memory = [], []
    for k in range(plan.num_stages):
        seg = chain.segment(plan.cuts[k], plan.cuts[k + 1])
        setting, peak = memory.choose(k, plan.param_bytes[k], seg["activations"], seg["boundary"], memory_limit)
        recompute.append(setting)
        stage_memory.append(peak)
        if memory_limit is not None and peak > memory_limit:
            fix = "" if memory.recompute in ("auto", "always") else "recompute='always' or 'auto', "
            raise PartitionError(
                f"stage {k} needs {peak / 2**20:.1f} MiB at its predicted peak (recompute={setting!r}), over "
                f"memory_limit={memory_limit / 2**20:.1f} MiB; fix: use {fix}method='graph' (which splits to "
                "fit), more stages, fewer micro-batches in flight or a smaller micro-batch")
    return recompute, stage_memory


def _replicas(replicas: Sequence[int] | None, stages: int) -> list[int]:
    if replicas is None:
        return [1] * stages
    reps = list(replicas)
    if len(reps) != stages or any(isinstance(r, bool) or not isinstance(r, (int, np.integer))
                                  or r < 1 for r in reps):
        raise PartitionError(f"replicas must list one integer >= 1 per stage ({stages}), "
                             f"got {replicas!r}")
    return [int(r) for r in reps]


def split_point_cuts(graph: CostGraph | nx.DiGraph, chain: Chain, names: list[str],
                     stages: int) -> list[int]:
    """Cuts that start a stage at the first node of each named module."""
    if len(names) + 1 != stages:
        raise PartitionError(f"{len(names)} split points make {len(names) + 1} stages, not "
                             f"stages={stages}; fix: pass stages={len(names) + 1}")
    g = graph.graph if isinstance(graph, CostGraph) else graph
    scopes = [g.nodes[n].get("scope", "") for n in chain.names]
    cuts = [0]
    for name in names:
        where = [i for i, s in enumerate(scopes) if s == name or s.startswith(name + ".")]
        if not where:
            known = sorted({s.split(".")[0] for s in scopes if s})
            raise PartitionError(f"split point {name!r} names no traced module; fix: use module "
                                 f"names such as {known}")
        if where[0] <= cuts[-1]:
            raise PartitionError(f"split point {name!r} does not come after the previous one in "
                                 "execution order; fix: list split points in forward() order")
        cuts.append(where[0])
    return cuts + [chain.n]

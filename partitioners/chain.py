"""A cost graph laid out along one topological order: the form every partitioner splits.

A stage is a contiguous segment [i, j) of the order. Its cost model:
  compute  = sum of forward + backward seconds of its nodes
  received = bytes of every value produced before i and consumed in [i, j)
  sent     = bytes of every value produced in [i, j) and consumed at or after j
  memory   = parameter bytes + output-activation bytes of its nodes + received bytes
             (without a MemoryModel; with one, see memory_model.py)
  activations = received bytes + what autograd saves for one micro-batch's backward
  boundary = received bytes + the model inputs it takes (what a recomputing stage keeps)
  time     = max(compute + (received + sent) / bandwidth, allreduce) / replicas
where allreduce = 2 (r - 1) / r * parameter bytes / allreduce_bandwidth for a stage
with r > 1 replicas (a ring all-reduce: schedules.cluster.reductions.ring_allreduce_time). get_attr values
(parameters) are copied to every stage that uses them and never sent.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np

from schedules.cluster.reductions import ring_allreduce_time

from .errors import PartitionError
from .graph import CostGraph

DEFAULT_BANDWIDTH = 1e10  # bytes/s between stages when the caller gives none
COMPUTE_OPS = ("call_module", "call_function", "call_method")


# Node attribute: the node's value must not cross a stage boundary (no stage starts after it and at or before its
# last user).
STAYS_IN_STAGE = "stays_in_stage"


@dataclass
class Chain:
    """Per-position arrays of a graph in a fixed topological order."""

    names: list[str]
    ops: list[str]
    time: np.ndarray        # forward + backward seconds
    params: np.ndarray      # parameter bytes (shared parameters counted once)
    acts: np.ndarray        # output activation bytes
    out_bytes: np.ndarray   # bytes sent when the node's value crosses a cut
    consumers: list[np.ndarray]  # sorted positions of each node's users
    last: np.ndarray        # position of the last user (own position when unused)
    cuttable: np.ndarray    # cuttable[c]: a stage may start at position c (len n + 1)
    saved: np.ndarray       # bytes autograd saves inside the node (neither an input nor its output)
    first_saver: np.ndarray  # position of the first node saving the node's value for backward (n: none)
    inputs: np.ndarray      # bytes of the model's inputs (placeholders), 0 elsewhere

    @property
    def n(self) -> int:
        return len(self.names)

    @classmethod
    def from_graph(cls, graph: CostGraph | nx.DiGraph) -> "Chain":
        """Lay out a CostGraph (fx order) or a plain DiGraph (topological order that keeps
        node insertion / 'order' attribute order, so skip connections stay short)."""
        if isinstance(graph, CostGraph):
            g, names = graph.graph, graph.order
        elif isinstance(graph, nx.DiGraph):
            g = graph
            if not nx.is_directed_acyclic_graph(g):
                raise PartitionError("the graph has a cycle; fix: pass a DAG (a traced model)")
            first = {n: i for i, n in enumerate(g.nodes)}
            key = {n: (g.nodes[n].get("order", first[n]), first[n]) for n in g.nodes}
            names = sorted(g.nodes, key=key.__getitem__)
            if any(key[u] > key[v] for u, v in g.edges):  # that order is not topological
                names = list(nx.lexicographical_topological_sort(g, key=key.__getitem__))
        else:
            raise TypeError(f"graph must be a CostGraph or networkx.DiGraph, got {type(graph).__name__}")
        pos = {n: i for i, n in enumerate(names)}
        attr = [g.nodes[n] for n in names]
        ops = [a.get("op", "call_function") for a in attr]
        n = len(names)
        out_bytes = np.zeros(n)
        consumers, last = [], np.arange(n)
        for i, name in enumerate(names):
            users = sorted(pos[u] for u in g.successors(name))
            consumers.append(np.array(users, dtype=np.int64))
            if users:
                last[i] = users[-1]
            if ops[i] != "get_attr":
                out_bytes[i] = max((g.edges[name, u].get("bytes", 0) for u in g.successors(name)),
                                   default=0)
        # A tuple of tensors (e.g. nn.LSTM's output) is not cut through: stages exchange
        # tensors, so cuts wait until its getitem users have unpacked it. Nor is a value marked
        # STAYS_IN_STAGE (a tensor split over tensor-parallel ranks: stages exchange whole ones).
        blocked = np.zeros(n + 2)
        for i, a in enumerate(attr):
            if (a.get("kind") == "container" or a.get(STAYS_IN_STAGE)) and last[i] > i:
                blocked[i + 1] += 1
                blocked[last[i] + 1] -= 1
        cuttable = np.cumsum(blocked)[: n + 1] == 0
        # Which node saves which value comes from tracing; a plain graph has no such record, so each
        # value counts as saved by its producer (the output-activation model).
        saved = np.array([a.get("saved_bytes", 0) for a in attr], float)
        # The loss is outside the graph; it keeps about the model's output for its backward (cross
        # entropy: the log-probabilities), so the output node counts that much.
        for i, name in enumerate(names):
            if ops[i] == "output":
                saved[i] = sum(g.nodes[p].get("act_bytes", 0) for p in g.predecessors(name))
        first_saver = np.full(n, n) if any("saves" in a for a in attr) else np.arange(n)
        for q, a in enumerate(attr):
            for name in a.get("saves", ()):
                first_saver[pos[name]] = min(first_saver[pos[name]], q)
        cuttable[0] = cuttable[n] = True
        return cls(
            names=names, ops=ops,
            time=np.array([a.get("fwd_time", 0.0) + a.get("bwd_time", 0.0) for a in attr], float),
            params=np.array([a.get("param_bytes", 0) for a in attr], float),
            acts=np.array([a.get("act_bytes", 0) for a in attr], float),
            out_bytes=out_bytes, consumers=consumers, last=last, cuttable=cuttable,
            saved=saved, first_saver=first_saver,
            inputs=np.array([a.get("act_bytes", 0) if o == "placeholder" else 0 for a, o in zip(attr, ops)], float))

    def segment(self, i: int, j: int) -> dict[str, float]:
        """compute, received, sent, params, memory of the stage [i, j) (direct definition)."""
        recv = sum(self.out_bytes[v] for v in np.flatnonzero(self.last[:i] >= i)
                   if any(i <= q < j for q in self.consumers[v]))
        sent = sum(self.out_bytes[v] for v in range(i, j) if self.last[v] >= j)
        params = float(self.params[i:j].sum())
        kept = float(self.acts[i:j][self.first_saver[i:j] < j].sum())
        return {"compute": float(self.time[i:j].sum()), "received": float(recv),
                "sent": float(sent), "params": params,
                "memory": params + float(self.acts[i:j].sum()) + float(recv),
                "activations": float(recv) + float(self.saved[i:j].sum()) + kept,
                "boundary": float(recv) + float(self.inputs[i:j].sum())}


def stage_time(seg: dict[str, float], bandwidth: float, replicas: int = 1,
               allreduce_bandwidth: float | None = None) -> float:
    """Predicted seconds per micro-batch of one stage (see the module docstring)."""
    busy = seg["compute"] + (seg["received"] + seg["sent"]) / bandwidth
    return max(busy, allreduce_time(seg["params"], replicas, allreduce_bandwidth)) / replicas


def allreduce_time(param_bytes: float, replicas: int, allreduce_bandwidth: float | None) -> float:
    """Ring all-reduce seconds of a stage's gradients over `replicas` copies: the cluster model's
    formula (schedules.cluster.reductions) without latency, so planners and simulator agree."""
    if allreduce_bandwidth is None:
        return 0.0
    return ring_allreduce_time(param_bytes, replicas, allreduce_bandwidth, latency=0.0)

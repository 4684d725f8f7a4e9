"""What tensor parallelism over T ranks changes in a stage's price (`search_layouts(tensor_parallel=...)`).

The runtime's `wrap(..., tensor_parallel=T)` splits every transformer layer Megatron-style inside a stage:
q/k/v/gate/up colwise, o/down rowwise, the embedding by vocabulary rows, the head colwise. The T ranks of a
stage are consecutive, so on one node. Priced here, per stage and per rank of its T:

- parameters: every 2-D parameter (the matrices of linear layers and embeddings) is split, 1/T each; 1-D ones
  (norms, biases) stay whole. A plain graph without parameter shapes splits the parameters of its matmul and
  embedding nodes;
- activations: Korthikanti et al.'s per-layer s*b*h*(10 + 24/T + 5*a*s/(h*T)) bytes without sequence
  parallelism, as a share of the layer's T=1 bytes. The captured graph's attention
  (scaled_dot_product_attention) saves no s x s scores, so the 5*a*s/h term is absent from the bytes being
  scaled: the share is (10 + 24/T) / 34. With sequence parallelism (`sequence_parallel=True`: a tp_plan naming
  the norms 'sequence_parallel') the 10 whole ones are cut along the sequence too: 34/T, a share of 1/T; its
  reduce-scatter and all-gather move the bytes of the all-reduce they replace, so its time is priced the same.
  A recomputed micro-batch keeps the layer input (2*s*b*h), whole;
- compute: forward and backward seconds / T (matmul-dominated);
- communication: one all-reduce of the block's output after each rowwise matrix in the forward (attention's
  o_proj, the MLP's down_proj) and one of the gradient entering the block's colwise matrices in the backward,
  each a ring over the T ranks on the node's links: 2*(T-1)*latency + 2*(T-1)/T * bytes / intra_bandwidth;
- boundary values (whole and the same on every rank of a stage): each rank sends 1/T of a value to its lane of
  the next stage and the receiving ranks all-gather it on the node's links, (T-1)*latency + (T-1)/T * bytes /
  intra_bandwidth, in the receiver's forward (activations) or backward (their gradients), as the runtime does.

A rowwise matrix is found in the graph as a matmul using a 2-D parameter whose output, through views and
dropout only, is added to the residual stream: one per attention block and one per MLP block. The
embedding's all-reduce and the head's all-gather of the logits are not priced.
"""
from __future__ import annotations

from typing import Sequence

import networkx as nx
import numpy as np

from schedules.cluster import Cluster
from schedules.cluster.reductions import ring_allreduce_time

from ..graph import CostGraph

# Korthikanti et al. (2022), activations per layer without sequence parallelism: 10 s*b*h bytes stay whole
# (norm inputs, the residual stream, dropout masks), 24 are split over T.
WHOLE_ACTIVATIONS = 10.0
SPLIT_ACTIVATIONS = 24.0
MATMUL_OPS = frozenset({"linear", "addmm", "mm", "matmul"})
MATRIX_OPS = MATMUL_OPS | {"embedding"}
# ops between a rowwise matrix and the residual add that keep its output's size (no all-reduce moves past them)
PASS_THROUGH_OPS = frozenset({"view", "_unsafe_view", "reshape", "contiguous", "clone", "dropout", "native_dropout",
                              "to", "_to_copy"})
ADD_OPS = frozenset({"add", "add_"})


def op_name(target: object) -> str:
    """'aten::add.Tensor' -> 'add': the operator of a graph node's target without namespace or overload."""
    return str(target).rsplit("::", 1)[-1].split(".", 1)[0]


def activation_share(tensor_parallel: int, sequence_parallel: bool = False) -> float:
    """Share of a layer's T=1 activation bytes one of T ranks keeps: (10 + 24/T) / 34, or 1/T with sequence
    parallelism."""
    if sequence_parallel:
        return 1.0 / tensor_parallel
    return (WHOLE_ACTIVATIONS + SPLIT_ACTIVATIONS / tensor_parallel) / (WHOLE_ACTIVATIONS + SPLIT_ACTIVATIONS)


def degrees(tensor_parallel: int | str, cluster: Cluster, splittable: bool) -> list[int]:
    """The T values to search: `tensor_parallel` itself, or for "auto" every divisor of the devices per node
    (T ranks share a node's links); only T=1 for a graph without matrices to split."""
    per_node = cluster.devices_per_node
    divisors = [t for t in range(1, per_node + 1) if per_node % t == 0]
    if tensor_parallel == "auto":
        return divisors if splittable else [1]
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel not in divisors:
        raise ValueError(f"tensor_parallel must be 'auto' or a divisor of the {per_node} devices per node of cluster "
                         f"{cluster.name!r} (its T ranks share a node), got {tensor_parallel!r}; fix: use one of "
                         f"{', '.join(map(str, divisors))} or 'auto'")
    if tensor_parallel > 1 and not splittable:
        raise ValueError(f"tensor_parallel={tensor_parallel} needs matrices to split, and the graph has no 2-D "
                         "parameter nor matmul node with parameters; fix: tensor_parallel=1")
    return [tensor_parallel]


def is_split(shape: Sequence[int] | None, target: object) -> bool:
    """Whether a parameter is split over the T ranks: a 2-D one, or, when the graph gives no shape, one held
    by a matmul or embedding node."""
    return len(shape) == 2 if shape is not None else op_name(target) in MATRIX_OPS


def rowwise_bytes(graph: CostGraph | nx.DiGraph, names: list[str], split_params: np.ndarray) -> np.ndarray:
    """Per position of `names`, the activation bytes all-reduced after it under tensor parallelism (its
    output's, at the profiled batch) when it is a rowwise matrix, else 0 (see the module docstring)."""
    g = graph.graph if isinstance(graph, CostGraph) else graph
    pos = {n: i for i, n in enumerate(names)}
    out = np.zeros(len(names))
    for i, name in enumerate(names):
        attrs = g.nodes[name]
        if op_name(attrs.get("target", "")) not in MATMUL_OPS:
            continue
        # a traced graph reads parameters from get_attr nodes; a plain graph's node holds its own
        holds = split_params[i] > 0 or any(split_params[pos[p]] > 0 for p in g.predecessors(name)
                                          if g.nodes[p].get("op") == "get_attr")
        if holds and _reaches_add(g, name):
            out[i] = float(attrs.get("act_bytes", 0.0))
    return out


def _reaches_add(g: nx.DiGraph, name: str) -> bool:
    """Whether the node's output is added (to the residual stream), through size-keeping ops only."""
    for user in g.successors(name):
        op = op_name(g.nodes[user].get("target", ""))
        if op in ADD_OPS or (op in PASS_THROUGH_OPS and _reaches_add(g, user)):
            return True
    return False


def allgather_seconds(nbytes: float, tensor_parallel: int, cluster: Cluster) -> float:
    """Seconds of a ring all-gather of a boundary value of `nbytes` over the T ranks of a stage (its node's links);
    0 when nothing is received."""
    if nbytes <= 0:
        return 0.0
    t = tensor_parallel
    return (t - 1) * cluster.intra_latency + (t - 1) / t * nbytes / cluster.intra_bandwidth


def allreduce_seconds(rowwise: Sequence[float], scale: float, tensor_parallel: int, cluster: Cluster) -> float:
    """Seconds of the forward's (equally the backward's) all-reduces of one micro-batch of a stage whose
    rowwise matrices output `rowwise` bytes at the profiled batch (`scale` x that batch), over the node's
    links of the T ranks."""
    return sum(ring_allreduce_time(b * scale, tensor_parallel, cluster.intra_bandwidth, cluster.intra_latency)
               for b in rowwise)

"""Cost of data-parallel gradient reduction: ring, fused (bucketed), hierarchical, overlapped.

Alpha-beta model (latency alpha per message, bandwidth beta in bytes/s). A ring
all-reduce of n bytes over p ranks is a reduce-scatter plus an all-gather, each
p-1 steps that move n/p bytes per rank:

    ring(n, p) = 2 (p-1) alpha + 2 (p-1)/p * n / beta

A flat ring over ranks on several nodes runs in lock-step, so every step pays
the slowest link: the inter-node latency and min(intra, inter) bandwidth.
Hierarchical (as in Jia et al. 2018 and Horovod): reduce-scatter inside each
node over g ranks, an all-reduce of each 1/g shard across the N nodes (the g
shards share the node's network link, so together they move as much as one
ring of n bytes), all-gather inside the node:

    hier(n) = 2 (g-1) a_intra + 2 (g-1)/g n / b_intra + 2 (N-1) a_inter + 2 (N-1)/N n / b_inter

Tensor fusion packs consecutive gradients into buckets of at least
bucket_bytes so each message pays the latency once. Reductions run one after
another on one channel; with overlap a bucket starts as soon as its last
gradient is ready (during the backward), otherwise after the whole backward.
Each bucket also pays the runtime's own cost cluster.overheads.reduce_call +
bytes x reduce_byte (schedules.cluster.overheads).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from schedules.cluster.spec import Cluster


@dataclass(frozen=True)
class Reduction:
    """How gradients are reduced: bucket_bytes=None reduces each tensor on its own
    (no fusion); hierarchical=True goes intra-node, inter-node, intra-node, False one flat ring,
    None per bucket whichever is cheaper (the runtime's allreduce="hybrid"); overlap starts
    buckets during the backward."""

    bucket_bytes: float | None = None
    hierarchical: bool | None = False
    overlap: bool = False

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None and not self.bucket_bytes > 0:
            raise ValueError(f"Reduction.bucket_bytes must be > 0 or None (no fusion), "
                             f"got {self.bucket_bytes!r}")

    def label(self) -> str:
        """Short text such as 'fused 25MB + hierarchical + overlap'."""
        parts = ["per-tensor" if self.bucket_bytes is None else f"fused {self.bucket_bytes / 1e6:g}MB"]
        if self.hierarchical:
            parts.append("hierarchical")
        elif self.hierarchical is None:
            parts.append("flat/hierarchical per bucket")
        if self.overlap:
            parts.append("overlap")
        return " + ".join(parts)


@dataclass(frozen=True)
class Group:
    """Where a data-parallel group's ranks sit: `nodes` nodes with `per_node` ranks each."""

    nodes: int
    per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @classmethod
    def of_ranks(cls, ranks: Sequence[int], cluster: Cluster) -> "Group":
        """The group of these global ranks (nodes counted; per_node = the most on one node)."""
        if not ranks:
            raise ValueError("a group needs at least one rank")
        counts: dict[int, int] = {}
        for r in ranks:
            counts[cluster.node_of(r)] = counts.get(cluster.node_of(r), 0) + 1
        return cls(nodes=len(counts), per_node=max(counts.values()))


def ring_allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of nbytes over `ranks` ranks on one kind of link."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth


def flat_allreduce_time(nbytes: float, group: Group, cluster: Cluster) -> float:
    """One ring over every rank of the group; across nodes it pays the slower link each step."""
    if group.nodes == 1:
        return ring_allreduce_time(nbytes, group.ranks, cluster.intra_bandwidth, cluster.intra_latency)
    bandwidth = cluster.inter_bandwidth
    if group.per_node > 1:
        bandwidth = min(bandwidth, cluster.intra_bandwidth)
    latency = max(cluster.inter_latency, cluster.intra_latency if group.per_node > 1 else 0.0)
    return ring_allreduce_time(nbytes, group.ranks, bandwidth, latency)


def hierarchical_allreduce_time(nbytes: float, group: Group, cluster: Cluster) -> float:
    """Reduce-scatter in each node, all-reduce across nodes, all-gather in each node."""
    g, n_nodes = group.per_node, group.nodes
    intra = 0.0
    if g > 1:  # reduce-scatter + all-gather = one intra-node ring all-reduce
        intra = ring_allreduce_time(nbytes, g, cluster.intra_bandwidth, cluster.intra_latency)
    inter = ring_allreduce_time(nbytes, n_nodes, cluster.inter_bandwidth, cluster.inter_latency)
    return intra + inter


def report_time(nbytes: float, ranks: int, cluster: Cluster) -> float:
    """Seconds of the runtime's end-of-step sum of nbytes over ranks 0..ranks-1
    (pipetrain.comm.reporting.SumExchange). NCCL: one flat ring all-reduce. gloo: a gather to rank 0
    and a broadcast back, two message latencies (of the farthest rank's link) with rank 0
    taking and then sending ranks - 1 messages one after another: their bytes through its link
    and, where devices share cores, their CPU (Cluster.message_cpu)."""
    if ranks <= 1:
        return 0.0
    if cluster.backend != "gloo":
        return flat_allreduce_time(nbytes, Group.of_ranks(range(ranks), cluster), cluster)
    bandwidth, latency = cluster.link(0, ranks - 1)
    send_cpu, recv_cpu = cluster.message_cpu(nbytes)
    return 2 * latency + (ranks - 1) * (2 * nbytes / bandwidth + send_cpu + recv_cpu)


def prefers_hierarchical(nbytes: float, group: Group, cluster: Cluster) -> bool:
    """True when a hierarchical all-reduce of nbytes over the group is faster than a flat ring
    (hierarchy pays fewer inter-node latencies; it loses on bandwidth where the links inside a
    node are slower than those between nodes)."""
    return group.nodes > 1 and hierarchical_allreduce_time(nbytes, group, cluster) < flat_allreduce_time(
        nbytes, group, cluster)


def allreduce_time(nbytes: float, group: Group, cluster: Cluster, hierarchical: bool | None = False) -> float:
    """Seconds of one all-reduce of nbytes over the group: flat ring, hierarchical, or (None)
    whichever of the two is cheaper for this size."""
    if hierarchical is None:
        hierarchical = prefers_hierarchical(nbytes, group, cluster)
    if hierarchical:
        return hierarchical_allreduce_time(nbytes, group, cluster)
    return flat_allreduce_time(nbytes, group, cluster)


def buckets(tensor_bytes: Sequence[float], bucket_bytes: float | None) -> list[list[int]]:
    """Indices of the tensors in each message, in order: one per tensor without fusion,
    otherwise consecutive tensors until a bucket holds at least bucket_bytes."""
    if bucket_bytes is None:
        return [[i] for i in range(len(tensor_bytes))]
    out: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i, b in enumerate(tensor_bytes):
        current.append(i)
        size += b
        if size >= bucket_bytes:
            out.append(current)
            current, size = [], 0.0
    if current:
        out.append(current)
    return out


def reduction_finish(tensor_bytes: Sequence[float], ready: Sequence[float], group: Group,
                     cluster: Cluster, reduction: Reduction) -> float:
    """When the last gradient is reduced. tensor_bytes are in the order gradients become
    ready and ready[i] is when tensor i's gradient is final; without overlap every message
    waits for the last one. Messages go one at a time, in order."""
    if len(ready) != len(tensor_bytes):
        raise ValueError(f"{len(tensor_bytes)} tensors but {len(ready)} ready times; give one each")
    if not tensor_bytes:
        return 0.0
    done = max(ready)
    if group.ranks <= 1:
        return done
    clock = -math.inf
    for members, transfer, overhead in _bucket_times(tuple(tensor_bytes), group, cluster, reduction):
        start = max(ready[i] for i in members) if reduction.overlap else done
        clock = max(clock, start) + transfer + overhead
    return clock


@lru_cache(maxsize=4096)
def _bucket_times(tensor_bytes: tuple[float, ...], group: Group, cluster: Cluster,
                  reduction: Reduction) -> tuple[tuple[tuple[int, ...], float, float], ...]:
    """Per bucket: its tensors, all-reduce seconds and the runtime's overhead. Computed once per stage's
    gradients and group: a planner reduces the same ones in hundreds of layouts that differ in when they
    are ready."""
    out = []
    for members in buckets(tensor_bytes, reduction.bucket_bytes):
        size = sum(tensor_bytes[i] for i in members)
        out.append((tuple(members), allreduce_time(size, group, cluster, reduction.hierarchical),
                    bucket_overhead(size, cluster)))
    return tuple(out)


def bucket_overhead(nbytes: float, cluster: Cluster) -> float:
    """The runtime's cost of reducing one bucket beyond the ring transfer (schedules.cluster.overheads)."""
    extra = cluster.overheads
    return extra.reduce_call + nbytes * extra.reduce_byte

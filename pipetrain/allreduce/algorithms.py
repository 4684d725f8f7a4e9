"""Sum-reduction of one flat buffer as a chain of asynchronous collectives.

A reduction is a list of steps; each step launches one collective with
``async_op=True`` and may run a local finishing function once it completed.
The caller advances the chain without blocking (polling `Work.is_completed`)
so several buckets' chains progress while the backward still runs.

Flat: one all-reduce over the data-parallel group.

Hierarchical (nodes x per_node): reduce-scatter inside the node (each local
rank ends up with the node's sum of one 1/per_node shard), all-reduce of that
shard across nodes (only 1/per_node of the data crosses the slow link),
all-gather inside the node.

About gloo (torch 2.14, verified with the profiler): gloo has no native
reduce-scatter. ``reduce_scatter_single`` on a gloo group clones the input,
all-reduces the WHOLE buffer and slices it, i.e. it moves as much data as an
all-reduce and is slower than one. That is not a hierarchical algorithm, so
on CPU tensors the reduce-scatter here is built from gloo's native
``all_to_all_single`` (rank j receives every rank's j-th shard, (p-1)/p of
the buffer per rank, like a real reduce-scatter) followed by a local sum.
The all-gather uses gloo's native ``all_gather_single`` (gloo::allgather).
CUDA tensors (NCCL) use the native ``reduce_scatter_single``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from pipetrain.allreduce.hierarchy import Hierarchy

Launch = Callable[[], dist.Work]
Finish = Callable[[], None] | None
Step = tuple[Launch, Finish]


def flat_steps(buffer: torch.Tensor, group: dist.ProcessGroup | None) -> list[Step]:
    """One all-reduce (sum) of `buffer` in place."""
    return [(lambda: dist.all_reduce(buffer, group=group, async_op=True), None)]


def _reduce_scatter_step(buffer: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, parts: int) -> Step:
    if buffer.is_cuda:
        return (lambda: dist.reduce_scatter_single(shard, buffer, group=group, async_op=True), None)
    received = torch.empty(buffer.numel(), dtype=buffer.dtype, device=buffer.device)

    def finish() -> None:
        # chunks arrive in group-rank order, so every rank sums in the same order
        torch.sum(received.view(parts, -1), dim=0, out=shard)

    return (lambda: dist.all_to_all_single(received, buffer, group=group, async_op=True), finish)


def hierarchical_steps(buffer: torch.Tensor, hierarchy: Hierarchy) -> list[Step]:
    """Reduce-scatter / inter-node all-reduce / all-gather of `buffer` in place.

    `buffer.numel()` must be a multiple of ``hierarchy.per_node`` (pad it).
    """
    per_node = hierarchy.per_node
    if buffer.numel() % per_node:
        raise ValueError(f"hierarchical reduction needs a buffer padded to a multiple of {per_node} elements")
    if per_node == 1:
        return flat_steps(buffer, hierarchy.inter) if hierarchy.inter is not None else []
    shard = torch.empty(buffer.numel() // per_node, dtype=buffer.dtype, device=buffer.device)
    steps = [_reduce_scatter_step(buffer, shard, hierarchy.intra_reduce, per_node)]
    if hierarchy.inter is not None:
        steps.append((lambda: dist.all_reduce(shard, group=hierarchy.inter, async_op=True), None))
    steps.append((lambda: dist.all_gather_single(buffer, shard, group=hierarchy.intra_gather, async_op=True), None))
    return steps

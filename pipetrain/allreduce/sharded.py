"""ZeRO-sharded gradient reduction: reduce-scatter over the fused buckets, all-gather of the parameters.

Each replica of a data-parallel group owns whole parameter tensors (`sharding.shard_owners`) and
steps only those. Inside every bucket the tensors are laid out grouped by owner, so a bucket is a
row of per-owner segments of uneven length. The gradient reduction is a reduce-scatter of those
segments (each owner ends up with the group's mean of its own tensors) and, after the step, the
owners' updated tensors are all-gathered back into every replica.

Both collectives are ``all_to_all_single`` with uneven splits (native on gloo and NCCL; gloo has no
native reduce-scatter, see `algorithms`) followed by a local sum in group-rank order. Per bucket of
N elements over D replicas the group sends (D-1) N elements to reduce-scatter and (D-1) N to
all-gather: 2 (D-1) N, what a ring all-reduce sends. Hierarchically (nodes x per_node) the segments
are ordered by (local rank, node): the first reduce-scatter runs inside the node, the second across
nodes on 1/per_node of the data, and the all-gather retraces them backwards, the same bytes as the
intra / inter / intra all-reduce of `algorithms.hierarchical_steps`.

The flat buffer of a bucket lives only from its first gradient to the end of its reduce-scatter: the
replica then keeps its segment alone, which is what lets ZeRO-2 (``free_unowned``) drop the gradients
of the tensors it does not own.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from pipetrain.allreduce.algorithms import Step
from pipetrain.allreduce.buckets import BucketSpec
from pipetrain.allreduce.hierarchy import Hierarchy
from pipetrain.allreduce.reducer import GradientReducer, _Bucket


class _ShardedBucket(_Bucket):
    """A bucket laid out as per-owner segments; its buffers exist only while it is being reduced."""

    def __init__(self, spec: BucketSpec, params: list[torch.Tensor], owners: dict[int, int], me: int,
                 parts: int, compress: torch.dtype | None, hierarchy: Hierarchy | None):
        per_node = hierarchy.per_node if hierarchy is not None else parts
        # Gather order: by (local rank, node), so each node-local rank's segments are contiguous.
        key = (lambda o: (o % per_node, o // per_node))
        indices = sorted(spec.indices, key=lambda i: key(owners[id(params[i])]))
        self.params = [params[i] for i in indices]
        self.owner = [owners[id(p)] for p in self.params]
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += p.numel()
        self.numel, self.dtype, self.device, self.sent_as = offset, spec.dtype, self.params[0].device, compress
        self.segment = [sum(p.numel() for p, o in zip(self.params, self.owner) if o == r) for r in range(parts)]
        self.start = {r: sum(p.numel() for p, o in zip(self.params, self.owner) if key(o) < key(r))
                      for r in range(parts)}
        self.me, self.parts, self.per_node, self.hierarchy = me, parts, per_node, hierarchy
        self.owned = [k for k, o in enumerate(self.owner) if o == me]
        self.buffer: torch.Tensor | None = None
        self.comm: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None  # this replica's reduced segment, in the bucket's dtype
        self.hierarchical = False
        self.steps: list[Step] = []
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.buffer = self.comm = self.shard = None

    def view(self, k: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.comm = self.buffer if self.sent_as is None else torch.empty(self.numel, dtype=self.sent_as,
                                                                             device=self.device)
        return super().view(k)

    def local_segments(self) -> list[int]:
        """Elements per node-local rank (summed over nodes), in local-rank order."""
        return [sum(self.segment[n * self.per_node + l] for n in range(self.parts // self.per_node))
                for l in range(self.per_node)]

    def node_segments(self, local: int) -> list[int]:
        """Elements of the owners with local rank ``local``, in node order."""
        return [self.segment[n * self.per_node + local] for n in range(self.parts // self.per_node)]


def _scatter(get: Callable[[], torch.Tensor], splits: list[int], index: int, group,
             keep: Callable[[torch.Tensor], None], sent: Callable[[int], None]) -> Step:
    """Reduce-scatter of uneven ``splits``: rank ``index`` of ``group`` keeps the sum of its split;
    ``sent`` is told the bytes this rank sends."""
    box: list[torch.Tensor] = []

    def launch() -> dist.Work:
        source = get()
        received = torch.empty(len(splits) * splits[index], dtype=source.dtype, device=source.device)
        box[:] = [received]
        sent((sum(splits) - splits[index]) * source.element_size())
        return dist.all_to_all_single(received, source, [splits[index]] * len(splits), splits, group=group,
                                      async_op=True)

    def finish() -> None:
        # chunks arrive in group-rank order, so every rank sums in the same order
        keep(box.pop().view(len(splits), splits[index]).sum(dim=0))

    return launch, finish


def _gather(source: torch.Tensor, target: torch.Tensor, splits: list[int], index: int, group) -> dist.Work:
    """All-gather of uneven ``splits`` into ``target``: ``source`` is rank ``index``'s split."""
    return dist.all_to_all_single(target, source.repeat(len(splits)), splits, [splits[index]] * len(splits),
                                  group=group, async_op=True)


class ShardedReducer(GradientReducer):
    """A `GradientReducer` for ZeRO: each replica receives only the mean gradients of the tensors it owns.

    Args (beyond GradientReducer's):
        owners: for each of ``params`` (requires_grad, without duplicates), the group rank owning it.
        free_unowned: ZeRO-2: ``finish()`` drops ``p.grad`` of the tensors this replica does not own (ZeRO-1
            leaves them holding this replica's unreduced sums, which nothing reads).

    After the owners stepped their tensors, ``gather()`` copies every owner's tensors into every replica.
    """

    def __init__(self, params: Iterable[torch.Tensor], owners: Sequence[int], group: dist.ProcessGroup | None = None,
                 *, free_unowned: bool = False, **options) -> None:
        params = list(params)
        if len(owners) != len(params) or len({id(p) for p in params}) != len(params):
            raise ValueError("ShardedReducer: give one owner per parameter, each parameter once")
        if any(not p.requires_grad for p in params):
            raise ValueError("ShardedReducer: every parameter must require grad (frozen ones have nothing to shard)")
        self._owners = {id(p): o for p, o in zip(params, owners)}
        self.me = dist.get_rank(group)
        self.free_unowned = free_unowned
        self.sent_bytes = 0  # bytes this replica sent to the others, both collectives, since creation
        super().__init__(params, group, **options)
        self.owned = [p for p in self.params if self._owners[id(p)] == self.me]
        self._owned_ids = {id(p) for p in self.owned}

    def owns(self, param: torch.Tensor) -> bool:
        """Whether this replica steps ``param`` (holds its reduced gradient and its optimizer state)."""
        return id(param) in self._owned_ids

    def _make_bucket(self, spec: BucketSpec, hierarchical: bool, compress: torch.dtype | None) -> _Bucket:
        hierarchy = self.hierarchy if hierarchical else None
        bucket = _ShardedBucket(spec, self.params, self._owners, self.me, self.size, compress, hierarchy)
        bucket.hierarchical = hierarchical
        bucket.steps = self._reduce_steps(bucket)
        return bucket

    def _reduce_steps(self, b: _ShardedBucket) -> list[Step]:
        def keep_shard(t: torch.Tensor) -> None:
            b.shard = t.to(b.dtype)
            b.buffer = b.comm = None  # only the segment outlives the reduction

        def count(nbytes: int) -> None:
            self.sent_bytes += nbytes

        h = b.hierarchy
        if h is None:
            return [_scatter(lambda: b.comm, b.segment, b.me, self.group, keep_shard, count)]
        steps, partial = [], {}
        if h.intra_reduce is not None:
            keep = keep_shard if h.inter is None else (lambda t: partial.update(t=t))
            steps.append(_scatter(lambda: b.comm, b.local_segments(), h.local_rank, h.intra_reduce, keep, count))
        if h.inter is not None:
            source = (lambda: partial.pop("t")) if h.intra_reduce is not None else (lambda: b.comm)
            steps.append(_scatter(source, b.node_segments(h.local_rank), h.node, h.inter, keep_shard, count))
        return steps

    def finish(self) -> None:
        """Reduce-scatter what the hooks have not launched, wait; owned ``p.grad`` get the group's mean."""
        self._complete_round()
        for bucket in self.buckets:
            base = bucket.start[bucket.me]
            for k in bucket.owned:
                p = bucket.params[k]
                reduced = bucket.shard[bucket.offsets[k] - base: bucket.offsets[k] - base + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = reduced.to(p.dtype, copy=True)
                else:
                    p.grad.copy_(reduced)
            if self.free_unowned:
                for k, p in enumerate(bucket.params):
                    if bucket.owner[k] != bucket.me:
                        p.grad = None
        self._note_gradient_bytes()
        self._reset_round()

    @torch.no_grad()
    def gather(self) -> None:
        """Copy every owner's (updated) tensors into every replica: the all-gather after the step, one bucket
        after the other (each waits for the last, not overlapped with the next forward)."""
        for b, full in self._gathered(lambda p: p.detach()):
            for k, p in enumerate(b.params):
                if b.owner[k] != b.me:
                    p.copy_(full[b.offsets[k]:b.offsets[k] + p.numel()].view_as(p))

    @torch.no_grad()
    def gather_values(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(parameter) -> ``value_of(parameter)`` (a tensor of its shape) as computed by its owner, for every
        parameter: an all-gather like the parameters'."""
        out = {}
        for b, full in self._gathered(value_of):
            for k, p in enumerate(b.params):
                out[id(p)] = full[b.offsets[k]:b.offsets[k] + p.numel()].view_as(p)
        return out

    def _gathered(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[_ShardedBucket, torch.Tensor]]:
        """Per bucket, the flat buffer of every owner's ``value_of`` of its tensors."""
        for b in self.buckets:
            mine = [value_of(b.params[k]).reshape(-1).to(b.dtype) for k in b.owned]
            packed = torch.cat(mine) if mine else torch.empty(0, dtype=b.dtype, device=b.device)
            full = torch.empty(b.numel, dtype=b.dtype, device=b.device)
            h = b.hierarchy
            if h is None:
                self.sent_bytes += (self.size - 1) * packed.numel() * packed.element_size()
                _gather(packed, full, b.segment, b.me, self.group).wait()
            else:
                local = b.local_segments()
                start = sum(local[:h.local_rank])
                region = full[start:start + local[h.local_rank]]
                if h.inter is not None:
                    self.sent_bytes += (h.nodes - 1) * packed.numel() * packed.element_size()
                    _gather(packed, region, b.node_segments(h.local_rank), h.node, h.inter).wait()
                else:
                    region.copy_(packed)
                if h.intra_gather is not None:
                    self.sent_bytes += (h.per_node - 1) * region.numel() * region.element_size()
                    _gather(region.clone(), full, local, h.local_rank, h.intra_gather).wait()
            yield b, full

    def shard_bytes(self) -> int:
        """Bytes of gradient this replica owns (what ZeRO-2 keeps after the reduction)."""
        return sum(p.numel() * p.element_size() for p in self.owned)


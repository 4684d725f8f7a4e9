"""ZeRO-sharded gradient reduction: reduce-scatter over the fused buckets, all-gather of the parameters.

Each replica of a data-parallel group owns one contiguous range of every bucket and steps only that range.
Two layouts (`_Layout`):

* even (``owners=None``, elementwise optimizers, `slices`): the bucket holds its tensors in bucket order, padded
  to a multiple of the group size, and each replica owns an equal range, which may cut tensors: the replica
  steps the flat slices of its range, so it keeps 1/D of the optimizer state (and at ZeRO-2 of the gradients)
  plus at most D-1 padding elements per bucket;
* whole tensors (``owners`` given, optimizers that read a whole tensor such as LARS): the tensors are laid out
  grouped by owner (`sharding.shard_owners`), a row of per-owner segments of uneven length.

The gradient reduction is a reduce-scatter of those ranges (each owner ends up with the group's mean of its
own) and, after the step, the owners' updated ranges are all-gathered back into every replica.

Both collectives are ``all_to_all_single`` (native on gloo and NCCL; gloo has no native reduce-scatter, see
`algorithms`) followed by a local sum in group-rank order; every rank issues them bucket after bucket in the
same order. Per bucket of N elements over D replicas the group sends (D-1) N elements to reduce-scatter and
(D-1) N to all-gather: 2 (D-1) N, what a ring all-reduce sends. Hierarchically (nodes x per_node) the ranges
are ordered by (local rank, node): the first reduce-scatter runs inside the node, the second across nodes on
1/per_node of the data, and the all-gather retraces them backwards, the same bytes as the intra / inter / intra
all-reduce of `algorithms.hierarchical_steps`.

The flat buffer of a bucket lives only from its first gradient to the end of its reduce-scatter: the
replica then keeps its range alone, which is what lets ZeRO-2 (``free_unowned``) drop the others.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from pipetrain.allreduce.algorithms import Step
from pipetrain.allreduce.buckets import BucketSpec
from pipetrain.allreduce.hierarchy import Hierarchy
from pipetrain.allreduce.local import local
from pipetrain.allreduce.reducer import GradientReducer, _Bucket
from pipetrain.allreduce.slices import slice_of


class _ShardedBucket(_Bucket):
    """A bucket as a row of per-owner ranges; its buffers exist only while it is being reduced.

    ``start[r]`` and ``segment[r]``: where owner r's range begins in the flat buffer and its length;
    ``mine``: (k, lo, hi) for each tensor k that this replica's range holds elements lo:hi of."""

    def __init__(self, spec: BucketSpec, params: list[torch.Tensor], owners: dict[int, int] | None, me: int,
                 parts: int, compress: torch.dtype | None, hierarchy: Hierarchy | None):
        per_node = hierarchy.per_node if hierarchy is not None else parts
        # Range order: by (local rank, node), so each node-local rank's ranges are contiguous.
        position = [(r % per_node) * (parts // per_node) + r // per_node for r in range(parts)]
        indices = list(spec.indices)
        if owners is not None:
            indices.sort(key=lambda i: position[owners[id(params[i])]])
        self.params = [params[i] for i in indices]
        self.offsets = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += local(p).numel()
        if owners is None:
            share = -(-offset // parts)  # padded to a multiple of the group: equal ranges
            self.segment = [share] * parts
        else:
            self.segment = [sum(local(p).numel() for p in self.params if owners[id(p)] == r) for r in range(parts)]
        ahead = sorted(range(parts), key=lambda r: position[r])
        self.start = {r: sum(self.segment[q] for q in ahead[:ahead.index(r)]) for r in range(parts)}
        self.numel, self.dtype, self.device, self.sent_as = sum(self.segment), spec.dtype, self.params[0].device, compress
        self.payload = offset  # elements of tensors: the rest of ``numel`` is padding
        self.me, self.parts, self.per_node, self.hierarchy = me, parts, per_node, hierarchy
        lo, hi = self.start[me], self.start[me] + self.segment[me]
        self.mine = [(k, max(lo - o, 0), min(hi - o, local(p).numel()))
                     for k, (p, o) in enumerate(zip(self.params, self.offsets)) if o < hi and o + local(p).numel() > lo]
        self.buffer: torch.Tensor | None = None
        self.comm: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None  # this replica's reduced range, in the bucket's dtype
        self.hierarchical = False
        self.steps: list[Step] = []
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.buffer = self.comm = self.shard = None

    def view(self, k: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.buffer[self.payload:].zero_()  # the padding travels as zeros
            self.comm = self.buffer if self.sent_as is None else torch.empty(self.numel, dtype=self.sent_as,
                                                                             device=self.device)
        return super().view(k)

    def reduced(self, k: int, lo: int, hi: int) -> torch.Tensor:
        """Elements lo:hi of tensor k (in this replica's range) of the reduced gradient."""
        base = self.offsets[k] - self.start[self.me]
        return self.shard[base + lo:base + hi]

    def local_segments(self) -> list[int]:
        """Elements per node-local rank (summed over nodes), in local-rank order."""
        return [sum(self.segment[n * self.per_node + l] for n in range(self.parts // self.per_node))
                for l in range(self.per_node)]

    def node_segments(self, local: int) -> list[int]:
        """Elements of the owners with local rank ``local``, in node order."""
        return [self.segment[n * self.per_node + local] for n in range(self.parts // self.per_node)]


def _closed() -> dist.Work:
    raise RuntimeError("ShardedReducer: this reducer was closed (its pipeline too); make a new one to reduce again")


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
    """A `GradientReducer` for ZeRO: each replica receives only the mean gradient of the range it owns.

    Args (beyond GradientReducer's):
        owners: None for even ranges (the replica steps `slices` of its tensors: elementwise optimizers only), or
            for each of ``params`` (requires_grad, without duplicates) the group rank owning it whole.
        alone: even ranges: parameters that get a bucket of their own, so that their cut depends on their own
            size alone (the copies of a weight tied across stages, whose gradients are summed across the stages
            elementwise: every copy must be cut alike).
        free_unowned: ZeRO-2: ``finish()`` drops the ``p.grad`` it does not need (ZeRO-1 leaves them holding
            this replica's unreduced sums, which nothing reads).

    `stepped()` gives the tensors this replica's optimizers step, with their reduced gradients; after the step
    ``gather()`` copies every owner's range into every replica.
    """

    def __init__(self, params: Iterable[torch.Tensor], owners: Sequence[int] | None,
                 group: dist.ProcessGroup | None = None, *, alone: Collection[torch.Tensor] = (),
                 free_unowned: bool = False, **options) -> None:
        params = list(params)
        if len({id(p) for p in params}) != len(params) or (owners is not None and len(owners) != len(params)):
            raise ValueError("ShardedReducer: give each parameter once, and one owner per parameter (or owners=None)")
        if any(not p.requires_grad for p in params):
            raise ValueError("ShardedReducer: every parameter must require grad (frozen ones have nothing to shard)")
        self._owners = None if owners is None else {id(p): o for p, o in zip(params, owners)}
        self._alone_ids = {id(p) for p in alone} if owners is None else set()
        self.me = dist.get_rank(group)
        self.free_unowned = free_unowned
        self.sent_bytes = 0  # bytes this replica sent to the others, both collectives, since creation
        super().__init__(params, group, **options)
        # The tensor the optimizer steps for each of this replica's ranges: the parameter itself when whole.
        self._stepped = {(b_i, k): b.params[k] if self._owners is not None else slice_of(b.params[k], lo, hi)
                         for b_i, b in enumerate(self.buckets) for k, lo, hi in b.mine}
        # Where a reduced range is written: p.grad for whole tensors, at ZeRO-1 (it holds a full gradient anyway)
        # and for tied copies (the sum across stages adds p.grad); the slice's own .grad otherwise (ZeRO-2).
        self._in_param = {id(p) for p in self.params
                          if owners is not None or not free_unowned or id(p) in self._alone_ids}
        # What ZeRO-2 keeps of p.grad: a tensor stepped whole, and the gradients written there above.
        self._kept = self._in_param if owners is None else {id(t) for t in self._stepped.values()}

    def _alone(self) -> set[int]:
        return {i for i, p in enumerate(self.params) if id(p) in self._alone_ids}

    def slices(self) -> dict[int, torch.Tensor]:
        """Even ranges: id(parameter) -> the slice of it this replica steps (`slices.step_slices` takes it)."""
        return {id(t.pipetrain_slice[0]()): t for t in self._stepped.values() if self._owners is None}

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

    def close(self) -> None:
        """Remove the hooks, and each bucket's reduction steps: closures over the bucket and this reducer, a reference
        cycle that would keep the process groups (and their threads) until a garbage collection. A reduction after
        it raises."""
        super().close()
        for b in self.buckets:
            b.steps = [(_closed, None)]

    def finish(self) -> None:
        """Reduce-scatter what the hooks have not launched, wait; this replica's ranges get the group's mean."""
        self._complete_round()
        for b_i, b in enumerate(self.buckets):
            if self.free_unowned:
                for p in b.params:
                    if id(p) not in self._kept:
                        p.grad = None
            for k, lo, hi in b.mine:
                p, reduced = b.params[k], b.reduced(k, lo, hi)
                if id(p) not in self._in_param:
                    self._stepped[b_i, k].grad = reduced  # ZeRO-2: the range alone, a view of the reduced one
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif not local(p.grad).is_contiguous():
                    p.grad = p.grad.contiguous()
                local(p.grad).view(-1)[lo:hi].copy_(reduced)
        self._note_gradient_bytes()
        self._reset_round()

    def stepped(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, its parameter) for each tensor this replica steps that has a gradient, the reduced one: read
        again from ``p.grad`` where that holds it, so a sum written there since (tied copies) counts."""
        out = []
        for b_i, b in enumerate(self.buckets):
            for k, lo, hi in b.mine:
                t, p = self._stepped[b_i, k], b.params[k]
                if t is not p and id(p) in self._in_param:
                    t.grad = None if p.grad is None else local(p.grad).view(-1)[lo:hi]
                if t.grad is not None:
                    out.append((t, p))
        return out

    def _note_gradient_bytes(self) -> None:
        # The parameters' gradients and the ranges held apart from them (ZeRO-2's).
        apart = [t.grad for (b_i, k), t in self._stepped.items()
                 if t.grad is not None and id(self.buckets[b_i].params[k]) not in self._in_param]
        self.gradient_bytes = sum(local(g).nbytes for g in [p.grad for p in self.params if p.grad is not None] + apart)

    @torch.no_grad()
    def gather(self) -> None:
        """Copy every owner's (updated) range into every replica: the all-gather after the step, one bucket
        after the other (each waits for the last, not overlapped with the next forward)."""
        for b, full in self._gathered(lambda t: t.detach()):
            whole = {k for k, lo, hi in b.mine if hi - lo == local(b.params[k]).numel()}  # stepped in place already
            for k, p in enumerate(b.params):
                if k not in whole:
                    block = local(p)
                    block.copy_(full[b.offsets[k]:b.offsets[k] + block.numel()].view_as(block))

    @torch.no_grad()
    def gather_values(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor]:
        """id(parameter) -> the values ``value_of`` gives for it (a tensor of the parameter's shape), each range as
        its owner computes it from the tensor it steps (value_of takes that tensor: a slice, or the parameter):
        an all-gather like the parameters'."""
        out = {}
        for b, full in self._gathered(value_of):
            for k, p in enumerate(b.params):
                block = local(p)
                out[id(p)] = full[b.offsets[k]:b.offsets[k] + block.numel()].view_as(block)
        return out

    def _gathered(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[_ShardedBucket, torch.Tensor]]:
        """Per bucket, the flat buffer of every owner's ``value_of`` of the tensors it steps."""
        for b_i, b in enumerate(self.buckets):
            mine = [local(value_of(self._stepped[b_i, k])).reshape(-1).to(b.dtype) for k, _, _ in b.mine]
            held = sum(hi - lo for _, lo, hi in b.mine)
            mine.append(torch.zeros(b.segment[b.me] - held, dtype=b.dtype, device=b.device))  # padding
            packed = torch.cat(mine)
            full = torch.empty(b.numel, dtype=b.dtype, device=b.device)
            h = b.hierarchy
            if h is None:
                self.sent_bytes += (self.size - 1) * packed.numel() * packed.element_size()
                _gather(packed, full, b.segment, b.me, self.group).wait()
            else:
                in_node = b.local_segments()
                start = sum(in_node[:h.local_rank])
                region = full[start:start + in_node[h.local_rank]]
                if h.inter is not None:
                    self.sent_bytes += (h.nodes - 1) * packed.numel() * packed.element_size()
                    _gather(packed, region, b.node_segments(h.local_rank), h.node, h.inter).wait()
                else:
                    region.copy_(packed)
                if h.intra_gather is not None:
                    self.sent_bytes += (h.per_node - 1) * region.numel() * region.element_size()
                    _gather(region.clone(), full, in_node, h.local_rank, h.intra_gather).wait()
            yield b, full

    def padding_bytes(self) -> int:
        """Bytes of padding the buckets carry (even ranges: under one element per replica each)."""
        return sum((b.numel - b.payload) * b.dtype.itemsize for b in self.buckets)

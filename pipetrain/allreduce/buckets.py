"""Assignment of gradients to flat communication buckets.

Many small all-reduces cost one network latency each; packing gradients into
a few flat buffers pays it once per bucket. Buckets are filled in reverse
registration order (the order backward produces gradients, as in DDP), one
dtype per bucket, and the first bucket is kept small so the first
communication starts early in the backward.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pipetrain.allreduce.local import local


@dataclass(frozen=True)
class BucketSpec:
    """Indices (into the reducer's parameter list) packed into one flat buffer, in order."""

    indices: tuple[int, ...]
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def assign_buckets(params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int,
                   alone: Collection[int] = ()) -> list[BucketSpec]:
    """Pack `params` (registration order) into buckets, returned in launch order.

    A bucket closes once its payload reaches its cap (`first_bucket_bytes` for
    the first bucket of each dtype, `bucket_bytes` after), so a tensor larger
    than the cap gets a bucket of its own. A cap of 0 gives one tensor per bucket.
    The indices in `alone` get a bucket of their own each, in their place in the
    order (ZeRO's even shards then cut such a tensor by its own elements alone).
    """
    if bucket_bytes < 0 or first_bucket_bytes < 0:
        raise ValueError(f"bucket sizes must be >= 0 bytes, got {bucket_bytes} and {first_bucket_bytes}")
    open_buckets: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed_per_dtype: dict[torch.dtype, int] = {}
    order: list[list[int]] = []  # creation order == launch order
    for i in reversed(range(len(params))):
        p = params[i]
        if i in alone:
            order.append([i])
            continue
        if p.dtype not in open_buckets:
            open_buckets[p.dtype] = []
            open_bytes[p.dtype] = 0
            order.append(open_buckets[p.dtype])
        open_buckets[p.dtype].append(i)
        open_bytes[p.dtype] += local(p).numel() * p.element_size()
        first = closed_per_dtype.get(p.dtype, 0) == 0
        cap = first_bucket_bytes if first else bucket_bytes
        if open_bytes[p.dtype] >= cap:
            closed_per_dtype[p.dtype] = closed_per_dtype.get(p.dtype, 0) + 1
            del open_buckets[p.dtype]
    return [
        BucketSpec(tuple(idx), params[idx[0]].dtype, sum(local(params[i]).numel() for i in idx))
        for idx in order
    ]

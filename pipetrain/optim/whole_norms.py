"""The 2-norms of whole tensors whose parts live on several ranks, with one all-reduce per process group.

LARS's and LAMB's trust ratios read each tensor's norm. Under zero=3 (FSDP2) and tensor parallelism a parameter
is a DTensor of which this rank holds one shard; ``torch.linalg.vector_norm`` of a DTensor is exact but runs one
all-reduce per tensor, two per tensor and step for a trust ratio, each a latency-bound message of one number.
Here every tensor contributes its local part's squared norm, the squares of all the tensors sharded over the same
mesh dimensions travel in one all-reduce per dimension, and the root is taken after the sum, which is what the
DTensor norm computes too (a partial p-norm summed over the shards), only batched.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def local_part(t: Tensor) -> Tensor:
    """This rank's part of ``t`` (``t`` itself when it is not a DTensor); in-place changes to it change ``t``."""
    return t.to_local() if is_dtensor(t) else t


def whole_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The 2-norm of each whole tensor, as plain 0-dim tensors on the local parts' devices."""
    norms: list[Tensor | None] = [None] * len(tensors)
    buckets: dict[tuple, list[int]] = {}  # (mesh, mesh dimensions summed over, dtype, device) -> tensor indices
    for i, t in enumerate(tensors):
        if not is_dtensor(t):
            norms[i] = torch.linalg.vector_norm(t)
            continue
        placements = t.placements
        if any(p.is_partial() for p in placements):  # a pending sum: its parts' squares do not add up to its square
            norms[i] = torch.linalg.vector_norm(t).full_tensor()
            continue
        # Every dimension the tensor is cut over (Shard, and FSDP2's _StridedShard under tensor parallelism, which
        # is no Shard); replicated dimensions hold the whole sum already.
        dims = tuple(d for d, p in enumerate(placements) if not p.is_replicate())
        local = t.to_local()
        buckets.setdefault((t.device_mesh, dims, local.dtype, local.device), []).append(i)
    for (mesh, dims, _, _), indices in buckets.items():
        squares = torch.stack([torch.linalg.vector_norm(tensors[i].to_local()).square() for i in indices])
        for d in dims:
            dist.all_reduce(squares, group=mesh.get_group(d))
        for i, norm in zip(indices, squares.sqrt().unbind()):
            norms[i] = norm
    return norms


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (a shard or block of a tensor split over ranks)."""
    # By attribute, not isinstance: importing torch.distributed.tensor costs ~1 s, paid only where DTensors exist.
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")

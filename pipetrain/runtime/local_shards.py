"""This process's part of tensors that may be sharded (ZeRO-3: FSDP2 makes parameters and gradients DTensors).

The step's checks, norms and clipping work on the local shard of each gradient: every element lives on exactly
one replica of the stage, so the global norm sums each once and no collective runs outside the agreement.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (a view of its storage: in-place writes reach it), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The local shards of the gradients of ``params`` that have one."""
    return [local(p.grad) for p in params if p.grad is not None]


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of ``t`` (its shard for a DTensor)."""
    t = local(t)
    return t.numel() * t.element_size()

"""Which replica owns which parameter tensor under ZeRO sharding.

Whole tensors are owned, never slices: an optimizer that reads a whole tensor (LARS's trust ratio,
its norms) then steps exactly as unsharded. Owners are balanced by bytes (largest tensor first to the
least loaded owner, ties to the lower index), so every replica computes the same assignment from the
same tensor list without talking to the others.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def shard_owners(tensors: Sequence[torch.Tensor], parts: int) -> list[int]:
    """The owner (0 .. parts-1) of each of ``tensors``, balanced by bytes and deterministic."""
    if parts < 1:
        raise ValueError(f"shard_owners: parts must be >= 1, got {parts}")
    sizes = [t.numel() * t.element_size() for t in tensors]
    load = [0] * parts
    owners = [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners


def owned_parameters(params: Sequence[torch.Tensor], parts: int, owner: int) -> list[torch.Tensor]:
    """The tensors of ``params`` that replica ``owner`` of ``parts`` owns, in their order."""
    return [p for p, o in zip(params, shard_owners(params, parts)) if o == owner]

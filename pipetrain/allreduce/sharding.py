"""Which replica owns which whole parameter tensor under ZeRO sharding, for optimizers that read whole tensors.

An optimizer that reads a whole tensor (LARS's trust ratio, its norms; any optimizer `slices` does not know
to be elementwise) steps exactly as unsharded only on whole tensors, so its replicas own whole tensors, balanced
to within a tensor (elementwise optimizers take even slices instead: `slices`). Owners are balanced by bytes
(largest tensor first to the least loaded owner, ties to the lower index), so every replica computes the same
assignment from the same tensor list without talking to the others.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def shard_owners(tensors: Sequence[torch.Tensor], parts: int, fixed: Mapping[int, int] | None = None) -> list[int]:
    """The owner (0 .. parts-1) of each of ``tensors``, balanced by bytes and deterministic; ``fixed``
    (tensor index -> owner) assigns some beforehand, and the others are balanced around them."""
    if parts < 1:
        raise ValueError(f"shard_owners: parts must be >= 1, got {parts}")
    fixed = dict(fixed or {})
    if any(not 0 <= o < parts for o in fixed.values()):
        raise ValueError(f"shard_owners: fixed owners must be in 0..{parts - 1}, got {sorted(set(fixed.values()))}")
    sizes = [t.numel() * t.element_size() for t in tensors]
    load = [0] * parts
    owners = [0] * len(tensors)
    for i, owner in fixed.items():
        owners[i] = owner
        load[owner] += sizes[i]
    for i in sorted((i for i in range(len(tensors)) if i not in fixed), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (load[r], r))
        owners[i] = owner
        load[owner] += sizes[i]
    return owners

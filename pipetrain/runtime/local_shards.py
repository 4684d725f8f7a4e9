"""This process's part of tensors that may be sharded (ZeRO-3: FSDP2 makes parameters and gradients DTensors).

The step's checks, norms and clipping work on the local shard of each gradient: every element lives on exactly
one replica of the stage, so the global norm sums each once and no collective runs outside the agreement.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor. A DTensor exists only once ``torch.distributed.tensor`` is imported, so where
    nothing imported it the answer is no without importing it: it and FSDP2 take ~1 s of every process's
    start-up, and only zero=3 uses them."""
    package = sys.modules.get("torch.distributed.tensor")
    return package is not None and isinstance(t, package.DTensor)


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 shards ``module`` (``fully_shard``); as `is_dtensor`, without importing FSDP2 for the answer."""
    package = sys.modules.get("torch.distributed.fsdp")
    return package is not None and isinstance(module, package.FSDPModule)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard when it is a DTensor (a view of its storage: in-place writes reach it), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def local_grads(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The local shards of the gradients of ``params`` that have one."""
    return [local(p.grad) for p in params if p.grad is not None]


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of ``t`` (its shard for a DTensor)."""
    t = local(t)
    return t.numel() * t.element_size()


def gathered_bytes(module: nn.Module) -> int:
    """Under FSDP2, the bytes of ``module``'s all-gathered (unsharded) parameters present now and of the
    gradients accumulated on them (0 for a module FSDP2 does not shard): what a zero=3 stage holds besides its
    shards while a step runs."""
    if not is_fully_sharded(module):
        return 0
    from torch.distributed.fsdp import fully_shard  # imported already: `module` is fully sharded

    total = 0
    for state in fully_shard.state(module)._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            for param in group.fsdp_params:
                unsharded = getattr(param, "_unsharded_param", None)  # made at the first all-gather
                if unsharded is not None:
                    total += unsharded.untyped_storage().nbytes()  # 0 while freed
                    if unsharded.grad is not None:
                        total += unsharded.grad.nbytes
    return total


def live_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters autograd sees in ``module``'s forward: under FSDP2 the all-gathered ones
    (gathered now if they are not), else the module's own."""
    if is_fully_sharded(module):
        module.unshard()
    return [p for p in module.parameters() if p.requires_grad]


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a DTensor all-gathered (collective over its mesh: every replica calls it), else ``t``."""
    return t.full_tensor() if is_dtensor(t) else t


def whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with sharded entries made whole (collective under zero=3)."""
    return {name: whole(t) for name, t in module.state_dict().items()}


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor (from a checkpoint) cut as ``like`` is: this rank's shard of it when ``like`` is a DTensor
    (no communication: every replica holds the whole value and keeps its own part), else ``value``."""
    if not is_dtensor(like):
        return value
    from torch.distributed.tensor import distribute_tensor  # imported already: `like` is a DTensor

    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def reshard(module: nn.Module) -> None:
    """Under FSDP2, free ``module``'s all-gathered parameters (a copy of the shards: writing the shards, as a
    load does, would leave them stale); the next forward gathers them again. Nothing otherwise."""
    if is_fully_sharded(module):
        module.reshard()

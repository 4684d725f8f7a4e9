"""The part of a tensor this process holds: a sharded tensor's (a DTensor's, when tensor parallelism or FSDP cut it)
local block, else the tensor. Replicas of a stage hold the same blocks, so the reducer averages blocks as it averages
whole tensors. Duck-typed: the reducer is a standalone library and imports nothing that makes DTensors."""
from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local block when it is sharded (a DTensor), else ``t``."""
    return t.to_local() if hasattr(t, "device_mesh") and hasattr(t, "to_local") else t

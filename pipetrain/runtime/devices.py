"""Moving values between devices explicitly, never by accident.

Copies to a GPU are ``non_blocking``: from pinned host memory (a DataLoader with
``pin_memory=True``, whose slices stay pinned) they overlap with compute; from pageable memory
they are as synchronous as a plain copy. Copies to the host block, since the host reads them next.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; asynchronous where the destination is a GPU."""
    return t.to(device, non_blocking=device.type == "cuda")


def to_device(values: Any, device: torch.device) -> Any:
    """Every tensor in ``values`` (a tensor or a pytree) on ``device``; other leaves unchanged."""
    if isinstance(values, torch.Tensor):
        return move(values, device)
    return pytree.tree_map(lambda v: move(v, device) if isinstance(v, torch.Tensor) else v, values)


def caller_device(x: Any) -> torch.device:
    """The device of the first tensor in ``x`` (what the caller works on), the CPU if none."""
    leaves = [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")

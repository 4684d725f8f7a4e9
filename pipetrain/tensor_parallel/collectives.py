"""The collectives of a tensor-parallel stage, as modules its graph calls (Megatron-LM's f, g and gather).

Each is an autograd function over the stage's tensor-parallel process group:

- `ToLanes` (Megatron's f) marks a whole tensor entering the split part of the graph: nothing in forward; in
  backward each rank holds only its part of the gradient (from its slice of the features), summed over the ranks.
- `SumOverLanes` (g) ends a row-parallel matmul: its partial outputs summed over the ranks in forward; the
  gradient, whole on every rank, passes through.
- `GatherLanes` joins the ranks' slices of the last dimension (a column-parallel layer whose output is needed
  whole); backward keeps this rank's slice of the whole gradient.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _ToLanes(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverLanes(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLanes(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        lane = dist.get_rank(ctx.group)
        return grad.narrow(-1, lane * ctx.width, ctx.width).contiguous(), None


class ToLanes(nn.Module):
    """f: identity forward, gradient summed over the tensor-parallel ranks in backward."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ToLanes.apply(x, self.group) if isinstance(x, torch.Tensor) and x.requires_grad else x


class SumOverLanes(nn.Module):
    """g: partial results summed over the tensor-parallel ranks in forward, gradient passed through."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SumOverLanes.apply(x, self.group)


class GatherLanes(nn.Module):
    """The ranks' slices of the last dimension joined in rank order; backward keeps this rank's slice."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherLanes.apply(x, self.group)


class VocabularyLookup(nn.Module):
    """An embedding whose rows are split over the ranks (each holds ``rows`` consecutive ones, starting at
    ``first``): ids outside this rank's rows look up zeros; the ranks' lookups summed give every id's row."""

    def __init__(self, group: dist.ProcessGroup, first: int, rows: int):
        super().__init__()
        self.group, self.first, self.rows = group, first, rows

    def forward(self, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                sparse: bool = False) -> torch.Tensor:
        shifted = ids - self.first
        outside = (shifted < 0) | (shifted >= self.rows)
        local_padding = padding_idx - self.first if self.first <= padding_idx < self.first + self.rows else -1
        rows = torch.ops.aten.embedding.default(weight, shifted.masked_fill(outside, 0), local_padding,
                                                scale_grad_by_freq, sparse)
        return _SumOverLanes.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

"""The collectives of a tensor-parallel stage, as modules its graph calls (Megatron-LM's f, g and gather).

Each is an autograd function over the stage's tensor-parallel process group:

- `ToLanes` (Megatron's f) marks a whole tensor entering the split part of the graph: nothing in forward; in
  backward each rank holds only its part of the gradient (from its slice of the features), summed over the ranks.
- `SumOverLanes` (g) ends a row-parallel matmul: its partial outputs summed over the ranks in forward; the
  gradient, whole on every rank, passes through.
- `GatherLanes` joins the ranks' slices of one dimension (a column-parallel layer whose output is needed whole, a
  value split along the sequence read whole); backward keeps this rank's slice of the whole gradient.

Sequence parallelism (Megatron-LM's) replaces g and f around the values split along the sequence:

- `ScatterSumOverLanes` ends a row-parallel matmul with a reduce-scatter: each rank keeps its slice of the sequence
  of the summed outputs; backward all-gathers the slices' gradients.
- `SliceForLane` gives a whole tensor read next to such values this rank's slice; backward all-gathers the slices'
  gradients (each rank's slice of the whole gradient, as f's all-reduce would sum it).
- `GatherToLanes` starts a column-parallel one: the slices all-gathered; backward reduce-scatters the ranks'
  partial gradients (what f's all-reduce would sum) into each rank's slice.
- `ColumnsFromSlices` runs the column-parallel layers that read one gathered input (q, k and v; gate and up)
  together, keeping only the slice for their backward and gathering it again there (Megatron-LM's way: the whole
  input is not held from forward to backward).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' slices of dimension ``dim`` joined in rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _slice_length(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> int:
    lanes = dist.get_world_size(group)
    if x.shape[dim] % lanes:
        raise ValueError(f"sequence parallelism splits dimension {dim} of a {tuple(x.shape)} tensor over "
                         f"{lanes} tensor-parallel ranks, and {x.shape[dim]} does not divide by {lanes}: pad the "
                         f"sequences to a multiple of {lanes}, or leave 'sequence_parallel' out of tp_plan")
    return x.shape[dim] // lanes


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The ranks' ``x`` summed, of which this rank keeps its slice of dimension ``dim`` (one reduce-scatter: the
    collective takes slices of the first dimension, so ``dim`` is moved there and back)."""
    length = _slice_length(x, dim, group)
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((length, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


def _lane_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's slice of dimension ``dim`` of the whole ``x``."""
    length = _slice_length(x, dim, group)
    return x.narrow(dim, dist.get_rank(group) * length, length).contiguous()


def _collective_pair(name: str, forward: Callable, backward: Callable) -> type[torch.autograd.Function]:
    """An autograd function computing ``forward(x, dim, group)``, whose gradient is ``backward(grad, dim, group)``."""
    def run(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return forward(x, dim, group)

    def gradient(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return backward(grad, ctx.dim, ctx.group), None, None

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(run), "backward": staticmethod(gradient)})


_GatherLanes = _collective_pair("_GatherLanes", _all_gather, _lane_slice)
_ScatterSumOverLanes = _collective_pair("_ScatterSumOverLanes", _reduce_scatter, _all_gather)
_SliceForLane = _collective_pair("_SliceForLane", _lane_slice, _all_gather)
_GatherToLanes = _collective_pair("_GatherToLanes", _all_gather, _reduce_scatter)


class _ColumnsFromSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup, dim: int, x: torch.Tensor,
                *layers: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        # Under autocast the matmuls run in its dtype; the backward's run in the same (it is not active there).
        device = x.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None
        ctx.group, ctx.dim, ctx.biases = group, dim, [b is not None for b in layers[1::2]]
        weights = layers[0::2]
        ctx.save_for_backward(x, *weights)
        whole = _all_gather(x, dim, group)
        return tuple(F.linear(whole, w, b) for w, b in zip(weights, layers[1::2]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        device, dtype = ctx.autocast if ctx.autocast is not None else (x.device.type, None)
        with torch.autocast(device, dtype=dtype, enabled=ctx.autocast is not None):
            whole = _all_gather(x, ctx.dim, ctx.group)  # gathered again: only the slice was kept
            rows = whole.reshape(-1, whole.shape[-1])
            grad_whole, layers = None, []
            for grad, weight, bias in zip(grads, weights, ctx.biases):
                if grad is None:
                    layers += [None, None]
                    continue
                flat = grad.reshape(-1, grad.shape[-1])
                part = grad @ weight.to(grad.dtype)
                grad_whole = part if grad_whole is None else grad_whole + part
                layers += [(flat.t() @ rows.to(flat.dtype)).to(weight.dtype),
                           flat.sum(0).to(weight.dtype) if bias else None]
        grad_x = None if grad_whole is None else _reduce_scatter(grad_whole.to(x.dtype), ctx.dim, ctx.group)
        return (None, None, grad_x, *layers)


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


class _AlongDimension(nn.Module):
    """A collective over the tensor-parallel ranks along dimension ``dim`` (its autograd function: ``function``)."""

    function: type[torch.autograd.Function]

    def __init__(self, group: dist.ProcessGroup, dim: int):
        super().__init__()
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, self.group, self.dim)


class GatherLanes(_AlongDimension):
    """The ranks' slices of dimension ``dim`` joined in rank order; backward keeps this rank's slice."""

    function = _GatherLanes


class ScatterSumOverLanes(_AlongDimension):
    """Sequence parallelism's g: partial results summed over the ranks, each keeping its slice of dimension ``dim``
    (reduce-scatter); backward all-gathers the gradient."""

    function = _ScatterSumOverLanes


class SliceForLane(_AlongDimension):
    """A whole tensor cut to this rank's slice of dimension ``dim`` (to meet values split along the sequence);
    backward all-gathers the slices' gradients."""

    function = _SliceForLane


class ColumnsFromSlices(nn.Module):
    """Column-parallel linear layers reading one input split along dimension ``dim`` (sequence parallelism): the
    input all-gathered for them once, each layer's output returned (a tuple, in the order of the (weight, bias)
    pairs given); backward gathers it again and reduce-scatters the summed input gradient to the slices."""

    def __init__(self, group: dist.ProcessGroup, dim: int):
        super().__init__()
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor, *layers: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        return _ColumnsFromSlices.apply(self.group, self.dim, x, *layers)


class GatherToLanes(_AlongDimension):
    """Sequence parallelism's f: the ranks' slices of dimension ``dim`` all-gathered for a column-parallel layer;
    backward sums the ranks' partial gradients, each keeping its slice (reduce-scatter)."""

    function = _GatherToLanes


class VocabularyLookup(nn.Module):
    """An embedding whose rows are split over the ranks (each holds ``rows`` consecutive ones, starting at
    ``first``): ids outside this rank's rows look up zeros; the ranks' lookups summed give every id's row."""

    def __init__(self, group: dist.ProcessGroup, first: int, rows: int, scatter_dim: int | None = None):
        super().__init__()
        self.group, self.first, self.rows = group, first, rows
        self.scatter_dim = scatter_dim  # sequence parallelism: each rank keeps its slice of this dimension

    def forward(self, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
                sparse: bool = False) -> torch.Tensor:
        shifted = ids - self.first
        outside = (shifted < 0) | (shifted >= self.rows)
        local_padding = padding_idx - self.first if self.first <= padding_idx < self.first + self.rows else -1
        rows = torch.ops.aten.embedding.default(weight, shifted.masked_fill(outside, 0), local_padding,
                                                scale_grad_by_freq, sparse)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.scatter_dim is not None:
            return _ScatterSumOverLanes.apply(rows, self.group, self.scatter_dim)
        return _SumOverLanes.apply(rows, self.group)

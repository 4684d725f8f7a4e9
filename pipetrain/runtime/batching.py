"""Splitting mini-batches into micro-batches and merging outputs back.

Inputs may be a tensor, a tuple/list of model inputs or a dict of keyword inputs;
every tensor leaf is split along dim 0, non-tensor leaves are passed to every
micro-batch unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


def batch_size(batch: Any) -> int:
    """Size of dim 0 of the first tensor in ``batch``."""
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return batch.shape[0]
    if type(batch) is tuple and all(isinstance(v, torch.Tensor) for v in batch):  # a micro-batch: no tree walk
        for v in batch:
            if v.dim() > 0:
                return v.shape[0]
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise TypeError(
        "the mini-batch holds no tensor with a batch dimension; pass a tensor, or a tuple/dict "
        "of tensors whose dim 0 is the batch")


def split_micro_batches(batch: Any, micro_batches: int) -> list[Any]:
    """Split every tensor leaf of ``batch`` into ``micro_batches`` pieces along dim 0.

    Pieces differ in size by at most one sample (``torch.tensor_split``), so an uneven
    mini-batch still gives exactly ``micro_batches`` micro-batches.
    """
    size = batch_size(batch)
    if size < micro_batches:
        raise ValueError(
            f"the mini-batch has {size} samples but micro_batches={micro_batches}; "
            f"use micro_batches <= {size} or a larger batch")
    if isinstance(batch, torch.Tensor):  # a target, split on every step: no tree to flatten and rebuild
        return list(torch.tensor_split(batch, micro_batches, dim=0))
    if type(batch) is tuple and all(
            isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size for v in batch):
        # The usual positional inputs, likewise.
        return list(zip(*(torch.tensor_split(v, micro_batches, dim=0) for v in batch)))
    leaves, spec = pytree.tree_flatten(batch)
    pieces = [
        torch.tensor_split(leaf, micro_batches, dim=0)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size
        else [leaf] * micro_batches
        for leaf in leaves
    ]
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(micro_batches)]


def merge_micro_batches(outputs: list[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 (tensor leaves; other leaves are the first one's).
    A 0-dim tensor (a value reduced over its micro-batch) has no whole-batch value to merge into: it is
    an error (predict runs such a model's batch as one micro-batch, ``ModelIO.splits_by_sample``)."""
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for i, first in enumerate(flat[0][0]):
        if not isinstance(first, torch.Tensor):
            merged.append(first)
        elif first.dim() == 0:
            raise ValueError("a 0-dim output of one micro-batch cannot be merged into the whole batch's value; "
                             "run the batch as one micro-batch")
        else:
            merged.append(torch.cat([f[0][i] for f in flat], dim=0))
    return pytree.tree_unflatten(merged, spec)


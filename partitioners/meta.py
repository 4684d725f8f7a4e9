"""Models on the meta device: tensors with shapes and dtypes and no data.

A model built under ``torch.device("meta")`` is captured and partitioned as it is; a graph that held a
model's real tensors can be turned into the same graph over meta stand-ins, so that keeping the plan does
not keep the model's memory alive.
"""
from __future__ import annotations

import copy
import itertools
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


def holds_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (built without data)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def with_meta_tensors(obj: T, *modules: nn.Module) -> T:
    """A deep copy of ``obj`` in which every real parameter and buffer of ``modules`` is replaced by a meta
    stand-in (Parameters stay Parameters; tensors that were one tensor stay one). Nothing is allocated."""
    memo: dict[int, object] = {}
    for module in modules:
        for t in itertools.chain(module.parameters(), module.buffers()):
            if not t.is_meta and id(t) not in memo:
                meta = t.detach().to("meta")
                memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(obj, memo)

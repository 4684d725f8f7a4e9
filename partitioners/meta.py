"""Models on the meta device: tensors with shapes and dtypes and no data.

A model built under ``torch.device("meta")`` is captured and partitioned as it is; a graph that held a
model's real tensors can be turned into the same graph over meta stand-ins, so that keeping the plan does
not keep the model's memory alive.
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, TypeVar

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


ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention)


def fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                    enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as a real device runs it, for counting what it saves on the meta device.

    The meta device only has the unfused math path, which saves the attention weights (sequence^2 per head)
    for the backward; the fused kernels CPUs and GPUs run save the inputs, the output and a log-sum-exp row.
    The CPU's flash kernel has a meta implementation that saves just that; it takes grouped-query attention's
    fewer key/value heads as they are (``enable_gqa``), as the real kernel does. A mask that requires grad (T5's
    learned position bias) is one no fused kernel takes: real devices run the math path then, as here."""
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, enable_gqa=enable_gqa)
    if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool:  # as the CPU kernel does: additive
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def saved_on_device(node_target: Any, fn: Callable) -> Callable:
    """What to run, on the meta device, to count what ``fn`` (a call of ``node_target``) saves on a real one."""
    return fused_attention if node_target in ATTENTION else fn

"""A stage that runs its forward, input-gradient (B) and weight-gradient (W) graphs from
``pipetrain.runtime.graph_split`` instead of autograd: how compiled stages run the split schedules.

The graphs are derived at the first forward of each input signature (shapes and dtypes) and compiled
when asked. Where a stage cannot be split at graph level, the stage says why once (``fallback``, and a
warning naming the stage) and from then on runs its eager module with the autograd split
(``pipetrain.runtime.split_backward``): that split needs the module's own autograd graph, which a
compiled module hides in one node, so such a stage runs uncompiled rather than with a whole backward in
B (which would keep the schedule's bubbles).
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipetrain.runtime.graph_split import GraphSplit, GraphSplitUnsupported, derive, signature
from pipetrain.runtime.tensor_bytes import storage_bytes, storage_key


@dataclass
class GraphFlight:
    """What a graph forward leaves for its B: its graphs, inputs, loss weight, and its saved values and flat
    outputs (None when the forward runs again before B)."""

    split: GraphSplit
    inputs: tuple
    weight: float
    saved: list[torch.Tensor] | None
    outputs: list[torch.Tensor] | None


class GraphBackward:
    """One stage's derived graphs by input signature, or the reason it falls back to the eager split."""

    def __init__(self, stage: int, module: nn.Module, compile_options: dict[str, Any] | None):
        self.stage = stage
        self.module = module
        self.compile_options = compile_options
        self.fallback: str | None = None
        self._splits: dict[tuple, GraphSplit] = {}
        self._weights = [p for p in module.parameters() if p.requires_grad]
        self._constants = [p for p in module.parameters() if not p.requires_grad] + list(module.buffers())
        self._param_storages = {storage_key(p) for p in module.parameters()}

    def fall_back(self, reason: str) -> None:
        """Run this stage eager with the autograd split from now on, telling the user why."""
        self.fallback = reason
        warnings.warn(f"stage {self.stage}: its backward is not split at graph level ({reason}); it runs eager, "
                      "uncompiled, with the autograd split of its backward", stacklevel=3)

    def split_for(self, inputs: tuple, target: Any, loss_fn: Callable | None, takes_input_grads: bool,
                  autocast: contextlib.AbstractContextManager) -> GraphSplit | None:
        """The graphs for these inputs (derived on first sight), or None where the stage falls back."""
        if self.fallback is not None:
            return None
        if not all(isinstance(v, torch.Tensor) for v in inputs):
            self.fall_back("its inputs are not all tensors")
            return None
        target_leaves = [t for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
        # Shapes and dtypes decide: which inputs take a gradient follows from them (floating ones, past stage 0),
        # and the stage's autocast never changes.
        key = (tuple((tuple(v.shape), v.dtype) for v in inputs), signature(target_leaves))
        split = self._splits.get(key)
        if split is None:
            args = [v.detach().requires_grad_() if takes_input_grads and v.is_floating_point() else v for v in inputs]
            try:
                split = derive(self.module, tuple(args), target, loss_fn, autocast, self.compile_options)
            except GraphSplitUnsupported as exc:
                self.fall_back(str(exc))
                return None
            self._splits[key] = split
        return split

    @torch.no_grad()
    def forward(self, split: GraphSplit, inputs: tuple, target: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The forward graph on the stage's live weights: (flat outputs, saved values)."""
        target_leaves = [] if target is None else pytree.tree_leaves(target)
        values = split.forward(*self._weights, *self._constants, *inputs, *target_leaves)
        return list(values[:split.num_outputs]), list(values[split.num_outputs:])

    def held_bytes(self, tensors: list[torch.Tensor]) -> int:
        """Bytes of ``tensors``' storages, the weights' left out (saved views of weights cost nothing)."""
        return storage_bytes([t for t in tensors if storage_key(t) not in self._param_storages])

    @torch.no_grad()
    def input_grads(self, split: GraphSplit, saved: list[torch.Tensor], tangents: list[torch.Tensor]
                    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """B: the input gradients and what W reads (empty where B computed the weight gradients too)."""
        b_args = [saved[i] for i in split.saved_for_b] + tangents
        values = list(split.input_grads(*b_args))
        if split.weight_grads is None:  # no input takes a gradient: B was the whole backward
            self.accumulate(values, b_args)
            return [], []
        kept = values[split.num_input_grads:]
        for_w = [b_args[i] for i in split.w_from_b] + [saved[i] for i in split.w_saved] + kept
        return values[:split.num_input_grads], for_w

    @torch.no_grad()
    def weight_grads(self, split: GraphSplit, for_w: list[torch.Tensor]) -> None:
        """W: the weight gradients, accumulated into the weights' ``.grad``."""
        if split.weight_grads is not None:
            self.accumulate(list(split.weight_grads(*for_w)), for_w)

    def accumulate(self, grads: list[torch.Tensor | None], read: list[torch.Tensor]) -> None:
        """Add ``grads`` into the weights' ``.grad`` as autograd's accumulation does (a gradient that is
        one of the graph's inputs ``read``, such as a received tangent, is copied, not adopted)."""
        inputs = {storage_key(t) for t in read}
        for p, g in zip(self._weights, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.clone() if storage_key(g) in inputs else g.contiguous()
            else:
                p.grad.add_(g)

"""Running a stage's module on other weight tensors than its parameters: the staleness policies' weight sets.

``torch.func.functional_call`` does this, but on every call it builds a member accessor and walks the
whole module to find tied parameters: on a stage run once per micro-batch that walk costs more than
the swap (190 us a call for VGG-11's 26 parameters, growing with their count). ``WeightSwap`` finds the
ties and builds the accessor once per module; each call swaps the tensors in, runs the module and swaps
the parameters back, as ``functional_call(module, weights, args)`` does (``tie_weights=True``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor


class WeightSwap:
    """Calls ``module`` with the parameters named in a weight set replaced by its tensors."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.accessor = NamedMemberAccessor(module)
        # Every name a parameter has, under the name named_parameters() gives it first (the weight sets' key).
        first: dict[int, str] = {}
        self.names: dict[str, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(first.setdefault(id(p), name), []).append(name)

    def __call__(self, weights: dict[str, torch.Tensor], args: tuple) -> Any:
        """``module(*args)`` with ``weights`` in place of the parameters they name (and of their ties)."""
        swapped = {alias: t for name, t in weights.items() for alias in self.names.get(name, (name,))}
        originals, _ = self.accessor.swap_tensors_dict(swapped)
        try:
            return self.module(*args)
        finally:
            self.accessor.swap_tensors_dict(originals)

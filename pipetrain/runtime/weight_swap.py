"""Running a stage's module on other weight tensors than its parameters: the staleness policies' weight sets.

``torch.func.functional_call`` does this, but on every call it builds a member accessor and walks the
whole module to find tied parameters: on a stage run once per micro-batch that walk costs more than
the swap (190 us a call for VGG-11's 26 parameters, growing with their count). ``WeightSwap`` finds,
once per module, every slot a parameter occupies (the ``_parameters`` dict of the submodule that
registers it, and the name there; a tied parameter has several); each call writes the weight set's
tensors into those slots, runs the module and writes the parameters back, as
``functional_call(module, weights, args)`` does (``tie_weights=True``), for a dict write per slot
instead of the accessor's path walk and type checks (a fifth of the async policies' runtime cost).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class WeightSwap:
    """Calls ``module`` with the parameters named in a weight set replaced by its tensors."""

    def __init__(self, module: nn.Module):
        self.module = module
        # Under the name named_parameters() gives each parameter first (the weight sets' key): its slots.
        first: dict[int, str] = {}
        self.slots: dict[str, list[tuple[dict, str]]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            prefix, _, leaf = name.rpartition(".")
            owner = module.get_submodule(prefix)
            self.slots.setdefault(first.setdefault(id(p), name), []).append((owner._parameters, leaf))

    def __call__(self, weights: dict[str, torch.Tensor], args: tuple) -> Any:
        """``module(*args)`` with ``weights`` in place of the parameters they name (and of their ties)."""
        originals: list[tuple[dict, str, Any]] = []
        try:
            for name, tensor in weights.items():
                for params, leaf in self.slots[name]:
                    originals.append((params, leaf, params[leaf]))
                    params[leaf] = tensor
            return self.module(*args)
        finally:
            for params, leaf, original in reversed(originals):
                params[leaf] = original

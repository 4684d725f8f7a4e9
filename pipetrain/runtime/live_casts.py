"""Low-precision copies of swapped-in weights, cast again when the backward reads them.

Under autocast an op casts a float32 weight to bf16 (or fp16) and autograd saves that copy for the backward.
A staleness policy whose backward must read other values than its forward through the same tensors
(``vanilla``: the live weights, moved on by the updates in between; the paper's ``spectrain``: the backward's
own prediction, written into the scratch copy) would then compute with the forward's values. These hooks save,
instead of such a copy, the weight it was cast from, and cast it again when the backward unpacks it: the
backward reads the weight's values at that time, in the precision autocast chose, and the copies are not held
between forward and backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Recast:
    """A saved view (size, stride, offset) of the ``dtype`` copy of ``source``."""
    source: torch.Tensor
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class LiveCasts:
    """Pack and unpack functions for ``torch.autograd.graph.saved_tensors_hooks`` over ``weights``."""

    def __init__(self, weights: list[torch.Tensor]):
        self.ids = {id(w) for w in weights}

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Recast:
        """A cast of one of the weights (autocast's ``to``, the only op between a leaf weight and its copy), or a
        view of one (a linear layer saves the transpose), becomes a note to cast again; any other tensor is
        saved as it is."""
        base = t._base if t._base is not None else t
        fn = base.grad_fn
        if fn is not None and fn.name() == "ToCopyBackward0":
            source = getattr(fn.next_functions[0][0], "variable", None)
            if source is not None and id(source) in self.ids and base.stride() == source.stride():
                return _Recast(source, t.dtype, tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset())
        return t

    @staticmethod
    def unpack(packed: torch.Tensor | _Recast) -> torch.Tensor:
        if isinstance(packed, _Recast):
            copy = packed.source.detach().to(packed.dtype)
            return copy.as_strided(packed.size, packed.stride, copy.storage_offset() + packed.offset)
        return packed

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

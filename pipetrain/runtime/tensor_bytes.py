"""Measured memory of one stage: the bytes of the tensors it keeps alive.

On the CPU there is no allocator statistic, so a stage counts its tensors: parameters, optimizer
state and extra weight versions (at the step report), and at every moment its held bytes can peak
(after a forward, at the end of a backward) the gradients present plus the activations of its
in-flight micro-batches. A micro-batch's activations are the storages autograd saves for its
backward, each counted once (``torch.autograd.graph.saved_tensors_hooks``), weights excluded, plus
the boundary inputs the stage keeps for it. On CUDA the device's allocator peak
(``torch.cuda.max_memory_allocated``) is the measure.
"""
from __future__ import annotations

import torch
from torch import nn

from pipetrain.runtime.live_casts import LiveCasts
from pipetrain.runtime.local_shards import local


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _count(seen: dict[int, int], t: torch.Tensor) -> None:
    # A micro-batch is a view of its mini-batch's storage, which the caller holds anyway: count the
    # bytes the tensor spans, once per storage (the largest of the tensors seen on it). A sharded tensor
    # (ZeRO-3) counts its local shard.
    t = local(t)
    key = storage_key(t)
    seen[key] = max(seen.get(key, 0), t.numel() * t.element_size())


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            _count(seen, t)
    return sum(seen.values())


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The bytes of the distinct storages autograd saves for a backward, weights excluded, together
    with the ``held`` tensors (boundary inputs) the stage keeps for the same micro-batch; with ``casts``
    those hooks apply too (they run in place of any outer ones)."""

    def __init__(self, weights: set[int], held: list[torch.Tensor], casts: LiveCasts | None = None):
        self.storages: dict[int, int] = {}
        for t in held:
            _count(self.storages, t)

        def pack(t: torch.Tensor):
            packed = casts.pack(t) if casts is not None else t
            if packed is t and storage_key(t) not in weights:  # a weight cast again at backward is not held
                _count(self.storages, t)
            return packed

        super().__init__(pack, casts.unpack if casts is not None else lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def grad_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of the gradients present. Takes the parameter list, not the module: this runs after every
    forward and backward, and walking module.parameters() (a generator through every submodule) costs
    several times the sum itself."""
    return sum(local(g).nbytes for g in [p.grad for p in params] if g is not None)


def resident_bytes(params: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, weight_versions: int) -> int:
    """Parameters, optimizer state and extra weight versions: what a stage holds between steps."""
    state = 0
    if optimizer is not None:
        state = storage_bytes(t for s in optimizer.state.values() for t in s.values())
    return storage_bytes(params) + state + weight_versions

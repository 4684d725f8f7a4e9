"""Even ZeRO shards for elementwise optimizers: the optimizer steps flat slices of the parameters.

An optimizer whose update of an element reads only that element's parameter, gradient and state (SGD,
Adam, ...) steps a flat slice of a tensor exactly as it steps the whole tensor, so a replica can own an even
range of a bucket that cuts tensors (as Megatron's distributed optimizer and DeepSpeed do). A slice is a
1-D view of its parameter's storage: the optimizer's update lands in the parameter itself, and the
all-gather after the step fills the ranges the other replicas own. Optimizers that read a whole tensor
(LARS's and LAMB's trust ratios, anything not listed here) keep whole-tensor ownership (`sharding.shard_owners`).
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from pipetrain.allreduce.local import local

# Exact classes (a subclass may override step() with a per-tensor rule), each checked elementwise: every
# per-parameter state tensor has the parameter's shape, the others are step counts (0-dim).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta)

# parameter -> its slice in this process (a process is one replica: one slice per parameter at most). The
# slice refers back to its parameter weakly, so a pipeline's parameters die with it.
_SLICES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def steps_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps a slice of a tensor exactly as the whole tensor (decided by its class)."""
    return type(optimizer) in ELEMENTWISE


def shards_evenly(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> bool:
    """Whether the optimizers ``factory`` builds take even shards: probed on one parameter, so every rank
    decides alike before building anything."""
    return steps_elementwise(factory([torch.nn.Parameter(torch.zeros(1))]))


def slice_of(param: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Elements ``start:stop`` of ``param`` flattened (of this rank's block of it, when tensor parallelism splits
    it), as a tensor the optimizer steps in place of it (the same object again for the same range, so a reducer
    rebuilt after a failed step finds the optimizer's own)."""
    existing = _SLICES.get(param)
    if existing is not None and existing.pipetrain_slice[1:] == (start, stop):
        return existing
    block = local(param)  # a tensor-parallel rank's block of a split parameter: its replicas share that block
    if not block.is_contiguous():
        raise ValueError(f"zero: a parameter of shape {tuple(param.shape)} is not contiguous, so a flat slice of "
                         "it cannot be a view; make it contiguous (param.data = param.data.contiguous()) before wrap")
    piece = block.detach().view(-1)[start:stop]
    piece.pipetrain_slice = (weakref.ref(param), start, stop)
    _SLICES[param] = piece
    return piece


def source_of(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The parameter a slice was cut from and where it starts in it (None: ``tensor`` is no slice)."""
    found = getattr(tensor, "pipetrain_slice", None)
    return None if found is None else (found[0](), found[1])


def cut_state(state: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """A whole tensor's optimizer state cut to elements ``start:stop`` (of this rank's block of it when the state
    is sharded): per-element tensors are sliced (copies), step counts (0-dim) and other values kept."""
    return {k: local(v).reshape(-1)[start:stop].clone() if isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in state.items()}


def step_slices(optimizer: torch.optim.Optimizer, slices: Mapping[int, torch.Tensor]) -> None:
    """Make ``optimizer`` (built over whole parameters) step their slices: id(parameter) -> its slice; a parameter
    without one leaves its group, which stays (possibly empty) so the groups keep their hyper-parameters and
    count. State it already holds (Adagrad's, made at construction) is cut to the slice. Idempotent."""
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            piece = p if source_of(p) is not None else slices.get(id(p))
            state = optimizer.state.pop(p, None)
            if piece is None:
                continue
            kept.append(piece)
            if state is not None and piece is not p:
                optimizer.state[piece] = cut_state(state, *piece.pipetrain_slice[1:])
            elif state is not None:
                optimizer.state[piece] = state
        group["params"] = kept

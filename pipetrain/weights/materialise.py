"""A stage's parameters and buffers, made on its own device: the one place a stage gets its tensors.

Three sources, in the order a user meets them:

- the model's own tensors (a model built with data): the stage holds copies of them, moved to its device;
- a checkpoint (``weights=``): the stage's tensors are made empty on its device and each is read from the
  file, one at a time; buffers the model keeps out of its state dict (rotary caches) are computed, not read;
- neither, for a model on the meta device: each module's own initialiser, with a random stream per tensor
  derived from ``seed`` and its name, so every stage count gives the same initial weights.

Names are checked against the checkpoint once, on every rank alike, before any stage is built, so a
checkpoint that does not fit raises the same error everywhere and nothing trains.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from partitioners.stage_builder import retarget_devices
from partitioners.state_names import StateNames
from pipetrain.adapters import AdapterLayout
from pipetrain.runtime.local_shards import is_dtensor, shard_like
from pipetrain.weights.initialise import initial_tensors
from pipetrain.weights.sources import WeightSource, copy_into, match_names, open_weights

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


@dataclass
class StageTensors:
    """Where this process's stages get their tensors (module doc)."""

    model: nn.Module                     # the captured model: its meta stand-in when built without data
    names: StateNames                    # the model's alias groups and state-dict keys
    without_data: bool                   # the model is on the meta device
    seed: int
    source: WeightSource | None = None
    keys: dict[str, str] = field(default_factory=dict)   # state name -> the checkpoint key it is read from

    @classmethod
    def prepare(cls, model: nn.Module, names: StateNames, without_data: bool, weights: str | os.PathLike | None,
                seed: int) -> StageTensors:
        """Open ``weights`` (if given) and check its names against the whole model's (module doc)."""
        tensors = cls(model, names, without_data, seed)
        if weights is not None:
            tensors.source = open_weights(weights)
            expected = {n: (t.shape, t.dtype) for n, t in {**names.params, **names.buffers}.items()
                        if n in names.persistent}
            groups = [list(g) for g in dict.fromkeys(tuple(names.aliases.get(n, [n])) for n in expected)]
            recomputed = set(names.buffers) - names.persistent
            adapters = AdapterLayout.of(model)
            if adapters is not None and not set(expected) & set(tensors.source.names()):
                tensors.keys = _base_keys(tensors.source, adapters, expected, groups, recomputed)
            else:
                tensors.keys = match_names(tensors.source.names(), expected,
                                           [[n for n in g if n in expected] for g in groups], recomputed,
                                           source=tensors.source.describe())
        return tensors

    def materialise(self, stage: nn.Module, device: torch.device) -> nn.Module:
        """``stage`` (a stage module the plan built: copies of the model's tensors, meta ones when the model
        has no data) with its tensors made on ``device`` and filled (module doc)."""
        retarget_devices(stage, device)
        if not self.without_data:
            stage.to(device)
            if self.source is not None:
                copy_into(self.source, {n: t for n, t in _state(stage).items() if n in self.keys}, self.keys)
            return stage
        state = _state(stage)
        groups: dict[int, list[str]] = {}  # names that are one tensor
        for name, t in state.items():
            groups.setdefault(id(t), []).append(name)
        read = [names for names in groups.values() if any(n in self.keys for n in names)]
        made = initial_tensors(self.model, [n for names in groups.values() if names not in read for n in names],
                               self.seed)
        for names in read:  # made empty where they live; the checkpoint fills them
            empty = torch.empty(state[names[0]].shape, dtype=state[names[0]].dtype, device=device)
            made.update(dict.fromkeys(names, empty))
        fresh = _replace(stage, state, made, device)
        if read:
            copy_into(self.source, {n: fresh[n] for names in read for n in names if n in self.keys}, self.keys)
        return stage

    def materialise_shards(self, stage: nn.Module, device: torch.device, shard: Callable[[nn.Module], None]) -> str:
        """A model without data, sharded: ``shard`` (FSDP2's ``fully_shard`` for zero=3, tensor parallelism's split)
        cuts ``stage``'s meta parameters into DTensors, then only this rank's shard of each is made on ``device``
        and filled, from the checkpoint or the initialiser, one whole tensor in host memory at a time. Returns a digest of the whole tensors (names,
        values), which every replica of the stage computes alike when they read the same source."""
        retarget_devices(stage, device)
        shard(stage)
        stage.to_empty(device=device)  # each DTensor parameter's local shard is made; the buffers whole
        targets: dict[str, Any] = {}
        made: dict[int, Any] = {}
        for name, t in _state(stage).items():
            if id(t) not in made:
                made[id(t)] = _ShardTarget(t) if is_dtensor(t) else _WholeTarget(t)
            targets[name] = made[id(t)]
        groups: dict[int, list[str]] = {}
        for name, target in targets.items():
            groups.setdefault(id(target), []).append(name)
        read = [names for names in groups.values() if any(n in self.keys for n in names)]
        with torch.no_grad():
            for names in groups.values():
                if names not in read:  # one tensor at a time: initial_tensors keeps every tensor it makes
                    targets[names[0]].copy_(initial_tensors(self.model, names[:1], self.seed)[names[0]])
            if read:
                copy_into(self.source, {n: targets[n] for names in read for n in names if n in self.keys}, self.keys)
        digest = hashlib.sha256()
        for names in sorted(groups.values()):
            digest.update(f"{names[0]} {targets[names[0]].digest};".encode())
        return digest.hexdigest()

    def close(self) -> None:
        """Release the checkpoint once every stage is made (its memory-mapped pages count until then)."""
        if self.source is not None:
            self.source.close()


def _base_keys(source: WeightSource, adapters: AdapterLayout, expected: dict, groups: list[list[str]],
               recomputed: set[str]) -> dict[str, str]:
    """A PEFT model read from its base model's checkpoint (none of the PEFT names in it): every tensor but the
    adapter's factors is read under its base name; the factors are initialised as LoRA initialises them."""
    base = {n: adapters.base_name(n) for n in expected if not adapters.is_factor(n)}
    keys = match_names(source.names(), {base[n]: expected[n] for n in base},
                       [[base[n] for n in g if n in base] for g in groups if any(n in base for n in g)],
                       {adapters.base_name(n) for n in recomputed}, source=source.describe())
    return {n: keys[b] for n, b in base.items()}


def _state(stage: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``stage`` under every name it has."""
    return {**dict(stage.named_parameters(remove_duplicate=False)),
            **dict(stage.named_buffers(remove_duplicate=False))}


def _replace(stage: nn.Module, state: dict[str, torch.Tensor], made: dict[str, torch.Tensor],
             device: torch.device) -> dict[str, torch.Tensor]:
    """Put ``made``'s tensors, moved to ``device`` (initial values are made on the CPU, so every device gets the
    same), in place of ``stage``'s meta ones under every name; names that were one tensor stay one tensor."""
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for name, old in state.items():
        new = made[name]
        if id(new) not in moved:
            data = new.detach().to(device)
            moved[id(new)] = nn.Parameter(data, old.requires_grad) if isinstance(old, nn.Parameter) else data
        out[name] = moved[id(new)]
        owner_path, _, leaf = name.rpartition(".")
        owner = stage.get_submodule(owner_path)
        table = owner._parameters if isinstance(old, nn.Parameter) else owner._buffers
        table[leaf] = out[name]
    return out


class _ShardTarget:
    """Where a whole tensor goes when only this rank's shard of it is kept (``copy_into`` writes it)."""

    def __init__(self, param: DTensor) -> None:
        self.param, self.shape, self.digest = param, param.shape, ""

    def copy_(self, whole: torch.Tensor) -> None:
        self.digest = _tensor_digest(whole)
        self.param.to_local().copy_(shard_like(whole.to(self.param.dtype), self.param).to_local())


class _WholeTarget:
    """A tensor kept whole (a buffer: FSDP2 shards parameters only)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.digest = tensor, tensor.shape, ""

    def copy_(self, whole: torch.Tensor) -> None:
        self.digest = _tensor_digest(whole)
        self.tensor.copy_(whole)


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode() + t.reshape(-1).view(torch.uint8).numpy().tobytes()
                          ).hexdigest()

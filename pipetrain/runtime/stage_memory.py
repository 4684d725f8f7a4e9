"""The runtime's share of the planner's memory model (partitioners.MemoryModel): what a stage holds
under a given schedule, staleness policy, optimizer and recomputation setting."""
from __future__ import annotations

from typing import Callable

import torch

import partitioners
import schedules
from pipetrain.optim.combined import combine
from pipetrain.runtime.staleness import POLICIES
from pipetrain.runtime.tensor_bytes import storage_bytes
from partitioners.memory_model import SETTINGS, Moments
from schedules.held_activations import held_activations
from schedules.placement import virtual_stage_of


def schedule_moments(actions: list[list[schedules.Action]], stages: int,
                     placement: str = "loop") -> dict[str, list[Moments]]:
    """Per recomputation setting and virtual stage (``placement`` says which one each position's chunk is),
    the moments its held bytes may peak."""
    chunks = 1 + max((a.chunk for listed in actions for a in listed), default=0)
    out: dict[str, list] = {}
    for setting in SETTINGS:
        per_stage: list = [[] for _ in range(stages * chunks)]
        for d, listed in enumerate(actions):
            if d == 0:
                # Virtual stage 0 (chunk 0 of position 0 in every placement) takes no input gradient, so its
                # backward never splits (StageRuntime.backward): it frees its activations at B and its W's
                # do nothing. Without them the chunk counts as a whole backward.
                listed = [a for a in listed if not (a.kind is schedules.ActionKind.WEIGHT and a.chunk == 0)]
            for c, moments in held_activations(listed, setting).items():
                per_stage[virtual_stage_of(d, c, stages, placement)] = sorted(moments)
        out[setting] = per_stage
    return out


def weight_versions(policy: str, stages: int, recompute: str) -> tuple[float, ...]:
    """Extra weight copies per stage, as the policy declares them (``StalenessPolicy.weight_versions``),
    plus, when recomputing a policy that keeps the forward's weights for it, one per micro-batch in flight (N-k)."""
    kind = POLICIES[policy]
    keeps = kind.recompute_keeps_forward_weights and recompute in ("except-last", "always")
    return tuple(kind.weight_versions(k, stages) + (stages - k if keeps else 0) for k in range(stages))


def optimizer_state_factor(optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> float:
    """Bytes of optimizer state per parameter byte (SGD with momentum 1, Adam 2), found by stepping the
    factory's optimizer once on a scratch parameter (per-tensor scalars such as Adam's step count are
    left out: they do not grow with the model)."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = combine(optimizer([p]))
    if not isinstance(opt, torch.optim.Optimizer):  # the stages' construction reports it, with the fix
        return 0.0
    p.grad = torch.zeros_like(p)
    opt.step()
    state = storage_bytes(t for s in opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
    return state / (p.numel() * p.element_size())


def memory_model(actions: list[list[schedules.Action]], stages: int, policy: str, recompute: str,
                 optimizer: Callable, zero: int = 0, data_parallel: int = 1,
                 placement: str = "loop") -> partitioners.MemoryModel:
    """The memory model of a pipeline running ``actions`` (one list per pipeline position, its chunks placed
    as ``placement`` says: schedules.placement). With ``zero`` >= 1 a
    replica holds 1/``data_parallel`` of the optimizer state. ZeRO-2's gradient shard does not lower
    the peak: gradients accumulate whole over a step's micro-batches and are sharded only after the
    last backward, so the moments the gradients are counted at are the same."""
    moments = schedule_moments(actions, stages, placement)
    virtual = len(moments["none"])
    versions = weight_versions(policy, virtual, recompute)
    shards = data_parallel if zero else 1
    return partitioners.MemoryModel(moments, optimizer_state_factor(optimizer) / shards, versions, recompute)

"""Tensor parallelism inside each pipeline stage (``wrap(..., tensor_parallel=T)``).

A stage's T tensor-parallel ranks each run the stage's graph rewritten by `placement` with their block of every
planned layer (`parameters`), the collectives of `collectives` placed where Megatron-LM places them. The plan comes
from `styles` (wrap's ``tp_plan=`` or the model's own) or `automatic`.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Mapping

import torch
import torch.fx as fx
from torch import nn

from pipetrain.tensor_parallel.automatic import linear_pairs
from pipetrain.tensor_parallel.placement import Lanes, ParameterSplit, TensorParallelError, split_stage
from pipetrain.tensor_parallel.styles import TensorParallelPlan, model_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Lanes", "ParameterSplit", "TensorParallelError", "TensorParallelPlan", "choose_plan", "split_module",
           "stage_plan"]


def choose_plan(model: nn.Module, tp_plan: Mapping[str, str] | None) -> TensorParallelPlan | None:
    """The plan wrap's ``tp_plan=`` gives, else the one the model declares (Hugging Face), else None: each stage
    then gets `automatic.linear_pairs`."""
    if tp_plan is not None:
        return TensorParallelPlan(tp_plan, "tp_plan=")
    declared = model_plan(model)
    if declared is not None:
        return TensorParallelPlan(declared, f"{type(model).__name__}'s own tp_plan")
    return None


def stage_plan(module: fx.GraphModule, plan: TensorParallelPlan | None, lanes: int,
               tied: frozenset[str] = frozenset()) -> TensorParallelPlan:
    """The plan for one stage: the model's (``plan``), else the automatic one of its own graph (``tied``: names of
    its parameters another stage holds a copy of, kept whole)."""
    return plan if plan is not None else linear_pairs(module, lanes, tied)


def split_module(module: fx.GraphModule, chosen: TensorParallelPlan, lanes: Lanes,
                 shapes: dict[str, tuple[int, ...]], where: str, device: torch.device,
                 mesh: DeviceMesh | None = None) -> dict[str, ParameterSplit]:
    """Make ``module`` (a stage, its parameters whole) the part this tensor-parallel rank runs, as ``chosen`` plans it,
    in place; returns how each parameter was cut. ``mesh``: the lanes' one-dimensional mesh the blocks live on (None:
    one made over ``lanes.group``; under zero=3, a dimension of the stage's (replica, lane) mesh). Raises
    TensorParallelError, naming the node, where the plan cannot be run exactly."""
    from pipetrain.tensor_parallel.parameters import cut_parameters, lanes_mesh  # DTensor: ~1 s to import, T > 1 only

    splits = split_stage(module, chosen, lanes, shapes, where)
    if not splits and any(True for _ in module.parameters()):
        warnings.warn(f"{where}: {chosen.source} splits none of its layers, so each of its {lanes.size} "
                      "tensor-parallel ranks holds and computes it whole; pass tp_plan= naming its layers (Hugging Face's vocabulary, "
                      "e.g. {'layers.*.mlp.up_proj': 'colwise', 'layers.*.mlp.down_proj': 'rowwise'}) to split it",
                      stacklevel=2)
    cut_parameters(module, splits, mesh if mesh is not None else lanes_mesh(lanes.group, device))
    return splits

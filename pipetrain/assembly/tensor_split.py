"""Tensor parallelism in the assembly: the plan checked on every stage by every rank, then this rank's stages split.

Every rank rewrites every stage's graph once (no tensors: the plan's modules hold meta tensors) before anything is
built, so a plan that cannot run is the same error on every rank, not on the ranks of one stage while the others
wait for them.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

import partitioners
from pipetrain.comm.engine import Engine
from pipetrain.options import PipelineOptions


def stage_splitter(model: nn.Module, example_inputs: Any, plan: partitioners.Plan, options: PipelineOptions,
                   engine: Engine) -> Callable[[nn.Module, int], None] | None:
    """What splits a built stage module (index v) for this rank's lane; None without tensor parallelism."""
    if options.tensor_parallel == 1:
        return None
    from pipetrain.tensor_parallel import Lanes, choose_plan, split_module  # DTensor: ~1 s to import, T > 1 only
    from pipetrain.tensor_parallel.placement import split_stage
    from pipetrain.tensor_parallel.automatic import linear_pairs
    from pipetrain.tensor_parallel.shapes import whole_shapes

    world = engine.world
    lanes = Lanes(world.tensor_group, world.tensor_parallel, world.lane)
    chosen = choose_plan(model, options.tp_plan)
    shapes = whole_shapes(plan.graph.module, example_inputs)
    for v in range(plan.num_stages):  # every stage on every rank: the same verdict everywhere
        stage = plan.build_stage(v)
        split_stage(stage, chosen if chosen is not None else linear_pairs(stage, lanes.size), lanes, shapes, f"stage {v}")

    def split(module: nn.Module, v: int) -> None:
        split_module(module, chosen, lanes, shapes, f"stage {v}", world.device)
    return split

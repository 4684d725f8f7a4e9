"""Tensor parallelism in the assembly: the plan checked on every stage by every rank, then this rank's stages split.

Every rank rewrites every stage's graph once (no tensors: the plan's modules hold meta tensors) before anything is
built, so a plan that cannot run is the same error on every rank, not on the ranks of one stage while the others
wait for them. Across stages it checks what no single stage can: that something is split at all, and that the
copies of a tied tensor (a language model's embedding and head on two stages) are cut alike, since their
gradients are summed block by block.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch import nn

import partitioners
from pipetrain.comm.engine import Engine
from pipetrain.options import PipelineOptions

if TYPE_CHECKING:
    from pipetrain.tensor_parallel import ParameterSplit, TensorParallelPlan

Tied = list[list[tuple[int, str]]]  # per tied tensor: its (stage, name) copies


def keep_split_values_in_stages(model: nn.Module, example_inputs: Any, graph: partitioners.CostGraph,
                                options: PipelineOptions) -> None:
    """Mark the values a tensor-parallel split leaves split (between a colwise layer and its rowwise partner) so the
    partitioner starts no stage while one is live: stages exchange whole tensors. The plan is walked over a meta
    copy of the whole captured graph (the automatic plan: its pairs of linear layers over the whole model)."""
    if options.tensor_parallel == 1:
        return
    from pipetrain.tensor_parallel import Lanes, choose_plan, stage_plan
    from partitioners.meta import with_meta_tensors
    from pipetrain.tensor_parallel.placement import split_values
    from pipetrain.tensor_parallel.shapes import whole_shapes

    module = with_meta_tensors(graph.module, graph.module)
    chosen = stage_plan(module, choose_plan(model, options.tp_plan), options.tensor_parallel)
    lanes = Lanes(None, options.tensor_parallel, 0)  # the walk makes the collectives; nothing runs them
    for name in split_values(module, chosen, lanes, whole_shapes(graph.module, example_inputs), "the model"):
        if name in graph.graph.nodes:
            graph.graph.nodes[name][partitioners.STAYS_IN_STAGE] = True


def stage_splitter(model: nn.Module, example_inputs: Any, plan: partitioners.Plan, options: PipelineOptions,
                   engine: Engine) -> Callable[[nn.Module, int], None] | None:
    """What splits a built stage module (index v) for this rank's lane; None without tensor parallelism."""
    if options.tensor_parallel == 1:
        return None
    from pipetrain.tensor_parallel import Lanes, choose_plan, split_module, stage_plan  # DTensor: ~1 s, T > 1 only
    from pipetrain.tensor_parallel.placement import split_stage
    from pipetrain.tensor_parallel.shapes import whole_shapes

    world = engine.world
    lanes = Lanes(world.tensor_group, world.tensor_parallel, world.lane)
    chosen = choose_plan(model, options.tp_plan)
    shapes = whole_shapes(plan.graph.module, example_inputs)
    tied = plan.tied_groups()
    tied_names = {v: frozenset(name for copies in tied for stage, name in copies if stage == v)
                  for v in range(plan.num_stages)}
    cuts: dict[int, dict[str, ParameterSplit | None]] = {}
    anything = False
    for v in range(plan.num_stages):  # every stage on every rank: the same verdict everywhere
        stage = plan.build_stage(v)
        splits = split_stage(stage, stage_plan(stage, chosen, lanes.size, tied_names[v]), lanes, shapes, f"stage {v}")
        anything = anything or bool(splits)
        canonical = {id(p): name for name, p in stage.named_parameters()}
        cuts[v] = {name: splits.get(canonical[id(stage.get_parameter(name))]) for name in tied_names[v]}
    if not anything:
        _refuse_nothing_split(lanes.size, chosen)
    _check_tied_cut_alike(tied, cuts)

    mesh = None
    if options.zero == 3:  # FSDP2 then shards the blocks over the other dimension of the same mesh
        mesh = world.lanes_of_replica_mesh()

    def split(module: nn.Module, v: int) -> None:
        split_module(module, stage_plan(module, chosen, lanes.size, tied_names[v]), lanes, shapes, f"stage {v}",
                     world.device, mesh)
    return split


def _refuse_nothing_split(lanes: int, chosen: TensorParallelPlan | None) -> None:
    from pipetrain.tensor_parallel import TensorParallelError

    source = chosen.source if chosen is not None else "the automatic plan, which pairs nn.Linear layers,"
    raise TensorParallelError(
        f"tensor_parallel={lanes} splits no layer of this model: {source} finds none on any stage. Pass tp_plan= "
        "naming its layers, in Hugging Face's vocabulary (e.g. {'layers.*.mlp.up_proj': 'colwise', "
        "'layers.*.mlp.down_proj': 'rowwise'}), or use tensor_parallel=1")


def _check_tied_cut_alike(tied: Tied, cuts: dict[int, dict[str, ParameterSplit | None]]) -> None:
    """The copies of each tied tensor are cut along the same dimension (or all kept whole)."""
    from pipetrain.tensor_parallel import TensorParallelError

    for copies in tied:
        found = {(v, name): cuts[v][name].dim if cuts[v][name] is not None else None for v, name in copies}
        if len(set(found.values())) > 1:
            cut = ", ".join(f"stage {v} {name!r}: " + ("whole" if d is None else f"dim {d}")
                            for (v, name), d in found.items())
            raise TensorParallelError(
                f"tied parameter copies would be cut differently over the tensor-parallel ranks ({cut}); give their "
                "layers the same style in tp_plan= (e.g. 'embedding_rowwise' and 'colwise_gather_output' both cut "
                "the vocabulary), or 'replicate' to both")

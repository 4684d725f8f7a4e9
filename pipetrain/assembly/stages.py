"""Stage modules -> stage runtimes of this process's pipeline positions, and the STEP of each position."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

import partitioners
from pipetrain.allreduce.slices import shards_evenly
from pipetrain.assembly.parameter_names import name_parameters
from pipetrain.comm.replicas import position_owners, trainable
from pipetrain.optim.combined import combine
from pipetrain.runtime.compiled import compile_arguments, compile_stage, graph_compile_options
from pipetrain.runtime.graph_backward import GraphBackward
from pipetrain.runtime.optimizer_step import GradientNorm, OptimizerStep
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.staleness import POLICIES, PREDICTING
from pipetrain.runtime.staleness.corrections import CorrectedStep
from pipetrain.runtime.topology import Topology

if TYPE_CHECKING:
    from pipetrain.comm.engine import Connections, Engine
    from pipetrain.options import PipelineOptions
    from pipetrain.weights.materialise import StageTensors


def make_optimizer(params: list[nn.Parameter], factory: Callable) -> torch.optim.Optimizer | None:
    """The stage's optimizer from the user's factory (None for a stage without parameters); a factory returning
    several optimizers (a list or tuple) gets them combined into one (`pipetrain.optim.CombinedOptimizer`)."""
    if not params:
        return None
    optimizer = combine(factory(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer (or a list of optimizers over "
                        "disjoint parameters), e.g. lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)")
    return optimizer


def stepped_parameters(module: nn.Module, owners: list[int] | None, engine: Engine) -> list[nn.Parameter]:
    """The parameters this process's optimizer of ``module`` steps: the trainable ones, or with ZeRO (``owners``: the
    replica owning each trainable tensor) the tensors its replica owns; the others are stepped by their
    owners and all-gathered after the step."""
    if owners is None:
        return trainable(module)  # a frozen parameter (a PEFT model's base weights) never enters the optimizer
    return [p for p, owner in zip(trainable(module), owners) if owner == engine.world.replica]


def policy_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                     options: PipelineOptions) -> torch.optim.Optimizer | None:
    """The optimizer a staleness policy reads. With ZeRO the stage's optimizer holds only this replica's share:
    a predicting policy (spectrain, nesterov) gets one over every parameter that never steps (no state: its
    hyper-parameters only) and receives lr * v of every parameter all-gathered after each step; the others
    get none and report their prediction error without a unit (NaN)."""
    if not options.zero:
        return optimizer
    if options.staleness in PREDICTING:
        return make_optimizer(list(module.parameters()), options.optimizer)
    return None


def build_stages(plan: partitioners.Plan, topology: Topology, engine: Engine, options: PipelineOptions,
                 autocast_dtype: torch.dtype | None, tensors: StageTensors,
                 split: Callable[[nn.Module, int], None] | None = None) -> dict[int, StageRuntime]:
    """The runtimes of the virtual stages this process runs (every one locally; its rank's under torchrun).
    ``split``: tensor parallelism's rewrite of a stage for this rank (`pipetrain.assembly.tensor_split`)."""
    V, held = topology.num_stages, set(engine.positions())
    compiling = compile_arguments(options.compile)
    # Compiled split schedules compile each stage's derived F, B and W graphs, not its module.
    graph_split = compiling is not None and options.splits_backward
    devices = {v: engine.torch_device(topology.position_of(v)) for v in range(V) if topology.position_of(v) in held}
    shard = None
    if options.zero == 3:  # FSDP2 shards every tensor evenly over the stage's replicas; no owners
        from pipetrain.comm.fully_sharded import replica_mesh, shard_module  # FSDP2: ~1 s to import, zero=3 only

        if options.tensor_parallel > 1:  # the lanes' blocks sharded over the replicas: the mesh's other dimensions
            mesh = engine.world.replicas_of_lane_mesh()
        else:
            mesh = replica_mesh(engine.world.data_parallel_group, engine.world.hierarchy, engine.world.device)
        shard = functools.partial(shard_module, mesh=mesh, reshard_after_forward=options.reshard_after_forward)
    # What makes stage v's module this rank's part: its tensor-parallel blocks cut, then (zero=3) sharded.
    cut = {v: _cutter(split, shard, v) for v in devices}
    if tensors.without_data and (split is not None or shard is not None):  # each rank makes its part only
        modules = {v: plan.build_stage(v) for v in devices}
        digests = {v: tensors.materialise_shards(m, devices[v], cut[v]) for v, m in modules.items()}
        if split is not None:
            engine.check_lanes_read_alike(digests)
        engine.check_replicas_read_alike(digests)
    else:
        modules = {v: tensors.materialise(plan.build_stage(v), device) for v, device in devices.items()}
        # Before any optimizer, policy or compiled graph sees the tensors: they start as replica 0's.
        engine.start_replicas_equal(modules, same_source=tensors.without_data or options.weights is not None)
        if split is not None:  # a stage's lanes cut their blocks from the same whole tensors
            engine.start_lanes_equal(modules, same_source=tensors.without_data or options.weights is not None)
        for v, module in modules.items():
            if cut[v] is not None:
                cut[v](module)
    owners: dict[int, list[int]] = {}
    if options.zero in (1, 2) and not shards_evenly(options.optimizer):
        # Whole tensors owned (an optimizer that reads whole tensors; an elementwise one is built over every
        # tensor and steps even slices, pipetrain.allreduce.slices), balanced over each position's virtual
        # stages together, as its reducer's buckets hold them. Not under zero=3: FSDP2 already gives every replica
        # an even shard of every tensor, and an optimizer over owned tensors would step other tensors on each
        # replica, so the collectives of a whole-tensor read (LARS's norms of DTensors) would never pair up.
        for d in held:
            order = topology.stages_at(d)
            owners.update(zip(order, position_owners([modules[v] for v in order], order, plan.tied_groups(),
                                                   options.data_parallel)))
    stages = {}
    for v, module in modules.items():
        device = engine.torch_device(topology.position_of(v))
        if compiling is not None and not graph_split:
            compile_stage(module, compiling)
        name_parameters(module)
        optimizer = make_optimizer(stepped_parameters(module, owners.get(v), engine), options.optimizer)
        read_by_policy = policy_optimizer(module, optimizer, options)
        policy = POLICIES[options.policy_name](module, read_by_policy, v, V,
                                               micro_batches=options.micro_batches, lookahead=options.lookahead)
        if optimizer is not None and options.delay_corrections.any:
            CorrectedStep(optimizer, policy, options.delay_corrections)
        schedulers = [make_scheduler(o, options.lr_scheduler) for o in dict.fromkeys([optimizer, read_by_policy])
                      if o is not None and options.lr_scheduler is not None]
        graphs = GraphBackward(v, module, graph_compile_options(compiling)) if graph_split else None
        stages[v] = StageRuntime(v, V, module, optimizer, policy, device, options.loss_fn, autocast_dtype, options.seed,
                                 schedulers=schedulers, graph_backward=graphs)
    return stages


def _cutter(split: Callable[[nn.Module, int], None] | None, shard: Callable[[nn.Module], None] | None,
            v: int) -> Callable[[nn.Module], None] | None:
    """What makes stage ``v``'s module this rank's part (None: it stays whole)."""
    if split is None:
        return shard
    return functools.partial(_split_then_shard, split, shard, v)


def _split_then_shard(split: Callable[[nn.Module, int], None], shard: Callable[[nn.Module], None] | None, v: int,
                      module: nn.Module) -> None:
    split(module, v)
    if shard is not None:
        shard(module)


def make_scheduler(optimizer: torch.optim.Optimizer, factory: Callable) -> torch.optim.lr_scheduler.LRScheduler:
    """A stage optimizer's learning-rate scheduler from the user's factory."""
    scheduler = factory(optimizer)
    if not hasattr(scheduler, "step") or not hasattr(scheduler, "state_dict"):
        raise TypeError(f"lr_scheduler must be a factory: optimizer -> a learning-rate scheduler (with step() and "
                        f"state_dict()), got {type(scheduler).__name__}; e.g. lr_scheduler=lambda opt: "
                        "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))")
    return scheduler


def build_steppers(stages: dict[int, StageRuntime], topology: Topology, connections: Connections,
                   options: PipelineOptions, tied: list[list[tuple[int, str]]],
                   engine: Engine) -> dict[int, OptimizerStep]:
    """Per pipeline position this process runs: what its STEP action does."""
    positions = sorted({topology.position_of(v) for v in stages})
    process_stages = [(v, rt.module) for v, rt in sorted(stages.items())]
    # The global norm counts each gradient once: a tied parameter's first copy, and one replica's gradients
    # (replicas hold the same averaged ones) unless ZeRO gives each replica a shard of its own.
    duplicates = frozenset(id(stages[v].module.get_parameter(name)) for copies in tied for v, name in copies[1:]
                           if v in stages)
    if options.zero == 3:
        from pipetrain.comm.fully_sharded import counts_in_norm

        counted = counts_in_norm(engine.world.hierarchy)
    else:
        counted = bool(options.zero) or engine.world is None or engine.world.replica == 0
    if options.tensor_parallel > 1 and engine.world.lane > 0:  # whole tensors count once, on lane 0
        from pipetrain.tensor_parallel.parameters import is_split

        duplicates |= {id(p) for rt in stages.values() for p in rt.module.parameters() if not is_split(p)}
    norm = GradientNorm(float(options.norm_type), options.max_grad_norm, counted, duplicates)
    return {d: OptimizerStep([stages[v] for v in topology.stages_at(d)], connections.tied,
                             DynamicLossScaler() if options.precision == "fp16" else None,
                             connections.agreement, options.nonfinite, options.precision, d, process_stages,
                             connections.reducers.get(d) if options.zero else None, norm)
            for d in positions}

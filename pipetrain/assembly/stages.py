"""Stage modules -> stage runtimes on this process's devices, and the STEP of each device."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

import partitioners
from pipetrain.comm.replicas import device_owners, trainable
from pipetrain.runtime.compiled import compile_arguments, compile_stage
from pipetrain.runtime.optimizer_step import OptimizerStep
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.staleness import POLICIES, PREDICTING
from pipetrain.runtime.topology import Topology

if TYPE_CHECKING:
    from pipetrain.comm.engine import Connections, Engine
    from pipetrain.options import PipelineOptions
    from pipetrain.weights.materialise import StageTensors


def make_optimizer(params: list[nn.Parameter], factory: Callable) -> torch.optim.Optimizer | None:
    """The stage's optimizer from the user's factory (None for a stage without parameters)."""
    if not params:
        return None
    optimizer = factory(params)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                        "e.g. lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)")
    return optimizer


def stepped_parameters(module: nn.Module, owners: list[int] | None, engine: Engine) -> list[nn.Parameter]:
    """The parameters this process's optimizer of ``module`` steps: all of them, or with ZeRO (``owners``: the
    replica owning each trainable tensor) the tensors its replica owns; the others are stepped by their
    owners and all-gathered after the step."""
    if owners is None:
        return list(module.parameters())
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
                 autocast_dtype: torch.dtype | None, tensors: StageTensors) -> dict[int, StageRuntime]:
    """The runtimes of the virtual stages this process runs (every one locally; its rank's under torchrun)."""
    V, held = topology.num_stages, set(engine.positions())
    compiling = compile_arguments(options.compile)
    modules = {v: tensors.materialise(plan.build_stage(v), engine.torch_device(topology.position_of(v)))
               for v in range(V) if topology.position_of(v) in held}
    # Before any optimizer, policy or compiled graph sees the tensors: they start as replica 0's.
    engine.start_replicas_equal(modules, same_source=tensors.without_data or options.weights is not None)
    owners: dict[int, list[int]] = {}
    if options.zero:  # balanced over each device's virtual stages together, as its reducer's buckets hold them
        for d in held:
            order = topology.stages_at(d)
            owners.update(zip(order, device_owners([modules[v] for v in order], order, plan.tied_groups(),
                                                   options.data_parallel)))
    stages = {}
    for v, module in modules.items():
        device = engine.torch_device(topology.position_of(v))
        if compiling is not None:
            compile_stage(module, compiling)
        optimizer = make_optimizer(stepped_parameters(module, owners.get(v), engine), options.optimizer)
        policy = POLICIES[options.policy_name](module, policy_optimizer(module, optimizer, options), v, V,
                                               micro_batches=options.micro_batches, lookahead=options.lookahead)
        stages[v] = StageRuntime(v, V, module, optimizer, policy, device, options.loss_fn, autocast_dtype, options.seed)
    return stages


def build_steppers(stages: dict[int, StageRuntime], topology: Topology, links: Connections,
                   options: PipelineOptions) -> dict[int, OptimizerStep]:
    """Per pipeline position this process runs: what its STEP action does."""
    positions = sorted({topology.position_of(v) for v in stages})
    process_stages = [(v, rt.module) for v, rt in sorted(stages.items())]
    return {d: OptimizerStep([stages[v] for v in topology.stages_at(d)], links.tied,
                             DynamicLossScaler() if options.precision == "fp16" else None,
                             links.agreement, options.nonfinite, options.precision, d, process_stages,
                             links.reducers.get(d) if options.zero else None)
            for d in positions}

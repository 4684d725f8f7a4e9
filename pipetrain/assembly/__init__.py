"""Assembly: one forward pass from a model to the parts of a running pipeline.

    options ──validate──> engine ──> capture ──> plan ──> schedules (recompute resolved) ──>
    stage modules (materialise) ──> runtimes (optimizer, policy) ──> connections ──> STEP per position

Each step is a small function taking what the previous ones made; nothing here runs a mini-batch
(pipetrain.runner does) and nothing calls back up (pipetrain.pipeline is the facade over both).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

import partitioners
from partitioners import input_sizes
from pipetrain.assembly.checkpointing import checkpointing_off, honour_model_checkpointing
from pipetrain.assembly.fingerprint import differences, fingerprint
from pipetrain.assembly.schedule_book import ScheduleBook
from pipetrain.assembly.stages import build_stages, build_steppers
from pipetrain.assembly.tensor_split import keep_split_values_in_stages, stage_splitter
from pipetrain.comm.engine import Connections, Engine, select_engine
from pipetrain.options import PipelineOptions
from pipetrain.pretrained import PretrainedLayout
from pipetrain.runtime.batching import batch_size
from pipetrain.runtime.loss_checks import check_default_loss
from pipetrain.runtime.model_io import ModelIO
from pipetrain.runtime.stage_memory import memory_model
from pipetrain.runtime.optimizer_step import OptimizerStep
from pipetrain.runtime.precision import PrecisionPolicy, precision_policy
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.topology import Topology
from pipetrain.weights.materialise import StageTensors


@dataclass
class Parts:
    """Everything a running pipeline is made of, on this process."""

    options: PipelineOptions
    engine: Engine
    plan: partitioners.Plan
    topology: Topology
    schedules: ScheduleBook
    precision: PrecisionPolicy
    stages: dict[int, StageRuntime]      # the virtual stages this process runs, by index
    connections: Connections
    steppers: dict[int, OptimizerStep]   # per pipeline position this process runs
    io: ModelIO                          # what the model takes and returns, as captured
    pretrained: PretrainedLayout         # the names and config save_pretrained writes

    def stages_at(self, position: int) -> dict[int, StageRuntime]:
        """Position ``position``'s stages by chunk (their index within the position)."""
        return {self.topology.chunk_of(v): self.stages[v] for v in self.topology.stages_at(position)}


def assemble(model: nn.Module, example_inputs: Any, options: PipelineOptions) -> Parts:
    """Capture, plan, schedule and build this process's share of the pipeline (``options`` validated themselves)."""
    options = honour_model_checkpointing(model, options)
    engine = select_engine(options)
    book = ScheduleBook(options.schedule, options.stages, options.micro_batches, options.chunks_per_device,
                        data_parallel=options.data_parallel > 1)
    precision = precision_policy(options.precision)
    plan = make_plan(model, example_inputs, options, engine, book, precision)
    io = model_io(model, example_inputs, plan)
    check_default_loss(options.loss_fn, plan.graph.example_output, io.model)
    book.resolve_recompute(plan.recompute)
    topology = Topology(plan, options.stages, book.placement)
    book.check_links(topology)
    tensors = StageTensors.prepare(plan.graph.model, plan.graph.state_names, plan.graph.without_data,
                                   options.weights, options.seed)
    split = stage_splitter(model, example_inputs, plan, options, engine)
    stages = build_stages(plan, topology, engine, options, precision.autocast_dtype, tensors, split)
    tensors.close()
    pretrained = PretrainedLayout.of(model)
    # The stages hold their tensors now: the plan keeps no other copy (its tied groups found on the real graph).
    plan = plan.replaced(graph=plan.graph.on_meta(), tied=plan.tied_groups())
    connections = engine.connect(topology, stages, plan.tied_groups())
    steppers = build_steppers(stages, topology, connections, options, plan.tied_groups(), engine)
    return Parts(options, engine, plan, topology, book, precision, stages, connections, steppers, io, pretrained)


def reconnect(parts: Parts) -> None:
    """After a step that raised under torchrun: new process groups and connections (every rank calls this at
    its next step); the stages, their optimizers and loss scalers stay as they are."""
    parts.connections = parts.engine.reconnect(parts.topology, parts.stages, parts.plan.tied_groups())
    for d, stepper in parts.steppers.items():
        stepper.connect(parts.connections.tied, parts.connections.agreement, parts.connections.reducers.get(d))


def model_io(model: nn.Module, example_inputs: Any, plan: partitioners.Plan) -> ModelIO:
    """The model's inputs as its captured graph takes them (by forward()'s parameter names: fx renames a
    placeholder that shadows a builtin, ``input`` -> ``input_1``) and its output on the example."""
    nodes = plan.graph.module.graph.nodes
    parameter = {n.name: str(n.target) for n in nodes if n.op == "placeholder"}
    names = [parameter[n] for n in plan.stage_inputs(0)]
    output = next(n for n in nodes if n.op == "output")
    return ModelIO.of(type(model).__name__, model.forward, names, plan.graph.example_output,
                      batch_size(example_inputs), mixes_samples=output.meta.get(input_sizes.MIXES_SAMPLES_KEY, False))


def make_plan(model: nn.Module, example_inputs: Any, options: PipelineOptions, engine: Engine,
              book: ScheduleBook, precision: PrecisionPolicy) -> partitioners.Plan:
    """Capture and partition the model under the autocast its stages run in (the graph then does what the
    model does in that precision, and costs count each value in its real dtype); under torchrun every rank
    first agrees on what it traced and was asked (`fingerprint`), then rank 0 decides and every rank follows
    its plan."""
    decides = engine.decides_plan
    with checkpointing_off(model):
        graph = partitioners.trace_for_training(model, example_inputs, profile=options.profile and decides,
                                                autocast=precision.autocast_dtype)
    engine.agree_on_setup(fingerprint(options, graph, example_inputs), differences)
    keep_split_values_in_stages(model, example_inputs, graph, options)  # every rank: a refusal is everyone's
    plan = None
    if decides:
        method = list(options.partitioner) if isinstance(options.partitioner, (list, tuple)) else options.partitioner
        memory = memory_model(book.planning_actions(), options.stages, options.policy_name, options.recompute,
                              options.optimizer, options.zero, options.data_parallel, book.placement)
        plan = partitioners.partition(graph, options.virtual_stages, method=method, bandwidth=options.bandwidth,
                                      memory_limit=options.memory_limit, memory=memory)
    return engine.agree_on_plan(plan, graph)

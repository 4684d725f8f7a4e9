"""The Pipeline object ``wrap`` returns: plan, stage runtimes, engines, and the user-facing calls."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import partitioners
import schedules
from pipetrain import checkpoint as ckpt
from pipetrain.batching import batch_size, merge_micro_batches
from pipetrain.data_parallel import StageReducer, replica_shard, shard_weight
from pipetrain.executor import DeviceExecutor, drive
from pipetrain.feed import Feed, StreamFeed
from pipetrain.metrics import CommCounter, StepResult, TensorBoardLog
from pipetrain.optimizer_step import (DistributedOverflowAgreement, LocalOverflowAgreement, OptimizerStep,
                                      make_scaler)
from pipetrain.options import PipelineOptions
from pipetrain.precision import precision_policy
from pipetrain.reporting import Reporter
from pipetrain.stage import StageRuntime
from pipetrain.staleness import POLICIES
from pipetrain.tied import DistributedTiedSync, LocalTiedSync
from pipetrain.topology import Topology
from pipetrain.transport import DistributedTransport, LocalTransport
from pipetrain.world import World, ensure_process_group, launched_by_torchrun
from schedules import ActionKind

FORWARD_ONLY = {ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT}


def trace_model(model: nn.Module, example_inputs: Any, profile: bool):
    """Trace with torch.fx; a forward fx cannot follow falls back to the model's top-level children as a
    chain, which the tracer accepts only when running them in order reproduces the model's output."""
    try:
        return partitioners.trace(model, example_inputs, profile=profile)
    except partitioners.TraceError as error:
        try:
            return partitioners.trace(model, example_inputs, profile=profile, chain=True)
        except partitioners.TraceError as chain_error:
            children = [name for name, _ in model.named_children()]
            raise partitioners.TraceError(
                f"{error}\n  pipetrain also tried the model as the chain of its top-level children {children}: "
                f"{chain_error}\n  fix: make forward() traceable, or build the model so that its children run "
                f"in order (nn.Sequential) and split it between them with partitioner=[<child names>]"
            ) from error


def make_plan(model: nn.Module, example_inputs: Any, options: PipelineOptions, world: World | None):
    """Trace and partition the model; under torchrun rank 0 decides and every rank follows its plan."""
    method = list(options.partitioner) if isinstance(options.partitioner, (list, tuple)) else options.partitioner
    decides = world is None or world.rank == 0
    graph = trace_model(model, example_inputs, profile=options.profile and decides)
    if decides:
        plan = partitioners.partition(graph, options.virtual_stages, method=method,
                                      bandwidth=options.bandwidth, memory_limit=options.memory_limit)
    if world is None:
        return plan
    box = [plan.to_json() if decides else None]
    dist.broadcast_object_list(box, src=0)
    return partitioners.Plan.from_json(box[0], graph)


class Pipeline:
    """A model split into pipeline stages, trained by a schedule on the local or distributed engine."""

    def __init__(self, model: nn.Module, example_inputs: Any, options: PipelineOptions):
        options.validate()
        self.options = o = options
        self.distributed = o.engine == "distributed" or (
            o.engine == "auto" and (launched_by_torchrun() or dist.is_initialized()))
        self.world: World | None = None
        if self.distributed:
            ensure_process_group()
            self.world = World(o.stages, o.data_parallel, o.allreduce, o.hierarchy, o.timeout)
        elif o.data_parallel > 1:
            raise ValueError("data_parallel > 1 runs one process per stage and replica: launch with torchrun "
                             f"--nproc-per-node {o.stages * o.data_parallel} (engine='distributed' or 'auto')")
        self.plan = make_plan(model, example_inputs, o, self.world)
        self.topology = Topology(self.plan, o.stages)
        self.input_names = list(self.plan.stage_inputs(0))
        self.precision = precision_policy(o.precision)
        if self.distributed:
            self.devices_here = [self.world.pipeline_device]
            self.device_of = {d: self.world.device for d in range(o.stages)}
        else:
            self.devices_here = list(range(o.stages))
            devices = [torch.device(d) for d in (o.devices or ["cpu"] * o.stages)]
            if len(devices) != o.stages:
                raise ValueError(f"devices lists {len(devices)} devices for {o.stages} stages; give one per stage")
            self.device_of = dict(enumerate(devices))
        V = self.topology.num_stages
        self.runtimes: dict[int, StageRuntime] = {
            v: self._make_runtime(v) for v in range(V) if self.topology.device_of(v) in self.devices_here}
        self.counter = CommCounter(V)
        tied = self.plan.tied_groups()
        if self.distributed:
            self.transport = DistributedTransport(
                self.topology, lambda v: self.world.rank_of(self.topology.device_of(v)),
                self.world.link_groups(self.topology), self.world.device, self.counter, o.dynamic_shapes, o.timeout)
            self.tied = DistributedTiedSync(tied, self.runtimes, self.world.tied_groups(self.topology, tied),
                                            self.counter)
            agreement = DistributedOverflowAgreement()
            self.reporter = Reporter(self.runtimes, V, self.counter, (self.world.control, self.world.report),
                                     o.data_parallel, self.world.device)
        else:
            self.transport = LocalTransport([self.device_of[self.topology.device_of(v)] for v in range(V)],
                                            self.counter)
            self.tied = LocalTiedSync(tied, self.runtimes, self.counter)
            agreement = LocalOverflowAgreement(len(self.devices_here))
            self.reporter = Reporter(self.runtimes, V, self.counter)
        self.steppers = {d: OptimizerStep([self.runtimes[v] for v in self._stages_on(d)], self.tied,
                                          make_scaler(o.precision, self.distributed), agreement)
                         for d in self.devices_here}
        self.reducers = {}
        if o.data_parallel > 1:
            # Hooks see gradients only when autograd accumulates them: not with staleness policies
            # (they add per-version gradients by hand), nor across interleaved chunks, nor when
            # zero-bubble W passes set the weight gradients.
            overlap = o.overlap and o.staleness == "none" and o.chunks_per_device == 1 and o.schedule != "zb-h1"
            self.reducers = {d: StageReducer([self.runtimes[v] for v in self._stages_on(d)],
                                             self.world.data_parallel_group, self.world.hierarchy, o,
                                             self.counter, overlap)
                             for d in self.devices_here}
        self.updates = 0
        self._schedules: dict[tuple[str, int], schedules.Schedule] = {}
        if o.schedule != "async-1f1b":  # bad combinations (e.g. interleaved with m % stages) fail here
            self._schedule(o.schedule, o.micro_batches)
        self._log = TensorBoardLog(o.logdir) if o.logdir and self._is_rank_zero else None
        self.last_result: StepResult | None = None
        self.in_stream = False

    # ----- construction -------------------------------------------------------------------
    def _make_runtime(self, v: int) -> StageRuntime:
        o = self.options
        device = self.device_of[self.topology.device_of(v)]
        module = self.plan.build_stage(v).to(device)
        params = list(module.parameters())
        optimizer = o.optimizer(params) if params else None  # a stage of parameter-free layers has nothing to step
        if params and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)")
        policy = POLICIES[o.policy_name](module, optimizer, v, self.topology.num_stages)
        return StageRuntime(v, self.topology.num_stages, module, optimizer, policy, device, o.loss_fn,
                            self.precision.autocast_dtype, o.seed)

    @property
    def _is_rank_zero(self) -> bool:
        return self.world is None or self.world.rank == 0

    def _stages_on(self, device: int) -> list[int]:
        return [v for v in sorted(self.runtimes) if self.topology.device_of(v) == device]

    def _schedule(self, kind: str, micro_batches: int) -> schedules.Schedule:
        key = (kind, micro_batches)
        if key not in self._schedules:
            options = {"chunks": self.options.chunks} if kind == "interleaved-1f1b" else {}
            sched = schedules.build(kind, self.options.stages, micro_batches,
                                    data_parallel=self.options.data_parallel > 1, **options)
            schedules.validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    def _executors(self, feed: Feed, train: bool) -> dict[int, DeviceExecutor]:
        scaler_of = {d: self.steppers[d].scaler for d in self.devices_here}
        return {d: DeviceExecutor(
            d, {self.topology.chunk_of(v): self.runtimes[v] for v in self._stages_on(d)}, self.topology,
            self.transport, feed, self.steppers[d],
            reduce=self.reducers[d].reduce if d in self.reducers else None,
            before_backward=self.reducers[d].before_backward if d in self.reducers else None,
            send_dtype=self.precision.activation_dtype if self.precision.autocast_dtype is not None else None,
            train=train,
            loss_scale=(lambda s=scaler_of[d]: s.scale_value) if scaler_of[d] is not None else (lambda: 1.0),
            split_backward=self.options.schedule == "zb-h1")
            for d in self.devices_here}

    def _shard(self, x: Any, y: Any) -> tuple[Any, Any, float]:
        """This replica's share of a global mini-batch and the factor that keeps the mean exact."""
        D = self.options.data_parallel
        if D == 1:
            return x, y, 1.0
        r = self.world.replica
        xs = replica_shard(x, r, D)
        return xs, replica_shard(y, r, D), shard_weight(batch_size(x), batch_size(xs), D)

    # ----- user calls -----------------------------------------------------------------------
    def step(self, x: Any, y: Any) -> float:
        """Train one mini-batch and return its mean loss (on every rank)."""
        if self.options.schedule == "async-1f1b":
            return next(iter(self.train([(x, y)]))).loss
        return self._sync_step(x, y).loss

    def _sync_step(self, x: Any, y: Any) -> StepResult:
        m = self.options.micro_batches
        feed = Feed(m, self.input_names)
        feed.add(0, *self._shard(x, y))
        sched = self._schedule(self.options.schedule, m)
        start = time.perf_counter()
        executors = self._executors(feed, train=True)
        for _ in drive({d: ex.run(sched.actions[d]) for d, ex in executors.items()}):
            pass
        self.transport.flush()
        loss_sum = self._loss_sum(feed, range(m))
        result = self.reporter.local(loss_sum, range(m), feed.mini_batch_size(0), time.perf_counter() - start,
                                     _busy(executors))
        if self.distributed:
            result = self.reporter.collect(*self.reporter.post(result, loss_sum))
        return self._finish(result)

    def _loss_sum(self, feed: Feed, micro_batches: range) -> float:
        """Sum over samples of the loss (0 where this process has no last stage); mean = sum / samples
        in every engine, so local and distributed report the same bits."""
        return sum(float(rt.losses.pop(g)) * feed.size(g) for rt in self.runtimes.values() if rt.is_last
                   for g in micro_batches)

    def train(self, batches: Iterable) -> Iterator[StepResult]:
        """Train on a stream of (inputs, targets) mini-batches, yielding one result per mini-batch.

        Synchronous schedules flush after every mini-batch; async-1f1b keeps the pipeline full
        for the whole stream and drains only when it ends. Under torchrun every rank iterates
        the same stream (in hybrid mode each replica keeps its own shard of every mini-batch).
        """
        if self.options.schedule != "async-1f1b":
            for x, y in batches:
                yield self._sync_step(x, y)
            return
        yield from self._async_stream(batches)

    def _async_stream(self, batches: Iterable) -> Iterator[StepResult]:
        self.in_stream = True
        try:
            yield from self._run_stream(batches)
        finally:
            self.in_stream = False

    def _run_stream(self, batches: Iterable) -> Iterator[StepResult]:
        o = self.options
        m = o.micro_batches
        feed = StreamFeed(batches, m, self.input_names, prepare=self._shard)
        executors = self._executors(feed, train=True)
        runs = {d: ex.run(schedules.async_1f1b_actions(d, o.stages, m, feed.has, data_parallel=o.data_parallel > 1))
                for d, ex in executors.items()}
        start = time.perf_counter()
        pending: list[tuple] = []
        reported = 0
        for _ in drive(runs):
            done = min(len(ex.steps_done) for ex in executors.values())
            while reported < done:
                own = range(reported * m, (reported + 1) * m)
                now = time.perf_counter()
                loss_sum = self._loss_sum(feed, own)
                result = self.reporter.local(loss_sum, own, feed.mini_batch_size(reported), now - start,
                                             _busy(executors))
                start = now
                feed.release(reported)
                reported += 1
                if not self.distributed:
                    yield self._finish(result)
                    continue
                pending.append(self.reporter.post(result, loss_sum))
                while pending and pending[0][1].is_completed():
                    yield self._finish(self.reporter.collect(*pending.pop(0)))
        self.transport.flush()
        for item in pending:
            yield self._finish(self.reporter.collect(*item))

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Forward only in eval mode; the full output on every rank."""
        m = min(self.options.micro_batches, batch_size(x))
        feed = Feed(m, self.input_names)
        feed.add(0, x)
        # Forward-only: the forwards of a flushing schedule with the same stage placement.
        sched = self._schedule("gpipe" if self.options.schedule == "async-1f1b" else self.options.schedule, m)
        for rt in self.runtimes.values():
            rt.module.eval()
        try:
            executors = self._executors(feed, train=False)
            runs = {d: ex.run([a for a in sched.actions[d] if a.kind in FORWARD_ONLY]) for d, ex in executors.items()}
            for _ in drive(runs):
                pass
            self.transport.flush()
        finally:
            for rt in self.runtimes.values():
                rt.module.train()
        outputs = sorted((g, out) for ex in executors.values() for g, out in ex.predictions.items())
        merged = merge_micro_batches([out for _, out in outputs]) if outputs else None
        if self.distributed:
            box = [merged]
            # One source for the whole control group: replica 0's last stage (every replica computes the same).
            last = self.world.rank_of(self.topology.device_of(self.topology.num_stages - 1), replica=0)
            dist.broadcast_object_list(box, src=last, group=self.world.control)
            merged = box[0]
        return merged

    def _finish(self, result: StepResult) -> StepResult:
        self.updates += 1
        result.step = self.updates
        self.last_result = result
        if self._log is not None:
            self._log.write(result)
        return result

    # ----- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the original model's names (this rank's share when distributed)."""
        out: dict[str, torch.Tensor] = {}
        for v in sorted(self.runtimes):
            out.update(self.runtimes[v].module.state_dict())
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load original-model names into the stages that hold them."""
        used = set()
        for rt in self.runtimes.values():
            own = rt.module.state_dict()
            missing = [k for k in own if k not in state]
            if missing and strict:
                raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                               f"needed by stage {rt.index}; is it from the same model?")
            rt.module.load_state_dict({k: state[k] for k in own if k in state}, strict=strict)
            used.update(own)
        extra = [k for k in state if k not in used]
        if extra and strict and not self.distributed:
            raise KeyError(f"state dict has keys no stage holds: {extra[:5]}; is it from the same model?")

    # ----- checkpoints (pipetrain.checkpoint) -------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Checkpoint the current step under the directory ``path``; every rank calls it.
        Returns the step directory."""
        return ckpt.save_pipeline(self, path)

    def load(self, path: str | os.PathLike) -> None:
        """Resume from the newest checkpoint under ``path`` (or a step directory), re-partitioning
        parameters and optimizer state when it was saved with another stage count or engine."""
        ckpt.load_pipeline(self, path)

    def resume(self, path: str | os.PathLike) -> bool:
        """Load the newest checkpoint under ``path`` if there is one (``--resume auto``); True if it did."""
        if ckpt.latest(path) is None:
            return False
        self.load(path)
        return True

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


def _busy(executors: dict[int, DeviceExecutor]) -> dict[int, float]:
    """Per-stage compute seconds since the last call (and reset them)."""
    out = {}
    for ex in executors.values():
        out.update(ex.busy_seconds)
        ex.busy_seconds = dict.fromkeys(ex.busy_seconds, 0.0)
    return out

"""The Pipeline object ``wrap`` returns: plan, stage runtimes, engine, and the user-facing calls."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import partitioners
import schedules
from pipetrain import checkpoint as ckpt
from pipetrain.comm.engine import select_engine
from pipetrain.options import PipelineOptions
from pipetrain.runtime import host_sync
from pipetrain.runtime.batching import batch_size, merge_micro_batches
from pipetrain.runtime.devices import caller_device, to_device
from pipetrain.runtime.executor import DeviceExecutor, drive
from pipetrain.runtime.feed import Feed, StreamFeed
from pipetrain.runtime.stage_memory import memory_model
from pipetrain.runtime.metrics import CommCounter, StepResult, TensorBoardLog
from pipetrain.runtime.optimizer_step import OptimizerStep
from pipetrain.runtime.precision import precision_policy
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.staleness import POLICIES
from pipetrain.runtime.topology import Topology
from schedules import ActionKind
from schedules.held_activations import recomputed

FORWARD_ONLY = {ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT}


def trace_model(model: nn.Module, example_inputs: Any, profile: bool) -> partitioners.CostGraph:
    """Capture with torch.fx; where fx cannot follow forward(), with torch.export (non-strict); failing
    both, as the chain of the model's top-level children, which the tracer accepts only when running them
    in order reproduces the model's output. When none works: one TraceError saying why each failed."""
    errors = []
    modes = {m: m.training for m in model.modules()}
    model.train()  # capture what training runs (a model from_pretrained() comes in eval mode)
    try:
        for capture in ("fx", "export", "chain"):
            try:
                return partitioners.trace(model, example_inputs, profile=profile, capture=capture)
            except partitioners.TraceError as error:
                errors.append((capture, error))
    finally:
        for m, training in modes.items():
            m.training = training
    children = [name for name, _ in model.named_children()]
    why = "\n".join(f"  {capture}: {str(error).strip()}".replace("\n", "\n    ") for capture, error in errors)
    raise partitioners.TraceError(
        f"pipetrain cannot capture {type(model).__name__}:\n{why}\n  fix: make the failing code capturable (no "
        f"Python control flow on tensor values: torch.where), or build the model so that its top-level children "
        f"{children} run in order (nn.Sequential) and split it between them with partitioner=[<child names>]"
    ) from errors[0][1]


class Pipeline:
    """A model split into pipeline stages, trained by a schedule on the local or distributed engine."""

    def __init__(self, model: nn.Module, example_inputs: Any, options: PipelineOptions):
        options.validate()
        self.options = o = options
        self._engine = engine = select_engine(o)
        self._schedules: dict[tuple[str, int], schedules.Schedule] = {}
        self._recompute_rules: dict[tuple[str, int], Callable[[schedules.Action], bool]] = {}
        self.plan = self._make_plan(model, example_inputs)
        self._topology = Topology(self.plan, o.stages)
        self._input_names = list(self.plan.stage_inputs(0))
        self._precision = precision_policy(o.precision)
        V = self._topology.num_stages
        here = engine.positions()
        self._runtimes: dict[int, StageRuntime] = {
            v: self._make_runtime(v) for v in range(V) if self._topology.position_of(v) in here}
        self._counter = CommCounter(V)
        links = engine.connect(self._topology, self._runtimes, self.plan.tied_groups(), self._counter, o)
        self._transport, self._reporter = links.transport, links.reporter
        process_stages = lambda: [(v, rt.module) for v, rt in sorted(self._runtimes.items())]  # noqa: E731
        self._steppers = {d: OptimizerStep(self._stages_on(d), links.tied, engine.make_scaler(o.precision),
                                           links.agreement, o.nonfinite, o.precision, o.micro_batches, d,
                                           process_stages) for d in here}
        self.skipped_steps = 0  # mini-batches whose update was skipped on every stage (reported in StepResult)
        self._reducers = engine.make_reducers(self._stages_on, o, self._counter)
        self.updates = 0
        if o.schedule != "async-1f1b":  # bad combinations (e.g. interleaved with m % stages) fail here
            self._schedule(o.schedule, o.micro_batches)
        self._log = TensorBoardLog(o.logdir) if o.logdir and engine.is_rank_zero else None
        self.last_result: StepResult | None = None
        self._in_stream = False
        self._stop_requested = False

    # ----- construction -------------------------------------------------------------------
    def _make_plan(self, model: nn.Module, example_inputs: Any) -> partitioners.Plan:
        """Trace and partition the model; under torchrun rank 0 decides and every rank follows its plan."""
        o, decides = self.options, self._engine.decides_plan
        method = list(o.partitioner) if isinstance(o.partitioner, (list, tuple)) else o.partitioner
        graph = trace_model(model, example_inputs, profile=o.profile and decides)
        plan = None
        if decides:
            memory = memory_model(self._actions(o.schedule, o.micro_batches), o.stages, o.policy_name, o.recompute,
                                  o.optimizer)
            plan = partitioners.partition(graph, o.virtual_stages, method=method, bandwidth=o.bandwidth,
                                          memory_limit=o.memory_limit, memory=memory)
        return self._engine.agree_on_plan(plan, graph)

    def _actions(self, kind: str, micro_batches: int) -> list[list[schedules.Action]]:
        """Every device's action list for one mini-batch (async-1f1b: a few mini-batches of the stream)."""
        if kind != "async-1f1b":
            return self._schedule(kind, micro_batches).actions
        o = self.options
        return [list(schedules.async_1f1b_actions(d, o.stages, micro_batches, lambda t: t < 4))
                for d in range(o.stages)]

    def _recompute_rule(self, kind: str, micro_batches: int) -> Callable[[schedules.Action], bool]:
        """Whether an action's forward keeps only its inputs (plan.recompute: each virtual stage's setting)."""
        key = (kind, micro_batches)
        if key not in self._recompute_rules:
            settings, S = self.plan.recompute or ["none"] * self._topology.num_stages, self.options.stages
            if kind == "async-1f1b":  # the stream never ends: every stage but the last runs other forwards in between
                rule = lambda a: settings[a.stage] == "always" or (  # noqa: E731
                    settings[a.stage] == "except-last" and a.stage != S - 1)
            else:
                actions = self._actions(kind, micro_batches)
                chosen = {(d, s): recomputed(actions[d], s) for d in range(S) for s in set(settings) if s != "none"}
                rule = lambda a: (settings[a.chunk * S + a.stage] != "none"  # noqa: E731
                                  and (a.chunk, a.micro_batch) in chosen[(a.stage, settings[a.chunk * S + a.stage])])
            self._recompute_rules[key] = rule
        return self._recompute_rules[key]

    def _make_runtime(self, v: int) -> StageRuntime:
        o = self.options
        device = self._engine.torch_device(self._topology.position_of(v))
        module = self.plan.build_stage(v).to(device)
        params = list(module.parameters())
        optimizer = o.optimizer(params) if params else None  # a stage of parameter-free layers has nothing to step
        if params and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)")
        policy = POLICIES[o.policy_name](module, optimizer, v, self._topology.num_stages,
                                         micro_batches=o.micro_batches, lookahead=o.lookahead)
        return StageRuntime(v, self._topology.num_stages, module, optimizer, policy, device, o.loss_fn,
                            self._precision.autocast_dtype, o.seed)

    def _stages_on(self, position: int) -> list[StageRuntime]:
        return [self._runtimes[v] for v in sorted(self._runtimes) if self._topology.position_of(v) == position]

    def _schedule(self, kind: str, micro_batches: int) -> schedules.Schedule:
        key = (kind, micro_batches)
        if key not in self._schedules:
            chunks = self.options.chunks_per_device
            options = {"chunks": chunks} if kind in ("interleaved-1f1b", "gpipe") and chunks > 1 else {}
            sched = schedules.build(kind, self.options.stages, micro_batches,
                                    data_parallel=self.options.data_parallel > 1, **options)
            schedules.validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    def _executors(self, feed: Feed, train: bool, kind: str | None = None) -> dict[int, DeviceExecutor]:
        recompute = self._recompute_rule(kind, feed.micro_batches) if train else (lambda a: False)
        executors = {}
        for d, stepper in self._steppers.items():
            scaler, reducer = stepper.scaler, self._reducers.get(d)
            executors[d] = DeviceExecutor(
                d, {self._topology.chunk_of(s.index): s for s in self._stages_on(d)}, self._topology,
                self._transport, feed, stepper,
                reduce=reducer.reduce if reducer else None,
                before_backward=reducer.before_backward if reducer else None,
                send_dtype=self._precision.activation_dtype if self._precision.autocast_dtype is not None else None,
                train=train,
                loss_scale=(lambda s=scaler: s.scale_value) if scaler is not None else (lambda: 1.0),
                split_backward=self.options.schedule == "zb-h1", recompute=recompute)
        return executors

    # ----- user calls -----------------------------------------------------------------------
    def step(self, x: Any, y: Any = None) -> float:
        """Train one mini-batch and return its mean loss (on every rank). ``y`` may be None when the
        model computes its own loss from its inputs (e.g. Hugging Face ``labels``, loss_fn=model_loss)."""
        if self.options.schedule == "async-1f1b":
            return next(iter(self.train([(x, y)]))).loss
        return self._sync_step(x, y).loss

    def _sync_step(self, x: Any, y: Any) -> StepResult:
        m = self.options.micro_batches
        feed = Feed(m, self._input_names)
        feed.add(0, *self._engine.shard(x, y))
        sched = self._schedule(self.options.schedule, m)
        start = time.perf_counter()
        executors = self._executors(feed, train=True, kind=self.options.schedule)
        for stepper in self._steppers.values():
            stepper.start(self.updates + 1, stream=False)
        for _ in drive({d: ex.run(sched.actions[d]) for d, ex in executors.items()}):
            pass
        self._transport.flush()
        loss_sum = self._loss_sum(feed, range(m))
        result = self._reporter.local(loss_sum, range(m), feed.mini_batch_size(0), time.perf_counter() - start,
                                     _busy(executors))
        result.skipped = self._skipped(0)
        result.stop_requested = self._stop_requested
        if self._engine.distributed:
            result = self._reporter.collect(*self._reporter.post(result, loss_sum))
        return self._finish(result)

    def _skipped(self, t: int) -> bool:
        """Whether mini-batch t's update was skipped: agreed, so any device of this process can say."""
        outcomes = [s.outcomes.pop(t) for s in self._steppers.values()]
        return outcomes[0]

    def _loss_sum(self, feed: Feed, micro_batches: range) -> float:
        """Sum over samples of the loss (0 where this process has no last stage); mean = sum / samples
        in every engine, so local and distributed report the same bits. Summed on the device in float64
        (the same bits as adding the Python floats) and read once: one host synchronisation per step."""
        total = None
        for rt in self._runtimes.values():
            if rt.is_last:
                for g in micro_batches:
                    term = rt.losses.pop(g).double() * feed.size(g)
                    total = term if total is None else total + term
        if total is None:
            return 0.0
        host_sync.note("loss report")
        return float(total)

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
        self._in_stream = True
        for rt in self._runtimes.values():
            rt.policy.start_stream()
        try:
            yield from self._run_stream(batches)
        finally:
            self._in_stream = False
            for rt in self._runtimes.values():
                rt.policy.end_stream()

    def _run_stream(self, batches: Iterable) -> Iterator[StepResult]:
        o = self.options
        m = o.micro_batches
        feed = StreamFeed(batches, m, self._input_names, prepare=self._engine.shard)
        executors = self._executors(feed, train=True, kind="async-1f1b")
        runs = {d: ex.run(schedules.async_1f1b_actions(d, o.stages, m, feed.has, data_parallel=o.data_parallel > 1))
                for d, ex in executors.items()}
        for stepper in self._steppers.values():
            stepper.start(self.updates + 1, stream=True)
        start = time.perf_counter()
        pending: list[tuple] = []
        reported = 0
        for _ in drive(runs):
            done = min(len(ex.steps_done) for ex in executors.values())
            while reported < done:
                own = range(reported * m, (reported + 1) * m)
                now = time.perf_counter()
                loss_sum = self._loss_sum(feed, own)
                result = self._reporter.local(loss_sum, own, feed.mini_batch_size(reported), now - start,
                                             _busy(executors))
                result.skipped = self._skipped(reported)
                result.stop_requested = self._stop_requested
                start = now
                feed.release(reported)
                reported += 1
                if not self._engine.distributed:
                    yield self._finish(result)
                    continue
                pending.append(self._reporter.post(result, loss_sum))
                while pending and pending[0][1].is_completed():
                    yield self._finish(self._reporter.collect(*pending.pop(0)))
        for stepper in self._steppers.values():
            stepper.finish_stream()
        self._transport.flush()
        for item in pending:
            yield self._finish(self._reporter.collect(*item))

    def request_stop(self) -> None:
        """Ask every rank to stop at the same step: from the next step report on, each rank's
        StepResult has ``stop_requested`` set (under torchrun it rides in the report the ranks already
        exchange, so it costs no collective of its own). Only sets a flag, so a signal handler may call
        it; stopping is the caller's (pipetrain's training loop saves and returns on SIGTERM)."""
        self._stop_requested = True

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Forward only in eval mode; the full output on every rank, on the device of ``x``."""
        m = min(self.options.micro_batches, batch_size(x))
        feed = Feed(m, self._input_names)
        feed.add(0, x)
        # Forward-only: the forwards of GPipe with the same stage placement (any m works, unlike
        # interleaved-1f1b, which needs m divisible by stages: a short last batch need not be).
        sched = self._schedule("gpipe", m)
        for rt in self._runtimes.values():
            rt.module.eval()
        try:
            executors = self._executors(feed, train=False)
            runs = {d: ex.run([a for a in sched.actions[d] if a.kind in FORWARD_ONLY]) for d, ex in executors.items()}
            for _ in drive(runs):
                pass
            self._transport.flush()
        finally:
            for rt in self._runtimes.values():
                rt.module.train()
        outputs = sorted((g, out) for ex in executors.values() for g, out in ex.predictions.items())
        merged = merge_micro_batches([out for _, out in outputs]) if outputs else None
        return to_device(self._engine.share_prediction(merged, self._topology), caller_device(x))

    def _finish(self, result: StepResult) -> StepResult:
        self.updates += 1
        result.step = self.updates
        self.skipped_steps += result.skipped
        result.skipped_total = self.skipped_steps
        self.last_result = result
        if self._log is not None:
            self._log.write(result)
        return result

    # ----- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the original model's names (this rank's share when distributed)."""
        out: dict[str, torch.Tensor] = {}
        for v in sorted(self._runtimes):
            out.update(self._runtimes[v].module.state_dict())
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load original-model names into the stages that hold them."""
        used = set()
        for rt in self._runtimes.values():
            own = rt.module.state_dict()
            missing = [k for k in own if k not in state]
            if missing and strict:
                raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                               f"needed by stage {rt.index}; is it from the same model?")
            rt.module.load_state_dict({k: state[k] for k in own if k in state}, strict=strict)
            used.update(own)
        extra = [k for k in state if k not in used]
        if extra and strict and not self._engine.distributed:
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

    def checkpoint_stages(self) -> dict[int, ckpt.StageState]:
        """The stages this process holds, for pipetrain.checkpoint."""
        return {v: ckpt.StageState(rt.module, rt.optimizer, rt.policy,
                                   self._steppers[self._topology.position_of(v)].scaler)
                for v, rt in sorted(self._runtimes.items())}

    def checkpoint_role(self) -> ckpt.CheckpointRole:
        """This process's part in a save, for pipetrain.checkpoint."""
        world = self._engine.world
        if world is None:
            return ckpt.CheckpointRole(True, True, "local", lambda: None, self._in_stream)
        return ckpt.CheckpointRole(world.replica == 0, world.rank == 0, "distributed",
                                   lambda: dist.barrier(group=world.checkpoint), self._in_stream)

    def close(self) -> None:
        """Close the TensorBoard log."""
        if self._log is not None:
            self._log.close()


def _busy(executors: dict[int, DeviceExecutor]) -> dict[int, float]:
    """Per-stage compute seconds since the last call (and reset them)."""
    out = {}
    for ex in executors.values():
        out.update(ex.busy_seconds)
        ex.busy_seconds = dict.fromkeys(ex.busy_seconds, 0.0)
    return out

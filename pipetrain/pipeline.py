"""The Pipeline object ``wrap`` returns: plan, stage runtimes, engines, and the user-facing calls."""
from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import partitioners
import schedules
from schedules import ActionKind
from pipetrain.batching import batch_size, merge_micro_batches
from pipetrain.executor import BLOCKED, DeviceExecutor
from pipetrain.feed import Feed, StreamFeed
from pipetrain.metrics import StepResult, TensorBoardLog
from pipetrain.options import PRECISIONS, PipelineOptions
from pipetrain.stage import StageRuntime
from pipetrain.staleness import POLICIES
from pipetrain.tied import DistributedTiedSync, LocalTiedSync
from pipetrain.topology import Topology
from pipetrain.transport import DistributedTransport, LocalTransport
from pipetrain.world import World, ensure_process_group, launched_by_torchrun


class DeadlockError(RuntimeError):
    pass


def make_plan(model: nn.Module, example_inputs: Any, options: PipelineOptions, world: World | None):
    """Trace and partition the model; under torchrun rank 0 decides and every rank follows its plan."""
    method = list(options.partitioner) if isinstance(options.partitioner, (list, tuple)) else options.partitioner
    decides = world is None or world.rank == 0
    graph = partitioners.trace(model, example_inputs, profile=options.profile and decides)
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
        self.distributed = o.engine == "distributed" or (o.engine == "auto" and (launched_by_torchrun() or dist.is_initialized()))
        self.world: World | None = None
        if self.distributed:
            ensure_process_group()
            self.world = World(o.stages, o.data_parallel)
        elif o.data_parallel > 1:
            raise ValueError("data_parallel > 1 runs one process per stage and replica: launch with torchrun "
                             f"--nproc-per-node {o.stages * o.data_parallel} and engine='distributed' (or 'auto')")
        self.plan = make_plan(model, example_inputs, o, self.world)
        self.topology = Topology(self.plan, o.stages)
        self.input_names = list(self.plan.stage_inputs(0))
        self.autocast_dtype = PRECISIONS[o.precision]
        if self.distributed:
            self.devices_here = [self.world.pipeline_device]
            self.device_of_stage = {d: self.world.device for d in range(o.stages)}
        else:
            self.devices_here = list(range(o.stages))
            devices = [torch.device(d) for d in (o.devices or ["cpu"] * o.stages)]
            if len(devices) != o.stages:
                raise ValueError(f"devices lists {len(devices)} devices for {o.stages} stages; give one per stage")
            self.device_of_stage = dict(enumerate(devices))
        self.runtimes: dict[int, StageRuntime] = {
            v: self._make_runtime(v) for v in range(self.topology.num_stages)
            if self.topology.device_of(v) in self.devices_here}
        tied = self.plan.tied_groups()
        if self.distributed:
            groups = self.world.link_groups(self.topology)
            self.transport = DistributedTransport(self.topology, lambda v: self.world.rank_of(self.topology.device_of(v)),
                                                  groups, self.world.device, o.dynamic_shapes)
            self.tied = DistributedTiedSync(tied, self.runtimes, self.world.tied_groups(self.topology, tied))
        else:
            self.transport = LocalTransport([self.device_of_stage[self.topology.device_of(v)]
                                             for v in range(self.topology.num_stages)])
            self.tied = LocalTiedSync(tied, self.runtimes)
        self.updates = 0
        self._schedules: dict[tuple[str, int], schedules.Schedule] = {}
        if o.schedule != "async-1f1b":  # bad combinations (e.g. interleaved with m % stages) fail here, not mid-training
            self._schedule(o.schedule, o.micro_batches)
        self._log = TensorBoardLog(o.logdir) if o.logdir and self._is_rank_zero else None
        self.last_result: StepResult | None = None

    # ----- construction -------------------------------------------------------------------
    def _make_runtime(self, v: int) -> StageRuntime:
        o = self.options
        device = self.device_of_stage[self.topology.device_of(v)]
        module = self.plan.build_stage(v).to(device)
        params = list(module.parameters())
        optimizer = o.optimizer(params) if params else None  # a stage of parameter-free layers has nothing to step
        if params and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)")
        policy = POLICIES[o.policy_name](module, optimizer, v, self.topology.num_stages)
        return StageRuntime(v, self.topology.num_stages, module, optimizer, policy, device, o.loss_fn,
                            self.autocast_dtype, o.seed)

    @property
    def _is_rank_zero(self) -> bool:
        return self.world is None or self.world.rank == 0

    def _stages_on(self, device: int) -> list[int]:
        return [v for v in self.runtimes if self.topology.device_of(v) == device]

    def _schedule(self, kind: str, micro_batches: int) -> schedules.Schedule:
        key = (kind, micro_batches)
        if key not in self._schedules:
            options = {"chunks": self.options.chunks} if kind == "interleaved-1f1b" else {}
            sched = schedules.build(kind, self.options.stages, micro_batches, **options)
            schedules.validate(sched)
            self._schedules[key] = sched
        return self._schedules[key]

    # ----- the optimizer step -------------------------------------------------------------
    def _step_fn(self, device: int):
        stages = self._stages_on(device)

        def step(t: int) -> Iterator[str]:
            yield from self.tied.sync(stages, t)
            for v in stages:
                rt = self.runtimes[v]
                if rt.optimizer is not None:
                    rt.optimizer.step()
                    rt.optimizer.zero_grad(set_to_none=True)
                rt.policy.on_step()
        return step

    # ----- engines ------------------------------------------------------------------------
    def _executors(self, feed: Feed, train: bool) -> dict[int, DeviceExecutor]:
        send_dtype = self.autocast_dtype
        return {d: DeviceExecutor(d, {self.topology.chunk_of(v): self.runtimes[v] for v in self._stages_on(d)},
                                  self.topology, self.transport, feed, self._step_fn(d),
                                  send_dtype=send_dtype, train=train)
                for d in self.devices_here}

    def _drive(self, runs: dict[int, Iterator[str]]) -> Iterator[None]:
        """Advance every device's executor; yields after each round so callers can collect results.

        Local engine: round-robin, each device runs until it waits for a message. Distributed:
        the transport blocks, so this rank's executor never reports BLOCKED.
        """
        live = dict(runs)
        while live:
            progressed = False
            for d in list(live):
                while True:
                    try:
                        state = next(live[d])
                    except StopIteration:
                        del live[d]
                        progressed = True
                        break
                    if state == BLOCKED:
                        break
                    progressed = True
            if not progressed:
                raise DeadlockError(f"devices {sorted(live)} wait for each other: the schedule cannot run "
                                    "with this plan (a stage waits for a message no stage will send)")
            yield

    # ----- user calls -----------------------------------------------------------------------
    def step(self, x: Any, y: Any) -> float:
        """Train one mini-batch and return its mean loss (on every rank)."""
        if self.options.schedule == "async-1f1b":
            result = next(iter(self.train([(x, y)])))
        else:
            result = self._sync_step(x, y)
        return result.loss

    def _sync_step(self, x: Any, y: Any) -> StepResult:
        m = self.options.micro_batches
        feed = Feed(m, self.input_names)
        feed.add(0, x, y)
        sched = self._schedule(self.options.schedule, m)
        start = time.perf_counter()
        counters = self._counters()
        executors = self._executors(feed, train=True)
        for _ in self._drive({d: ex.run(sched.actions[d]) for d, ex in executors.items()}):
            pass
        self.transport.flush()
        loss = sum(float(l) * feed.weight(g) for rt in self.runtimes.values() if rt.is_last
                   for g, l in sorted(rt.losses.items()))
        for rt in self.runtimes.values():
            rt.losses.clear()
        result = self._result(loss, range(m), feed.mini_batch_size(0), time.perf_counter() - start, executors,
                              counters)
        self._finish(result)
        return result

    def train(self, batches: Iterable) -> Iterator[StepResult]:
        """Train on a stream of (inputs, targets) mini-batches, yielding one result per mini-batch.

        Synchronous schedules flush after every mini-batch; async-1f1b keeps the pipeline full
        for the whole stream and drains only when it ends.
        """
        if self.options.schedule != "async-1f1b":
            for x, y in batches:
                yield self._sync_step(x, y)
            return
        yield from self._async_stream(batches)

    def _async_stream(self, batches: Iterable) -> Iterator[StepResult]:
        o = self.options
        feed = StreamFeed(batches, o.micro_batches, self.input_names)
        executors = self._executors(feed, train=True)
        runs = {d: ex.run(schedules.async_1f1b_actions(d, o.stages, o.micro_batches, feed.has))
                for d, ex in executors.items()}
        start = time.perf_counter()
        counters = self._counters()
        pending: list[tuple[int, Any]] = []
        reported = 0
        for _ in self._drive(runs):
            done = min(len(ex.steps_done) for ex in executors.values())
            while reported < done:
                t = reported
                own = range(t * o.micro_batches, (t + 1) * o.micro_batches)
                loss_sum = sum(float(rt.losses.pop(g)) * feed.weight(g) for rt in self.runtimes.values()
                               if rt.is_last for g in own)
                now = time.perf_counter()
                result = self._result(loss_sum, own, feed.mini_batch_size(t), now - start, executors, counters)
                start, counters = now, self._counters()
                feed.release(t)
                reported += 1
                if self.distributed:
                    pending.append(self._post_result(result))
                    while pending and pending[0][2].is_completed():
                        yield self._finish(self._collect(*pending.pop(0)))
                else:
                    yield self._finish(result)
        self.transport.flush()
        for item in pending:
            yield self._finish(self._collect(*item))

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Forward only in eval mode; the full output on every rank."""
        m = min(self.options.micro_batches, batch_size(x))
        feed = Feed(m, self.input_names)
        feed.add(0, x)
        # Forward-only: the forwards of a flushing schedule with the same stage placement.
        sched = self._schedule("gpipe" if self.options.schedule == "async-1f1b" else self.options.schedule, m)
        forward_only = {ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT}
        for rt in self.runtimes.values():
            rt.module.eval()
        try:
            executors = self._executors(feed, train=False)
            runs = {d: ex.run([a for a in sched.actions[d] if a.kind in forward_only]) for d, ex in executors.items()}
            for _ in self._drive(runs):
                pass
            self.transport.flush()
        finally:
            for rt in self.runtimes.values():
                rt.module.train()
        outputs = [p for ex in executors.values() for p in ex.predictions.items()]
        merged = merge_micro_batches([o for _, o in sorted(outputs, key=lambda kv: kv[0])]) if outputs else None
        if self.distributed:
            box = [merged]
            last = self.world.rank_of(self.topology.device_of(self.topology.num_stages - 1))
            dist.broadcast_object_list(box, src=last, group=self.world.control)
            merged = box[0]
        return merged

    # ----- results --------------------------------------------------------------------------
    def _counters(self) -> dict:
        """Where the cumulative per-stage counters stand, so a result reports only its own share."""
        return {"sent": list(self.transport.bytes_sent)}

    def _result(self, loss: float, micro_batches: range, samples: int, seconds: float, executors,
                counters) -> StepResult:
        V = self.topology.num_stages
        busy = [0.0] * V
        lag = [0.0] * V
        weight_bytes = [0] * V
        act_bytes = [0] * V
        for d, ex in executors.items():
            for v in self._stages_on(d):
                busy[v] = ex.busy_seconds / max(seconds, 1e-12) / len(self._stages_on(d))
            ex.busy_seconds = 0.0
        for v, rt in self.runtimes.items():
            lags = [rt.version_lags.pop(g) for g in micro_batches if g in rt.version_lags]
            lag[v] = sum(lags) / len(lags) if lags else 0.0
            weight_bytes[v] = rt.policy.extra_weight_bytes()
            act_bytes[v] = rt.peak_activation_bytes
            rt.peak_activation_bytes = rt.activation_bytes()
        sent = [a - b for a, b in zip(self.transport.bytes_sent, counters["sent"])]
        peak = None
        if any(rt.device.type == "cuda" for rt in self.runtimes.values()):
            peak = [torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else 0
                    for rt in self.runtimes.values()]
        result = StepResult(self.updates, loss, samples, seconds, busy, lag, weight_bytes, act_bytes, sent, peak)
        if self.distributed and self.options.schedule != "async-1f1b":
            result = self._collect(*self._post_result(result))
        return result

    def _post_result(self, result: StepResult) -> tuple[StepResult, torch.Tensor, Any]:
        """Start summing per-stage numbers over ranks (non-blocking, so async pipelines keep flowing)."""
        V = self.topology.num_stages
        is_last = any(rt.is_last for rt in self.runtimes.values())
        mine = torch.zeros(2 + 5 * V, dtype=torch.float64)
        mine[0] = result.loss * result.samples if is_last else 0.0
        mine[1] = result.samples if is_last else 0.0
        for v in self.runtimes:
            mine[2 + v] = result.busy_fraction[v]
            mine[2 + V + v] = result.version_lag[v]
            mine[2 + 2 * V + v] = result.weight_version_bytes[v]
            mine[2 + 3 * V + v] = result.activation_bytes[v]
            mine[2 + 4 * V + v] = result.bytes_sent[v]
        return result, mine, dist.all_reduce(mine, group=self.world.control, async_op=True)

    def _collect(self, result: StepResult, total: torch.Tensor, work: Any) -> StepResult:
        """Finish the sum ``_post_result`` started: loss averaged over samples, per-stage numbers over replicas."""
        work.wait()
        V, D = self.topology.num_stages, self.options.data_parallel
        result.loss = float(total[0] / total[1])
        result.samples = int(total[1])
        part = lambda i: [float(x) / D for x in total[2 + i * V: 2 + (i + 1) * V]]  # noqa: E731
        result.busy_fraction, result.version_lag = part(0), part(1)
        result.weight_version_bytes = [int(x) for x in part(2)]
        result.activation_bytes = [int(x) for x in part(3)]
        result.bytes_sent = [int(x * D) for x in part(4)]
        return result

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

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

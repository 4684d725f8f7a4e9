"""The runner: trains and predicts with the parts of an assembled pipeline.

Sync steps, async streams and predict all create one executor per pipeline position this process
runs and drive them over a feed; every finished mini-batch takes the same path to its StepResult
(`_report`: losses and stage reports from the run, skip decision from the STEP, summed over ranks
under torchrun) and to the counters and TensorBoard (`_finish`).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from pipetrain.assembly import Parts, reconnect
from pipetrain.runtime import host_sync
from pipetrain.runtime.batching import batch_size, merge_micro_batches
from pipetrain.runtime.devices import caller_device, to_device
from pipetrain.runtime.executor import PositionExecutor, Recompute, drive
from pipetrain.runtime.feed import Feed, StreamFeed
from pipetrain.runtime.interrupts import interrupts_after_commit
from pipetrain.runtime.local_shards import reshard
from pipetrain.runtime.metrics import StepResult, TensorBoardLog
from pipetrain.runtime.nonfinite import NonFiniteError
from pipetrain.runtime.topology import ACT, Link
from schedules import ActionKind
from schedules.nccl_order import posted_batches


class Runner:
    """Runs steps, streams and predictions; counts updates and skipped steps; logs results."""

    def __init__(self, parts: Parts):
        self.parts = parts
        o = parts.options
        self.updates = 0
        self.skipped_steps = 0  # mini-batches whose update was skipped on every stage
        self.last_result: StepResult | None = None
        self.in_stream = False
        self.stop_requested = False
        self.callbacks: list[Callable[[StepResult], None]] = []  # Pipeline.on_step
        # Sizes the capture runs with, per input position of the first stage, checked per micro-batch.
        limits = parts.plan.graph.input_limits
        self._input_limits = {i: (n, limits[n]) for i, n in enumerate(parts.io.names) if n in limits}
        self._log = TensorBoardLog(o.logdir) if o.logdir and parts.engine.is_rank_zero else None
        self._reconnect = False  # a step raised under torchrun: the next one starts on new process groups
        self._ahead = parts.engine.receive_ahead  # receives posted one computation early (the engine decides)

    def train(self, pairs: Iterable[tuple[Any, Any]]) -> Iterator[StepResult]:
        """One result per (inputs, targets) pair: async-1f1b streams them, synchronous schedules step each."""
        if self.parts.options.schedule == "async-1f1b":
            yield from self.stream(pairs)
            return
        for x, y in pairs:
            yield self.step(x, y)

    def step(self, x: Any, y: Any) -> StepResult:
        """One mini-batch of a synchronous schedule. A step that raises before any stage applied its update
        (bad data, a failing loss, a non-finite value, Ctrl-C) leaves no trace: gradients, buffers, in-flight
        micro-batches and counters are as before it. Ctrl-C once a stage applied its update lets the step
        finish everywhere, then raises."""
        self._connected()
        p = self.parts
        feed = Feed(p.options.micro_batches, self._input_limits)
        feed.add(0, *p.engine.shard(p.io.arrange(x), y))
        start = time.perf_counter()
        executors = self._executors(feed, p.schedules.training.recompute, train=True)
        self._start(stream=False)
        for rt in p.stages.values():
            rt.begin_step()
        report = _SyncReport(self, feed, executors, start)
        with interrupts_after_commit(self._committed), self._abandoned_on_error():
            for _ in drive({d: ex.run(p.schedules.posted(p.schedules.training.actions[d], self._ahead), report)
                            for d, ex in executors.items()}):
                pass
            p.connections.transport.flush()
            for rt in p.stages.values():
                rt.end_step()
            self._settled(feed, 0)
            return self._finish(report.result)

    def _connected(self) -> None:
        if self._reconnect:
            reconnect(self.parts)
            self._reconnect = False

    def _committed(self) -> bool:
        return any(stepper.applied for stepper in self.parts.steppers.values())

    @contextlib.contextmanager
    def _abandoned_on_error(self) -> Iterator[None]:
        """Whatever raises inside (the caller stopping a stream too) abandons the work in flight on every
        stage this process holds; the stages put their buffers back unless an update was applied."""
        try:
            yield
        except BaseException as error:
            committed = self._committed()
            for rt in self.parts.stages.values():
                if committed:
                    rt.end_step()  # the buffers belong to the update that was applied
                rt.abandon()
            self.parts.connections.abandon()
            self._reconnect = self.parts.engine.distributed and not isinstance(error, GeneratorExit)
            explained = self.parts.engine.explain_failure(error)
            if explained is error:
                raise
            raise explained from error

    def stream(self, batches: Iterable) -> Iterator[StepResult]:
        """async-1f1b: keep the pipeline full for the whole stream; one result per mini-batch, in order."""
        self.in_stream = True
        for rt in self.parts.stages.values():
            rt.policy.start_stream()
        try:
            with self._abandoned_on_error():
                yield from self._run_stream(batches)
        finally:
            self.in_stream = False
            for rt in self.parts.stages.values():
                rt.policy.end_stream()

    def _run_stream(self, batches: Iterable) -> Iterator[StepResult]:
        self._connected()
        p = self.parts
        feed = StreamFeed(batches, p.options.micro_batches, limits=self._input_limits,
                          prepare=lambda x, y: p.engine.shard(p.io.arrange(x), y))  # checked before it enters
        executors = self._executors(feed, p.schedules.training.recompute, train=True)
        runs = {d: ex.run(posted_batches(p.schedules.stream(d, feed.has), self._ahead)) for d, ex in executors.items()}
        self._start(stream=True)
        start = time.perf_counter()
        pending: list[tuple] = []
        try:
            yield from self._stream_results(feed, executors, runs, start, pending)
        except NonFiniteError:
            # Every rank raises at the same STEP; what its peers take before theirs must still reach them.
            self._deliver_before_step(min(ex.steps_done for ex in executors.values()))
            raise
        p.connections.transport.flush()
        for item in pending:
            yield self._finish(p.connections.reporter.collect(*item))

    def _stream_results(self, feed: StreamFeed, executors: dict[int, PositionExecutor], runs: dict,
                        start: float, pending: list[tuple]) -> Iterator[StepResult]:
        """Drive the stream; a StepResult per mini-batch once every rank's report of it is in (``pending``
        keeps the ones still being summed); ends with the non-finite agreement of the last step read."""
        p = self.parts
        reported = 0
        for _ in drive(runs):
            done = min(ex.steps_done for ex in executors.values())
            while reported < done:
                now = time.perf_counter()
                report, loss_sum = self._report(feed, executors, reported, now - start)
                report.skipped = [ex.skipped.pop(reported) for ex in executors.values()][0]  # agreed: any position
                report.grad_norm = [s.grad_norms.pop(reported, float("nan")) for s in p.steppers.values()][0]
                start = now
                self._settled(feed, reported)
                feed.release(reported)
                reported += 1
                if not p.engine.distributed:
                    yield self._finish(report)
                    continue
                pending.append(p.connections.reporter.post(report, loss_sum))
                while pending and pending[0][1].is_completed():
                    yield self._finish(p.connections.reporter.collect(*pending.pop(0)))
        for stepper in p.steppers.values():
            stepper.finish_stream()

    def _deliver_before_step(self, step: int) -> None:
        """Complete the sends whose receivers take them before their STEP ``step`` in this stream."""
        p = self.parts
        work: dict[int, set] = {}

        def taken(link: Link, kind: str, micro_batch: int) -> bool:
            stage, computation = (link.dst, ActionKind.FORWARD) if kind == ACT else (link.src, ActionKind.BACKWARD)
            position = p.topology.position_of(stage)
            if position not in work:
                work[position] = p.schedules.stream_work_before_step(position, step)
            return (computation, micro_batch) in work[position]
        p.connections.transport.deliver(taken)

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """Forward only in eval mode; the full output on every rank, on the device of ``x``. The batch is
        pipelined in micro-batches whose outputs are concatenated when every output tensor is per sample;
        an output holding a value reduced over the batch (a loss) is computed on the whole batch at once."""
        self._connected()
        p = self.parts
        args = p.io.arrange(x)
        m = min(p.options.micro_batches, batch_size(args)) if p.io.splits_by_sample else 1
        feed = Feed(m, self._input_limits)
        feed.add(0, args)
        actions = p.schedules.forward_only(m)
        for rt in p.stages.values():
            rt.module.eval()
        grace = p.connections.grace
        try:
            executors = self._executors(feed, Recompute(), train=False)
            with self._abandoned_on_error(), grace.predicting() if grace else contextlib.nullcontext():
                for _ in drive({d: ex.run(p.schedules.posted(actions[d], self._ahead)) for d, ex in executors.items()}):
                    pass
                p.connections.transport.flush()
                self._settled(feed, 0)
        finally:
            for rt in p.stages.values():
                rt.module.train()
                # zero=3: no gradient reduction frees what the forwards all-gathered, as a step's does; keep only
                # the shards until the next forward gathers again (local: no collective, so no order to keep).
                reshard(rt.module)
        outputs = sorted((g, out) for ex in executors.values() for g, out in ex.predictions.items())
        merged = merge_micro_batches([out for _, out in outputs]) if outputs else None
        return to_device(p.engine.share_prediction(merged, p.topology), caller_device(x))

    def _settled(self, feed: Feed, t: int) -> None:
        """Mini-batch ``t`` finished here: under compile=, its shapes are one mini-batch closer to compiled."""
        if self.parts.connections.grace is not None:
            self.parts.connections.grace.finished_mini_batch(feed.mini_batch_shapes(t))

    def _start(self, stream: bool) -> None:
        for stepper in self.parts.steppers.values():
            stepper.start(self.updates + 1, stream=stream)

    def _executors(self, feed: Feed, recompute: Recompute, train: bool) -> dict[int, PositionExecutor]:
        p = self.parts
        split = p.options.splits_backward
        executors = {}
        for d, stepper in p.steppers.items():
            scaler, reducer = stepper.scaler, p.connections.reducers.get(d)
            executors[d] = PositionExecutor(
                d, p.stages_at(d), p.topology, p.connections.transport, feed, stepper,
                reduce=reducer.reduce if reducer else None,
                before_backward=reducer.before_backward if reducer else None, train=train,
                loss_scale=(lambda s=scaler: s.scale_value) if scaler is not None else (lambda: 1.0),
                split_backward=split, recompute=recompute)
        return executors

    def _report(self, feed: Feed, executors: dict[int, PositionExecutor], t: int,
                seconds: float) -> tuple[StepResult, float]:
        """Mini-batch ``t``'s result on this process (complete when it runs every stage) and its loss
        summed over samples (what the ranks sum)."""
        p = self.parts
        own = range(t * feed.micro_batches, (t + 1) * feed.micro_batches)
        loss_sum = _loss_sum([ex.losses for ex in executors.values()], own, feed)
        busy = {v: s for ex in executors.values() for v, s in ex.take_busy().items()}
        reports = {v: rt.report(own) for v, rt in p.stages.items()}
        result = p.connections.reporter.local(loss_sum, feed.mini_batch_size(t), seconds, reports, busy)
        result.stop_requested = self.stop_requested
        return result, loss_sum

    def _finish(self, result: StepResult) -> StepResult:
        self.updates += 1
        result.step = self.updates
        self.skipped_steps += result.skipped
        result.skipped_total = self.skipped_steps
        self.last_result = result
        if self._log is not None:
            self._log.write(result)
        for callback in self.callbacks:
            callback(result)
        return result

    def loaded(self, updates: int) -> None:
        """A checkpoint saved after ``updates`` steps was loaded into the stages."""
        self.updates = updates
        for reducer in self.parts.connections.reducers.values():
            reducer.share_updates()  # ZeRO with a predicting policy: v of the loaded state, from each owner

    def close(self) -> None:
        if self._log is not None:
            self._log.close()


class _SyncReport:
    """A sync step's report (the StepReport its executors hand to each OptimizerStep). Under torchrun each
    process takes its part at its STEP, where its only position finished the mini-batch, and the sum over ranks
    rides in the skip-or-step agreement's exchange; in one process the first position past the agreement takes
    it for all (every position finished by then)."""

    def __init__(self, runner: Runner, feed: Feed, executors: dict[int, PositionExecutor], start: float):
        self.runner, self.feed, self.executors, self.start = runner, feed, executors, start
        self.result: StepResult | None = None

    def vector(self, t: int) -> torch.Tensor | None:
        if not self.runner.parts.engine.distributed:
            return None
        return self.runner.parts.connections.reporter.vector(*self._take(t))

    def agreed(self, t: int, skip: bool, total: list[float] | None, grad_norm: float) -> None:
        if total is not None:
            self.result = self.runner.parts.connections.reporter.read(self.result, total)
        elif self.result is None:
            self._take(t)
        self.result.skipped = skip
        self.result.grad_norm = grad_norm

    def _take(self, t: int) -> tuple[StepResult, float]:
        """This process's result of mini-batch ``t`` and its loss sum."""
        self.result, loss_sum = self.runner._report(self.feed, self.executors, t, time.perf_counter() - self.start)
        return self.result, loss_sum


def _loss_sum(losses: list[dict[int, torch.Tensor]], micro_batches: range, feed: Feed) -> float:
    """Sum over samples of the loss (0 where this process has no last stage); mean = sum / samples
    in every engine, so local and distributed report the same bits. Summed on the device in float64
    (the same bits as adding the Python floats) and read once: one host synchronisation per step."""
    total = None
    for found in losses:
        for g in micro_batches:
            if g in found:
                term = found.pop(g).double() * feed.size(g)
                total = term if total is None else total + term
    if total is None:
        return 0.0
    host_sync.note("loss report")
    return float(total)

"""The executor: one loop that runs a position's action list, dispatching on the action kind.

It is a generator: it yields ``BLOCKED`` while a message it needs has not arrived and
``DONE`` after each action. It runs a position's program as ``schedules.nccl_order.posted_batches``
gives it: the SEND and RECV actions between two computations are one comm batch, with the receives
of the computation after the next one when receiving ahead, which the transport turns into groups per
communicator: the order NCCL needs, checked for every schedule. The local engine interleaves the
generators of all positions in one process; the distributed engine drives the one of its rank (its
transport waits instead of blocking the generator). Both execute the same lists ``schedules`` builds.

SEND and RECV actions move the links between two positions. A link whose two stages run on one position
(a skip connection between chunks of an interleaved position; V placement's turn, which the schedule moves
without any action) is handed over in memory as soon as its values exist: the activations right after the
forward that makes them, the gradients right after the backward. ``ScheduleBook.check_links`` makes sure at
wrap that every other link has its actions.

A message carries each value in the dtype the stage produced it in, as the unsplit model would hold it
under the same autocast (a bf16 activation, an fp32 residual or rotary table), and each gradient in the
dtype of the tensor it belongs to: casting at a boundary would round what the model keeps in fp32.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils import _pytree as pytree

from pipetrain.runtime.devices import move, to_device
from pipetrain.runtime.feed import Feed
from pipetrain.runtime.optimizer_step import StepReport
from pipetrain.runtime.progress import BLOCKED, DONE, STEPPED
from pipetrain.runtime.stage import StageRuntime, takes_grad
from pipetrain.runtime.topology import ACT, GRAD, Link, Message, Topology
from schedules import Action, ActionKind
from schedules.nccl_order import CommBatch

# (t, losses, report) -> ...; returns whether t was skipped
StepCall = Callable[[int, list[torch.Tensor], StepReport | None], Iterator[str]]


@dataclass(frozen=True)
class Recompute:
    """Which forwards keep only their inputs and run again right before their backward, resolved once
    from the plan's per-stage settings and the schedule: every forward of ``stages`` (an endless async
    stream) and the (virtual stage, micro-batch) pairs of ``forwards``."""

    stages: frozenset[int] = frozenset()
    forwards: frozenset[tuple[int, int]] = frozenset()

    def __call__(self, stage: int, micro_batch: int) -> bool:
        return stage in self.stages or (stage, micro_batch) in self.forwards


class PositionExecutor:
    """Executes the actions of one pipeline position (all its chunks / virtual stages)."""

    def __init__(self, position: int, stages: dict[int, StageRuntime], topology: Topology, transport: Any,
                 feed: Feed, step: StepCall, reduce: Callable[[int], None] | None = None,
                 before_backward: Callable[[bool], None] | None = None, train: bool = True,
                 loss_scale: Callable[[], float] = lambda: 1.0, split_backward: bool = False,
                 recompute: Recompute = Recompute()):
        self.position = position
        self.stages = stages  # chunk -> runtime
        self.topology = topology
        self.transport = transport
        self.feed = feed
        self.step = step
        self.reduce = reduce
        self.before_backward = before_backward
        self.split_backward = split_backward  # zero-bubble: B computes input gradients, W weight gradients
        self.recompute = recompute
        self.train = train
        self.loss_scale = loss_scale
        self.outputs: dict[tuple[int, int], Any] = {}       # (stage, micro-batch) -> forward outputs to send
        self.input_grads: dict[tuple[int, int], list] = {}  # (stage, micro-batch) -> gradients to send back
        self.float_leaves: dict[tuple[int, int], dict[str, int]] = {}  # gradients expected per output
        # What the run produced, read by the runner: the last stage's outputs (predict) or losses (training)
        # per micro-batch, and per finished STEP t whether its update was skipped.
        self.predictions: dict[int, Any] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.skipped: dict[int, bool] = {}
        self.steps_done = 0
        self._busy = {stage.index: 0.0 for stage in stages.values()}

    def run(self, program: Iterable[Action | CommBatch], report: StepReport | None = None) -> Iterator[str]:
        """Execute ``program``: a position's actions as ``posted_batches`` yields them; a sync step's STEP hands
        ``report`` to the optimizer step."""
        for action in program:
            if isinstance(action, CommBatch):
                self.transport.exchange([m for a in action.actions for m in self._messages(a)],
                                        [m for a in action.ahead for m in self._messages(a)])
                yield DONE
                continue
            handler = _HANDLERS.get(action.kind)
            if handler is None:
                raise ValueError(f"the runtime cannot execute action {action} ({action.kind.name}); "
                                 "use a schedule that schedules.build makes")
            yield from (self._step(action, report) if action.kind == ActionKind.STEP
                        else getattr(self, handler)(action))
            yield STEPPED if action.kind == ActionKind.STEP else DONE

    def _stage(self, action: Action) -> StageRuntime:
        return self.stages[action.chunk]

    def _wait(self, links, kind: str, micro_batch: int) -> Iterator[str]:
        for link in links:
            while not self.transport.ready(link, kind, micro_batch):
                yield BLOCKED

    def _forward(self, a: Action) -> Iterator[str]:
        stage = self._stage(a)
        g = a.micro_batch
        if stage.index == 0:
            inputs = self.feed.inputs(g)
            inputs = tuple(move(v, stage.device) if isinstance(v, torch.Tensor) else v for v in inputs)
        else:
            links = self.topology.into[stage.index]
            yield from self._wait(links, ACT, g)
            inputs = self.topology.assemble(stage.index, {l.index: self.transport.take(l, ACT, g) for l in links})
        target = None
        if stage.is_last and self.train:
            target = to_device(self.feed.target(g), stage.device)  # the loss is computed where the output is
        start = time.perf_counter()
        out = stage.forward(g, inputs, target, self.feed.grad_weight(g), grad=self.train,
                            recompute=self.recompute(stage.index, g))
        self._busy[stage.index] += time.perf_counter() - start
        if stage.is_last:
            (self.losses if self.train else self.predictions)[g] = out
        else:
            values = dict(zip(self.topology.outputs[stage.index], _as_tuple(out)))
            for link in self.topology.local_out_of[stage.index]:
                self.transport.hand_over(link, ACT, g, [values[n] for n in link.names])
            if self.topology.remote_out_of[stage.index]:  # the SEND_ACT takes them
                self.outputs[(stage.index, g)] = values
            if self.train:
                self.float_leaves[(stage.index, g)] = {n: _count_float(v) for n, v in values.items()}

    def _messages(self, a: Action) -> Iterator[Message]:
        """The messages a SEND or RECV action moves: one per link of its stage in that direction."""
        stage = self._stage(a)
        g, kind = a.micro_batch, a.kind
        shapes = self.feed.shapes(g)
        into, out_of = self.topology.remote_into[stage.index], self.topology.remote_out_of[stage.index]
        if kind == ActionKind.SEND_ACT:
            values = self.outputs.pop((stage.index, g))
            for link in out_of:
                yield Message(link, ACT, g, [values[n] for n in link.names], shapes)
        elif kind == ActionKind.RECV_ACT:
            for link in into:
                yield Message(link, ACT, g, None, shapes)
        elif kind == ActionKind.SEND_GRAD:
            grads = self.input_grads.pop((stage.index, g))
            for link in into:
                yield Message(link, GRAD, g, self._link_grads(stage, link, grads), shapes)
        else:
            for link in out_of:
                yield Message(link, GRAD, g, None, shapes)

    def _link_grads(self, stage: StageRuntime, link: Link, grads: list[list]) -> list:
        """The gradients of ``link``'s values among ``grads`` (per input of the stage, in input order)."""
        index = self.topology.input_index[stage.index]
        return [t for n in link.names for t in grads[index[n]]]

    def _backward(self, a: Action) -> Iterator[str]:
        stage = self._stage(a)
        g = a.micro_batch
        grads = None
        if not stage.is_last:
            links = self.topology.out_of[stage.index]
            yield from self._wait(links, GRAD, g)
            by_link = {l.index: self.transport.take(l, GRAD, g) for l in links}
            grads = self._output_grads(stage, g, links, by_link)
        last = (g + 1) % self.feed.micro_batches == 0
        if self.before_backward is not None:
            # The last micro-batch of a mini-batch may start the data-parallel reduction during its backward.
            self.before_backward(last)
        start = time.perf_counter()
        input_grads = stage.backward(g, grads, loss_scale=self.loss_scale(), split=self.split_backward, last=last)
        self._busy[stage.index] += time.perf_counter() - start
        if stage.index > 0:
            for link in self.topology.local_into[stage.index]:
                self.transport.hand_over(link, GRAD, g, self._link_grads(stage, link, input_grads))
            if self.topology.remote_into[stage.index]:  # the SEND_GRAD takes them
                self.input_grads[(stage.index, g)] = input_grads

    def _output_grads(self, stage: StageRuntime, g: int, links, by_link: dict[int, list]) -> list:
        """Sum the gradients every consumer sent for each floating output, in output order.

        An output read by several later stages (a skip connection and the next stage)
        receives one gradient per consumer; their sum is its gradient.
        """
        counts = self.float_leaves.pop((stage.index, g))
        sums: dict[str, list] = {}
        for link in links:
            it = iter(by_link[link.index])
            for name in link.names:
                grads = [next(it) for _ in range(counts[name])]
                sums[name] = [a + b for a, b in zip(sums[name], grads)] if name in sums else grads
        return [t for n in self.topology.outputs[stage.index] for t in sums.get(n, [])]

    def _weight(self, a: Action) -> Iterator[str]:
        stage = self._stage(a)
        start = time.perf_counter()
        stage.backward_weight(a.micro_batch)
        self._busy[stage.index] += time.perf_counter() - start
        return iter(())

    def _step(self, a: Action, report: StepReport | None = None) -> Iterator[str]:
        t, m = a.micro_batch, self.feed.micro_batches
        losses = [self.losses[g] for g in range(t * m, (t + 1) * m) if g in self.losses]
        self.skipped[t] = yield from self.step(t, losses, report)
        self.steps_done += 1

    def take_busy(self) -> dict[int, float]:
        """Compute seconds per stage since the last call."""
        busy, self._busy = self._busy, dict.fromkeys(self._busy, 0.0)
        return busy

    def _reduce(self, a: Action) -> Iterator[str]:
        if self.reduce is not None:
            self.reduce(a.micro_batch)
        return iter(())

    def _overlap(self, a: Action) -> Iterator[str]:
        """A marker (dualpipev): the forward after it could overlap the backward that follows it. Both run
        in order here; the mark is where a communication hook would hide behind the other's compute."""
        return iter(())


def _count_float(value: Any) -> int:
    return sum(1 for v in pytree.tree_leaves(value) if takes_grad(v))


def _as_tuple(out: Any) -> tuple:
    return out if isinstance(out, tuple) else (out,)


# Method names, not bound methods: a table of its own bound methods would hold the executor in a reference cycle, and
# with it the process groups its transport uses, until a garbage collection (Pipeline.close).
_HANDLERS = {ActionKind.FORWARD: "_forward", ActionKind.BACKWARD: "_backward", ActionKind.WEIGHT: "_weight",
             ActionKind.STEP: "_step", ActionKind.REDUCE: "_reduce", ActionKind.OVERLAP: "_overlap"}


class DeadlockError(RuntimeError):
    """Every pipeline position waits for a message no position will send."""


def drive(runs: dict[int, Iterator[str]]) -> Iterator[None]:
    """Advance every position's executor; yields after each round so callers can collect results.

    Local engine: round-robin, each position runs until it waits for a message. Distributed:
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
                if state == STEPPED:  # let the caller report the finished mini-batch now, not at the end
                    break
        if not progressed:
            raise DeadlockError(f"pipeline positions {sorted(live)} wait for each other: the schedule cannot run "
                                "with this plan (a stage waits for a message no stage will send)")
        yield

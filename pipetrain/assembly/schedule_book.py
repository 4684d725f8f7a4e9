"""The action lists a pipeline runs, built and validated once per (kind, micro-batches), with the
recomputation choice resolved into data (`Recompute`) once the plan has fixed each stage's setting."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import schedules
from pipetrain.runtime.executor import Recompute
from pipetrain.runtime.topology import Topology
from schedules import Action, ActionKind
from schedules.held_activations import recomputed
from schedules.nccl_order import posted_batches
from schedules.placement import virtual_stage_of

FORWARD_ONLY = frozenset({ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT})
TAKES_CHUNKS = ("interleaved-1f1b", "interleaved-zb", "gpipe")  # builders whose chunk count is an option


@dataclass(frozen=True)
class RunSchedule:
    """One action list per pipeline position and which forwards recompute."""

    actions: list[list[Action]]
    recompute: Recompute


class ScheduleBook:
    """Schedules of one pipeline: ``positions`` pipeline positions, ``chunks`` virtual stages each."""

    def __init__(self, kind: str, positions: int, micro_batches: int, chunks: int, data_parallel: bool):
        self.kind, self.positions, self.micro_batches = kind, positions, micro_batches
        self.chunks, self.data_parallel = chunks, data_parallel
        self._built: dict[tuple[str, int], schedules.Schedule] = {}
        self._posted: dict[tuple[int, bool], tuple[list[Action], list]] = {}  # id(actions), ahead -> (actions, program)
        self._forward_only: dict[int, list[list[Action]]] = {}
        # which virtual stage each chunk of a position is (schedules.placement): the schedule kind's
        self.placement = "loop" if kind == "async-1f1b" else self.build(kind, micro_batches).placement
        self.training = RunSchedule(self.planning_actions(), Recompute())

    def build(self, kind: str, micro_batches: int) -> schedules.Schedule:
        """A synchronous schedule, validated (bad combinations, e.g. interleaved with m % stages, fail here)."""
        key = (kind, micro_batches)
        if key not in self._built:
            options = {"chunks": self.chunks} if kind in TAKES_CHUNKS and self.chunks > 1 else {}
            sched = schedules.build(kind, self.positions, micro_batches, **options)
            if self.data_parallel:
                sched = schedules.with_reductions(sched)
            schedules.validate(sched)
            self._built[key] = sched
        return self._built[key]

    def planning_actions(self) -> list[list[Action]]:
        """Every position's actions for one mini-batch of training (async-1f1b: a few mini-batches of the
        stream), as the memory model reads them."""
        if self.kind != "async-1f1b":
            return self.build(self.kind, self.micro_batches).actions
        return [list(schedules.async_1f1b_actions(d, self.positions, self.micro_batches, lambda t: t < 4))
                for d in range(self.positions)]

    def resolve_recompute(self, settings: list[str] | None) -> None:
        """Fix which training forwards recompute from the plan's per-virtual-stage settings."""
        S = self.positions
        settings = settings or ["none"] * (S * self.chunks)
        stage = lambda d, c: virtual_stage_of(d, c, S, self.placement)  # noqa: E731
        if self.kind == "async-1f1b":  # the stream never ends: every stage but the last runs other forwards between
            stages = frozenset(v for v, s in enumerate(settings) if s == "always" or (s == "except-last" and v != S - 1))
            recompute = Recompute(stages=stages)
        else:
            forwards = set()
            for d, actions in enumerate(self.training.actions):
                for setting in set(settings) - {"none"}:
                    forwards |= {(stage(d, c), g) for c, g in recomputed(actions, setting)
                                 if settings[stage(d, c)] == setting}
            recompute = Recompute(forwards=frozenset(forwards))
        self.training = RunSchedule(self.training.actions, recompute)

    def posted(self, actions: list[Action], receive_ahead: bool) -> list:
        """``actions`` (one of this book's lists) as the executor runs them (``posted_batches``), worked out
        once: the same list runs every step, and regrouping it each time costs the host on every step."""
        key = (id(actions), receive_ahead)
        kept = self._posted.get(key)
        if kept is None or kept[0] is not actions:
            kept = self._posted[key] = (actions, list(posted_batches(actions, receive_ahead)))
        return kept[1]

    def stream(self, position: int, has: Callable[[int], bool]) -> Iterator[Action]:
        """async-1f1b: position ``position``'s endless action stream while mini-batch ``t`` exists (``has``)."""
        actions = schedules.async_1f1b_actions(position, self.positions, self.micro_batches, has)
        return schedules.stream_with_reductions(actions) if self.data_parallel else actions

    def stream_work_before_step(self, position: int, step: int) -> set[tuple[ActionKind, int]]:
        """async-1f1b: the (FORWARD or BACKWARD, micro-batch) computations position ``position`` runs before its
        STEP ``step``, as a stream long enough to reach it runs them."""
        done = set()
        for a in schedules.async_1f1b_actions(position, self.positions, self.micro_batches, lambda t: True):
            if a.kind == ActionKind.STEP and a.micro_batch == step:
                return done
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                done.add((a.kind, a.micro_batch))
        raise AssertionError("an endless stream reaches every STEP")

    def forward_only(self, micro_batches: int) -> list[list[Action]]:
        """predict: the forwards of GPipe with the same stage placement (any m works, unlike
        interleaved-1f1b, which needs m divisible by stages: a short last batch need not be); in V
        placement, which GPipe does not have, the forwards of the training schedule (any m works too)."""
        if micro_batches not in self._forward_only:
            kind = "gpipe" if self.placement == "loop" else self.kind
            self._forward_only[micro_batches] = [[a for a in actions if a.kind in FORWARD_ONLY]
                                                 for actions in self.build(kind, micro_batches).actions]
        return self._forward_only[micro_batches]

    def check_links(self, topology: Topology) -> None:
        """Raise unless the schedule moves every link between two positions: a SEND at the stage that
        makes the values and a RECV at the one that uses them, for the activations and their gradients.
        A link inside one position is handed over in memory; V placement moves nothing from virtual
        stage positions-1 (and into stage positions, both on the last position), so a skip connection
        leaving or entering the V's turn there has no action to travel with and would wait for ever."""
        present = {(d, a.chunk, a.kind) for d, actions in enumerate(self.training.actions) for a in actions}
        SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
        SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
        for link in topology.links:
            if topology.same_position(link):
                continue
            ends = {v: (topology.position_of(v), topology.chunk_of(v)) for v in (link.src, link.dst)}
            needed = [(link.src, SEND_ACT), (link.dst, RECV_ACT), (link.dst, SEND_GRAD), (link.src, RECV_GRAD)]
            missing = [(v, kind) for v, kind in needed if (*ends[v], kind) not in present]
            if missing:
                v, kind = missing[0]
                raise ValueError(
                    f"schedule {self.kind!r} cannot carry {list(link.names)} from stage {link.src} to stage {link.dst} "
                    f"(positions {ends[link.src][0]} -> {ends[link.dst][0]}): stage {v} has no {kind.value} action, "
                    f"as its neighbour on that side runs on its own position (the {self.placement} placement's "
                    "hand-over in memory); fix: split points where no value skips over that turn "
                    "(partitioner=[...]), or a schedule with loop placement ('interleaved-zb', 'zb-h1')")

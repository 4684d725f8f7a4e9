"""`simulate(schedule, costs)`: time a schedule with an event simulation.

Bubble fraction = idle compute time / (stages x makespan), where a stage's
compute time is the sum of its F, B and W durations (SEND, RECV, STEP and
REDUCE take no time; communication delays the consumer). With forward = 1,
backward = 1 (or 2) and free communication GPipe and 1F1B give
(p-1)/(m+p-1).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from schedules.actions import ActionKind
from schedules.costs import Costs
from schedules.timeline import Timeline, execute
from schedules.gc_pause import gc_paused
from schedules.lags import forward_backward_lags
from schedules.schedule import Schedule
from schedules.validate import check_structure, raise_if_deadlocked

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
_kind = attrgetter("kind")


@dataclass
class SimResult:
    """What a simulated run of `schedule` looks like.

    peak_in_flight[k]: most (micro-batch, chunk) units stage k holds
    activations for at once (from F until B, or until W when the backward is
    split). version_lag[k]: (micro_batch, lag) per backward, in execution
    order; lag = optimizer steps stage k took between that micro-batch's
    forward and its backward (0 for flushing schedules). start/end: time of
    every action, shaped like schedule.actions.
    """

    schedule: Schedule
    costs: Costs
    makespan: float
    bubble_fraction: float
    utilisation: list[float]
    peak_in_flight: list[int]
    version_lag: list[list[tuple[int, int]]]
    start: list[list[float]] = field(repr=False)
    end: list[list[float]] = field(repr=False)

    def summary(self) -> str:
        """Human-readable table: makespan, bubble, and per stage utilisation, memory and lag."""
        s, c = self.schedule, self.costs
        shape = f"{s.stages} stages x {s.micro_batches} micro-batches"
        if s.chunks > 1:
            shape += f", {s.chunks} chunks per stage"
        if s.mini_batches > 1:
            shape += f", {s.mini_batches} mini-batches"
        lines = [
            f"schedule {s.kind}: {shape}",
            f"costs: forward={c.forward} backward={c.backward} weight={c.weight} comm={c.comm}",
            f"makespan {self.makespan:g}   bubble {100 * self.bubble_fraction:.2f}%",
            f"{'stage':>5}  {'utilisation':>11}  {'peak in-flight':>14}  {'fwd->bwd lag':>12}",
        ]
        for k in range(s.stages):
            lags = [lag for _, lag in self.version_lag[k]] or [0]
            lag = f"{min(lags)}..{max(lags)}" if min(lags) != max(lags) else f"{lags[0]}"
            lines.append(f"{k:>5}  {100 * self.utilisation[k]:>10.1f}%  "
                         f"{self.peak_in_flight[k]:>14}  {lag:>12}")
        return "\n".join(lines)


@gc_paused()
def simulate(schedule: Schedule, costs: Costs, *, validate: bool = True,
             held: tuple[list[int], list[list[tuple[int, int]]]] | None = None) -> SimResult:
    """Validate `schedule` (raises ScheduleError), then simulate it under `costs`. validate=False: the
    schedule is build()'s own, whose every kind tests/test_schedules_builders.py validates (a planner
    simulates thousands of them); a deadlock is still raised. held: memory_and_lags(schedule), which a
    caller simulating one unchanging schedule under many costs may compute once."""
    if validate:
        check_structure(schedule)
    p = schedule.stages
    split = is_split(schedule)
    per_device = compute_per_device(schedule, costs, split)
    timeline = execute(schedule, per_device, costs.latency(p, wraps=schedule.chunks > 1 and schedule.placement == "loop"))
    return result_of_timeline(schedule, costs, timeline, split, held)


def is_split(schedule: Schedule) -> bool:
    """True when the backward is split into B and W actions (zero-bubble schedules)."""
    return any(W in map(_kind, actions) for actions in schedule.actions)


def compute_per_device(schedule: Schedule, costs: Costs, split: bool) -> list[dict[ActionKind, float]]:
    """Seconds of one F, B and W action on each device (a chunk does 1/chunks of its device's work)."""
    fwd, bwd, wgt = costs.compute(schedule.stages)
    return [{F: fwd[d] / schedule.chunks,
             B: (bwd[d] if split else bwd[d] + wgt[d]) / schedule.chunks,
             W: wgt[d] / schedule.chunks}
            for d in range(schedule.stages)]


def result_of_timeline(schedule: Schedule, costs: Costs, timeline: Timeline, split: bool,
                       held: tuple[list[int], list[list[tuple[int, int]]]] | None = None) -> SimResult:
    """The SimResult of an executed timeline (raises ScheduleError if it deadlocked); held: memory_and_lags
    of the schedule when the caller has it."""
    p = schedule.stages
    raise_if_deadlocked(schedule, timeline)
    makespan = max((ends[-1] for ends in timeline.end if ends), default=0.0)
    busy = timeline.busy
    utilisation = [b / makespan if makespan else 0.0 for b in busy]
    bubble = 1.0 - sum(busy) / (p * makespan) if makespan else 0.0
    if held is None:
        peaks, lags = zip(*(_memory_and_lag(actions, split) for actions in schedule.actions))
    else:  # copied: a result's lists are its own, whoever shares `held`
        peaks, lags = held[0], [list(lag) for lag in held[1]]
    return SimResult(schedule, costs, makespan, bubble, utilisation, list(peaks), list(lags),
                     timeline.start, timeline.end)


def memory_and_lags(schedule: Schedule) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """Per stage, what a SimResult reports that depends on the action lists alone: peak_in_flight and
    version_lag."""
    split = is_split(schedule)
    peaks, lags = zip(*(_memory_and_lag(actions, split) for actions in schedule.actions))
    return list(peaks), list(lags)


def _memory_and_lag(actions, split: bool) -> tuple[int, list[tuple[int, int]]]:
    held = peak = 0
    for a in actions:
        kind = a.kind
        if kind is F:
            held += 1
            peak = max(peak, held)
        elif kind is B:
            held -= not split
        elif kind is W:
            held -= 1
    return peak, [(u, lag) for _, u, lag in forward_backward_lags(actions)]

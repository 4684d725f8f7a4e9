"""Compute orders found by running a pipeline at unit costs and letting each idle device pick.

The zero-bubble schedules with several chunks per device (zbv, dualpipev, interleaved-zb) are
orders of F, B and W units that keep every device busy. Instead of a closed form per schedule,
`list_schedule` plays the pipeline forward in unit time steps (F = B = W = 1 per chunk, free
communication): at each step every idle device runs the ready unit its schedule's `pick` prefers.
A unit is ready when its input is there (the F of the previous virtual stage, the B of the
next one, its own B for a W) and the units of earlier micro-batches of the same kind and chunk
have started: messages of one link then flow in micro-batch order. Because the orders come from
an actual run, they are free of deadlock at any costs: a device only waits for what its
neighbours run earlier in their own lists.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from schedules.actions import Action, ActionKind
from schedules.placement import virtual_stage_of

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


class Unit(NamedTuple):
    """One compute unit a device may run next."""

    kind: ActionKind
    micro_batch: int
    chunk: int
    virtual_stage: int


# pick(device, ready units, units of this device in flight (F started, W not started), history) -> unit or None
Picker = Callable[[int, list[Unit], int, list[Unit]], "Unit | None"]


def list_schedule(stages: int, micro_batches: int, chunks: int, placement: str, pick: Picker) -> list[list[Action]]:
    """Per device, the F/B/W actions in the order a unit-cost run with `pick` starts them."""
    virtual = stages * chunks
    finished: dict[tuple[ActionKind, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> end time
    next_of = [[{F: 0, B: 0, W: 0} for _ in range(chunks)] for _ in range(stages)]  # next micro-batch per kind
    in_flight = [0] * stages
    history: list[list[Unit]] = [[] for _ in range(stages)]
    total = 3 * micro_batches * chunks
    t = 0
    while any(len(h) < total for h in history):
        started = []
        for d in range(stages):
            ready = []
            for c in range(chunks):
                v = virtual_stage_of(d, c, stages, placement)
                for kind in (F, B, W):
                    m = next_of[d][c][kind]
                    if m < micro_batches and _inputs_ready(kind, m, v, virtual, finished, t):
                        ready.append(Unit(kind, m, c, v))
            unit = pick(d, ready, in_flight[d], history[d]) if ready else None
            if unit is not None:
                started.append((d, unit))
        if not started and all(end <= t for end in finished.values()):
            raise RuntimeError(f"list_schedule: no device can start a unit at step {t}; the pick "
                               "function starves the pipeline (raise its in-flight limit)")
        for d, unit in started:
            history[d].append(unit)
            next_of[d][unit.chunk][unit.kind] += 1
            in_flight[d] += (unit.kind is F) - (unit.kind is W)
            finished[(unit.kind, unit.micro_batch, unit.virtual_stage)] = t + 1
        t += 1
    return [[Action(d, u.kind, u.micro_batch, u.chunk) for u in units] for d, units in enumerate(history)]


def _inputs_ready(kind: ActionKind, m: int, v: int, virtual: int, finished: dict, t: int) -> bool:
    def done(k: ActionKind, stage: int) -> bool:
        return finished.get((k, m, stage), t + 1) <= t

    if kind is F:
        return v == 0 or done(F, v - 1)
    if kind is B:
        return done(F, v) and (v == virtual - 1 or done(B, v + 1))
    return done(B, v)

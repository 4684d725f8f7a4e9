"""The data-parallel pass: a REDUCE t right before each STEP t.

With replicas of the pipeline, each device all-reduces its gradients of
mini-batch t across replicas before it steps. The builders leave that out, so
one schedule serves any replica count; the runtime and the simulators apply
this pass when there are replicas. It works on a whole Schedule and, lazily, on
one device's action stream (async-1f1b's endless generator).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator

from schedules.actions import Action, ActionKind
from schedules.schedule import Schedule

STEP, REDUCE = ActionKind.STEP, ActionKind.REDUCE


def stream_with_reductions(actions: Iterable[Action]) -> Iterator[Action]:
    """Yield `actions` with REDUCE t inserted right before each STEP t.

    Lazy: it pulls one action at a time, so an endless generator stays endless
    and its look-ahead (e.g. async_1f1b_actions asking for mini-batches) is unchanged.
    Raises ValueError at a REDUCE already in the input: applying the pass twice
    would reduce every gradient twice, and a stream is never validated.
    """
    for a in actions:
        kind = a.kind
        if kind is STEP:
            yield Action(a.position, REDUCE, a.micro_batch)
        elif kind is REDUCE:
            raise ValueError(f"stage {a.position} already has {a}; add reductions once, "
                             "to a schedule built without them")
        yield a


def with_reductions(schedule: Schedule) -> Schedule:
    """A copy of `schedule` with REDUCE t right before each STEP t on every device.

    Everything else (kind, shape, the other actions and their order) is unchanged;
    the input is not modified. Raises ValueError if it already has a REDUCE.
    """
    actions = [list(stream_with_reductions(device)) for device in schedule.actions]
    return dataclasses.replace(schedule, actions=actions)

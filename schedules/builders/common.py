"""Helpers shared by the schedule builders."""
from __future__ import annotations

from schedules.actions import Action, ActionKind


def check_count(name: str, value: object, minimum: int = 1) -> int:
    """Return `value` if it is an int >= minimum, else raise a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def step_tail(stage: int, mini_batch: int, data_parallel: bool) -> list[Action]:
    """The end of a mini-batch on one device: [REDUCE t] STEP t."""
    tail = [Action(stage, ActionKind.REDUCE, mini_batch)] if data_parallel else []
    tail.append(Action(stage, ActionKind.STEP, mini_batch))
    return tail

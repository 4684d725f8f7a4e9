"""GPipe: fill-drain (all forwards, then all backwards, then one optimizer step)."""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.common import step_tail
from schedules.builders.send_recv import attach_comms
from schedules.schedule import Schedule


def gpipe(stages: int, micro_batches: int, *, data_parallel: bool = False) -> Schedule:
    """GPipe schedule. Peak in-flight micro-batches: m at every stage."""
    compute = []
    for d in range(stages):
        actions = [Action(d, ActionKind.FORWARD, i) for i in range(micro_batches)]
        actions += [Action(d, ActionKind.BACKWARD, i) for i in range(micro_batches)]
        compute.append(actions + step_tail(d, 0, data_parallel))
    return Schedule("gpipe", stages, micro_batches, attach_comms(compute, stages, 1))

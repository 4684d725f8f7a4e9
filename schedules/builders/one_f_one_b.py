"""1F1B (PipeDream-Flush): warm-up forwards, alternate one forward / one backward, flush."""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.send_recv import attach_comms
from schedules.schedule import Schedule


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """F/B order of one stage: p-k-1 warm-up forwards, then F(i+w) B(i) pairs, then drain."""
    warmup = min(stages - stage - 1, micro_batches)
    actions = [Action(stage, ActionKind.FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions.append(Action(stage, ActionKind.FORWARD, warmup + i))
        actions.append(Action(stage, ActionKind.BACKWARD, i))
    actions += [Action(stage, ActionKind.BACKWARD, i)
                for i in range(micro_batches - warmup, micro_batches)]
    return actions


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """1F1B schedule. Peak in-flight micro-batches at stage k (0-based): min(p-k, m)."""
    compute = [one_f_one_b_order(d, stages, micro_batches) + [Action(d, ActionKind.STEP, 0)]
               for d in range(stages)]
    return Schedule("1f1b", stages, micro_batches, attach_comms(compute, stages, 1))

"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): backward split into B and W.

B computes the input gradient (on the critical path, sent upstream at once);
W computes the weight gradient and can wait. Stage k keeps the 1F1B order of F
and B and runs each W k backwards late, so that the W's fill the drain bubble.
With F = B = W the bubble is (p-1)/(3m+p-1) instead of 1F1B's 3(p-1)/(3m+3(p-1)).
"""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.one_f_one_b import one_f_one_b_order
from schedules.builders.send_recv import attach_comms
from schedules.schedule import Schedule


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """ZB-H1 schedule.

    Peak in-flight micro-batches at stage k: min(p-k, m) between F and B (as in
    1F1B) and min(p, m) between F and W (W keeps only what the weight gradient needs).
    """
    compute = []
    for d in range(stages):
        actions: list[Action] = []
        weights_done = 0
        for a in one_f_one_b_order(d, stages, micro_batches):
            actions.append(a)
            if a.kind is ActionKind.BACKWARD and a.micro_batch - weights_done >= d:
                actions.append(Action(d, ActionKind.WEIGHT, weights_done))
                weights_done += 1
        actions += [Action(d, ActionKind.WEIGHT, i) for i in range(weights_done, micro_batches)]
        compute.append(actions + [Action(d, ActionKind.STEP, 0)])
    return Schedule("zb-h1", stages, micro_batches, attach_comms(compute, stages, 1))

"""GPipe: fill-drain (all forwards, then all backwards, then one optimizer step)."""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.common import check_count
from schedules.builders.send_recv import attach_comms
from schedules.schedule import Schedule


def gpipe(stages: int, micro_batches: int, *, chunks: int = 1) -> Schedule:
    """GPipe schedule. Peak in-flight micro-batches: m x chunks at every stage.

    With chunks > 1 each device holds `chunks` virtual stages placed as in interleaved 1F1B
    (v = chunk * stages + device) and runs every micro-batch through one chunk before the next
    (a looped fill-drain): any micro-batch count works, which the forward-only pass of an
    interleaved pipeline's predict() needs.
    """
    check_count("chunks", chunks)
    compute = []
    for d in range(stages):
        actions = [Action(d, ActionKind.FORWARD, i, c) for c in range(chunks) for i in range(micro_batches)]
        actions += [Action(d, ActionKind.BACKWARD, i, c) for c in reversed(range(chunks)) for i in range(micro_batches)]
        compute.append(actions + [Action(d, ActionKind.STEP, 0)])
    return Schedule("gpipe", stages, micro_batches, attach_comms(compute, stages, chunks), chunks=chunks)

"""Weight-version lag: how many optimizer steps a stage takes between a micro-batch's forward and
its backward, read off the action lists the runtime executes.

Synchronous schedules flush before every step, so every lag is 0. In async-1f1b with m
micro-batches per mini-batch a stage steps once every m backwards, so the lag of a micro-batch
depends on where it falls in its mini-batch; staleness policies that predict weights
(spectrain, nesterov) need that number per micro-batch, not a per-stage constant.
"""
from __future__ import annotations

from typing import Iterable

from schedules.actions import Action, ActionKind
from schedules.builders.async_1f1b import async_1f1b_actions


def forward_backward_lags(actions: Iterable[Action]) -> list[tuple[int, int, int]]:
    """(chunk, micro-batch, lag) for every backward of one device, in execution order; lag = the
    STEP actions between that micro-batch's forward and its backward."""
    steps = 0
    at_forward: dict[tuple[int, int], int] = {}
    lags = []
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            at_forward[(a.chunk, a.micro_batch)] = steps
        elif a.kind is ActionKind.BACKWARD:
            lags.append((a.chunk, a.micro_batch, steps - at_forward.pop((a.chunk, a.micro_batch))))
        elif a.kind is ActionKind.STEP:
            steps += 1
    return lags


class StreamLags:
    """The lag of every micro-batch of an async-1f1b stream at one stage, however long the stream.

    Built from the stage's action list over a window of mini-batches long enough to pass the
    warm-up; past the warm-up the schedule repeats itself every mini-batch (the check below
    fails loudly if a builder ever breaks that), so micro-batch u has the lag of the micro-batch
    one or more mini-batches earlier that falls inside the window.
    """

    def __init__(self, stage: int, stages: int, micro_batches: int):
        self.micro_batches = m = micro_batches
        self.warmup = stages - stage - 1  # forwards the stage runs before its first backward
        window = (self.warmup + m - 1) // m + 3  # mini-batches: the warm-up plus two full periods
        actions = async_1f1b_actions(stage, stages, m, lambda t: t < window)
        self.table = {u: lag for _, u, lag in forward_backward_lags(actions)}
        self.steady = (self.warmup + m - 1) // m * m  # first micro-batch of the first steady mini-batch
        for u in range(self.steady, (window - 1) * m):
            if self.table[u] != self.table[u + m]:
                raise AssertionError(f"async-1f1b at stage {stage} of {stages}, micro_batches={m}: the lag of "
                                     f"micro-batch {u} differs one mini-batch later; the schedule is not periodic")

    def __call__(self, micro_batch: int) -> int:
        """Optimizer steps between ``micro_batch``'s forward and backward (its index in the stream)."""
        if micro_batch < self.steady + self.micro_batches:
            return self.table[micro_batch]
        return self.table[self.steady + (micro_batch - self.steady) % self.micro_batches]

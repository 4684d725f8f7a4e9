"""Asynchronous 1F1B (PipeDream): no flush, one optimizer step per mini-batch per stage.

Micro-batches of consecutive mini-batches stream through one continuous 1F1B
pipeline: warm-up and drain happen only at the very start and end of the
stream. With micro_batches > 1 (XPipe-style) a stage accumulates the gradients
of a mini-batch's micro-batches and steps right after the last one's backward.
"""
from __future__ import annotations

from typing import Callable, Iterator

from schedules.actions import Action, ActionKind
from schedules.builders.common import check_count
from schedules.builders.send_recv import backward_block, forward_block
from schedules.schedule import Schedule

F, B, STEP = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.STEP


def async_1f1b_actions(stage: int, stages: int, micro_batches: int,
                       has_mini_batch: Callable[[int], bool]) -> Iterator[Action]:
    """Lazily yield the actions of one stage for a stream of unknown length.

    Micro-batch g belongs to mini-batch g // micro_batches. `has_mini_batch(t)`
    is asked for t = 0, 1, 2, ... in order, each at most once, and never again
    after it returns False; the stage asks for t just before it would run the
    forward of t's first micro-batch, i.e. at most p - k - 1 micro-batches
    ahead of its oldest pending backward. Peak in-flight micro-batches at stage
    k: min(p-k, total micro-batches). Forward-to-backward weight lag (optimizer
    steps between a micro-batch's F and its B) is p-k-1 when micro_batches == 1.
    """
    check_count("stages", stages)
    check_count("micro_batches", micro_batches)
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage!r}")
    last = stages - 1
    known = -1  # mini-batches 0..known exist
    ended = False

    def exists(micro_batch: int) -> bool:
        nonlocal known, ended
        t = micro_batch // micro_batches
        while t > known and not ended:
            if has_mini_batch(known + 1):
                known += 1
            else:
                ended = True
        return t <= known

    warmup = stages - stage - 1
    forwards = backwards = 0
    while forwards < warmup and exists(forwards):
        yield from forward_block(Action(stage, F, forwards), stage, last)
        forwards += 1
    while True:
        if exists(forwards):
            yield from forward_block(Action(stage, F, forwards), stage, last)
            forwards += 1
        if backwards == forwards:
            return
        yield from backward_block(Action(stage, B, backwards), stage, last)
        backwards += 1
        if backwards % micro_batches == 0:
            yield Action(stage, STEP, backwards // micro_batches - 1)


def async_1f1b(stages: int, micro_batches: int, *, mini_batches: int = 4) -> Schedule:
    """The stream of `mini_batches` mini-batches as a finite schedule (see async_1f1b_actions)."""
    check_count("mini_batches", mini_batches)
    actions = [list(async_1f1b_actions(d, stages, micro_batches, lambda t: t < mini_batches))
               for d in range(stages)]
    return Schedule("async-1f1b", stages, micro_batches, actions, mini_batches=mini_batches)

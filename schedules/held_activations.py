"""Which micro-batches a stage keeps activations for, read off the action lists the runtime executes.

A stage holds a micro-batch's activations from its forward until its backward (until its W in
zero-bubble schedules, whose B keeps the graph for W). With activation recomputation a stage keeps
only the micro-batch's boundary inputs and re-runs the forward right before the backward, so
during that backward one micro-batch's activations are back. ``held_activations`` lists, for each
moment the held bytes can peak, how many micro-batches are held whole and how many as boundary
inputs only, and whether the weight gradients exist then: the peak is the largest
``whole * activations + boundary * inputs + gradients * parameters`` over them.
"""
from __future__ import annotations

from typing import Iterable

from schedules.actions import Action, ActionKind

RECOMPUTE = ("none", "except-last", "always")


def recomputed(actions: Iterable[Action], mode: str) -> set[tuple[int, int]]:
    """(chunk, micro-batch) pairs of one device that ``mode`` recomputes.

    "except-last" (torchgpipe's choice) keeps a micro-batch whole when the device runs no other
    forward between its forward and its backward: its backward comes next, so recomputing it would
    save nothing (GPipe: the last micro-batch; 1F1B: also every micro-batch of the last stage).
    """
    if mode not in RECOMPUTE:
        raise ValueError(f"unknown recompute mode {mode!r}; choose one of {', '.join(RECOMPUTE)}")
    if mode == "none":
        return set()
    open_: dict[tuple[int, int], bool] = {}  # in flight -> another forward ran since its own
    chosen = set()
    for a in actions:
        key = (a.chunk, a.micro_batch)
        if a.kind is ActionKind.FORWARD:
            for other in open_:
                open_[other] = True
            open_[key] = False
        elif a.kind is ActionKind.BACKWARD and key in open_:
            others_ran = open_.pop(key)
            if mode == "always" or others_ran:
                chosen.add(key)
    return chosen


def held_activations(actions: list[Action], mode: str) -> dict[int, set[tuple[int, int, int]]]:
    """Per chunk of one device: (whole, boundary-only, gradients present) at every moment its held
    bytes can peak: after a forward, and at the end of a backward (W in zero-bubble schedules), when
    the micro-batch's activations are still held and its weight gradients exist. Gradients are absent
    from a STEP (which clears them) to the next backward."""
    again = recomputed(actions, mode)
    # chunks whose backward is split (B keeps the graph for W); a chunk without W runs its backward whole
    split_chunks = {a.chunk for a in actions if a.kind is ActionKind.WEIGHT}
    whole: dict[int, int] = {}
    boundary: dict[int, int] = {}
    grads: dict[int, int] = {}
    moments: dict[int, set[tuple[int, int, int]]] = {}
    for a in actions:
        if a.kind is ActionKind.STEP:
            grads = dict.fromkeys(grads, 0)
            continue
        c, key = a.chunk, (a.chunk, a.micro_batch)
        whole.setdefault(c, 0)
        boundary.setdefault(c, 0)
        grads.setdefault(c, 0)
        at = moments.setdefault(c, set())
        if a.kind is ActionKind.FORWARD:
            if key in again:
                boundary[c] += 1
            else:
                whole[c] += 1
            at.add((whole[c], boundary[c], grads[c]))
        elif a.kind is ActionKind.BACKWARD:
            split = c in split_chunks
            if key in again:  # the recomputed forward brings its activations back for the backward
                boundary[c] -= 1
                whole[c] += 1
            if not split:
                grads[c] = 1
            at.add((whole[c], boundary[c], grads[c]))
            whole[c] -= not split
        elif a.kind is ActionKind.WEIGHT:
            grads[c] = 1
            at.add((whole[c], boundary[c], grads[c]))
            whole[c] -= 1
    return {c: at for c, at in moments.items() if at}


def in_flight(actions: list[Action]) -> dict[int, int]:
    """Per chunk of one device: the most micro-batches it holds between forward and backward (W)."""
    return {c: max(w for w, _, _ in at) for c, at in held_activations(actions, "none").items()}

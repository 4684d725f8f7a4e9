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
F, B, W, STEP = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.STEP


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
    # in flight -> forwards run up to and including its own: another ran since when the count has grown
    # (a count, not a flag per micro-batch in flight, keeps a list of m micro-batches O(m), not O(m^2))
    open_: dict[tuple[int, int], int] = {}
    forwards = 0
    chosen = set()
    for a in actions:
        key = (a.chunk, a.micro_batch)
        if a.kind is F:
            forwards += 1
            open_[key] = forwards
        elif a.kind is B and key in open_:
            others_ran = open_.pop(key) < forwards
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
    moments: dict[int, set[tuple[int, int, int]]] = {}
    # one pass per chunk with plain counters (a planner reads thousands of lists); a STEP clears the gradients
    # of every chunk
    for c in dict.fromkeys(a.chunk for a in actions if a.kind is not STEP):
        split = c in split_chunks
        whole = boundary = grads = 0
        at = moments[c] = set()
        for a in actions:
            kind = a.kind
            if kind is STEP:
                grads = 0
            elif a.chunk != c:
                continue
            elif kind is F:
                if (c, a.micro_batch) in again:
                    boundary += 1
                else:
                    whole += 1
                at.add((whole, boundary, grads))
            elif kind is B:
                # the recomputed forward brings its activations back for the backward
                if (c, a.micro_batch) in again:
                    boundary -= 1
                    whole += 1
                if not split:
                    grads = 1
                at.add((whole, boundary, grads))
                whole -= not split
            elif kind is W:
                grads = 1
                at.add((whole, boundary, grads))
                whole -= 1
    return {c: at for c, at in moments.items() if at}


def in_flight(actions: list[Action]) -> dict[int, int]:
    """Per chunk of one device: the most micro-batches it holds between forward and backward (W)."""
    return {c: max(w for w, _, _ in at) for c, at in held_activations(actions, "none").items()}

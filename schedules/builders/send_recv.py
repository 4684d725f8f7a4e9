"""Where activations and gradients travel, and the SEND/RECV actions that move them.

Device d chunk c is virtual stage v = c*stages + d. Activations go v -> v+1,
gradients v+1 -> v. Messages between an ordered pair of devices are matched
first-in first-out, so a device must post its receives from one peer in the
order that peer sends (with 2 devices one pair carries both activations and
gradients of interleaved schedules).
"""
from __future__ import annotations

from schedules.actions import Action, ActionKind

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD


def forward_block(forward: Action, v: int, last: int) -> list[Action]:
    """RECV_ACT (unless first virtual stage), `forward` (an F at virtual stage v), SEND_ACT (unless last)."""
    position, micro_batch, chunk = forward.position, forward.micro_batch, forward.chunk
    block = [Action(position, RECV_ACT, micro_batch, chunk), forward] if v > 0 else [forward]
    if v < last:
        block.append(Action(position, SEND_ACT, micro_batch, chunk))
    return block


def backward_block(backward: Action, v: int, last: int) -> list[Action]:
    """RECV_GRAD (unless last virtual stage), `backward` (a B at virtual stage v), SEND_GRAD (unless first)."""
    position, micro_batch, chunk = backward.position, backward.micro_batch, backward.chunk
    block = [Action(position, RECV_GRAD, micro_batch, chunk), backward] if v < last else [backward]
    if v > 0:
        block.append(Action(position, SEND_GRAD, micro_batch, chunk))
    return block


def attach_comms(compute: list[list[Action]], stages: int, chunks: int) -> list[list[Action]]:
    """Wrap each F and B of per-device compute lists in its RECV and SEND.

    A RECV sits directly before its consumer and a SEND directly after its
    producer. That keeps each peer's messages in FIFO order as long as every
    device consumes them in the order its peer produces them, which all the
    builders here do (validate() checks it). The compute actions themselves
    are reused, not copied.
    """
    last = stages * chunks - 1
    result = []
    for device, actions in enumerate(compute):
        out: list[Action] = []
        for a in actions:
            kind = a.kind
            if kind is F:
                out += forward_block(a, a.chunk * stages + device, last)
            elif kind is B:
                out += backward_block(a, a.chunk * stages + device, last)
            else:
                out.append(a)
        result.append(out)
    return result

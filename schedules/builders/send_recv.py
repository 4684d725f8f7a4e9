"""Where activations and gradients travel, and the SEND/RECV actions that move them.

Device d chunk c is virtual stage v (schedules.placement: c*stages + d in loop
placement). Activations go v -> v+1, gradients v+1 -> v; between two virtual
stages on one device (V placement) they are handed over in memory, without
SEND or RECV. Messages between an ordered pair of devices are matched
first-in first-out, so a device must post its receives from one peer in the
order that peer sends (with 2 devices one pair carries both activations and
gradients of interleaved schedules).
"""
from __future__ import annotations

from collections import defaultdict, deque
from functools import lru_cache
from typing import Callable

from schedules.actions import Action, ActionKind
from schedules.placement import location_of, virtual_stage_of

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


def attach_comms(compute: list[list[Action]], stages: int, chunks: int,
                 placement: str = "loop") -> list[list[Action]]:
    """Wrap each F and B of per-device compute lists in its RECV and SEND.

    A RECV sits directly before its consumer and a SEND directly after its
    producer. That keeps each peer's messages in FIFO order as long as every
    device consumes them in the order its peer produces them, which all the
    builders here do (validate() checks it). The compute actions themselves
    are reused, not copied. `placement` says which virtual stage each chunk is;
    a neighbour on the same device gets no SEND/RECV (handed over in memory).
    """
    result = []
    for device, actions in enumerate(compute):
        # per chunk: (receives from upstream, sends downstream) of its forward
        remote = [(_remote(device, c, -1, stages, chunks, placement), _remote(device, c, 1, stages, chunks, placement))
                  for c in range(chunks)]
        out: list[Action] = []
        for a in actions:
            kind = a.kind
            if kind is F or kind is B:
                upstream, downstream = remote[a.chunk]
                receives, sends = (upstream, downstream) if kind is F else (downstream, upstream)
                recv, send = (_recv_act, _send_act) if kind is F else (_recv_grad, _send_grad)
                if receives:
                    out.append(recv(device, a.micro_batch, a.chunk))
                out.append(a)
                if sends:
                    out.append(send(device, a.micro_batch, a.chunk))
            else:
                out.append(a)
        result.append(out)
    return result


def _messages(kind: ActionKind) -> Callable[[int, int, int], Action]:
    """Action(device, kind, micro_batch, chunk) from (device, micro_batch, chunk), one instance per distinct
    message (actions are immutable): a planner builds thousands of schedules that send the same messages."""
    @lru_cache(maxsize=1 << 16)
    def message(device: int, micro_batch: int, chunk: int) -> Action:
        return Action(device, kind, micro_batch, chunk)
    return message


_recv_act, _send_act, _recv_grad, _send_grad = map(_messages, (RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD))


def receives_in_send_order(lists: list[list[Action]], stages: int, placement: str = "loop") -> list[list[Action]]:
    """`lists` with each RECV moved up, where needed, so that every device posts the receives
    from one peer in the order that peer sends (FIFO matching).

    attach_comms puts a RECV right before its consumer; when a device consumes two kinds of
    message from one peer (V placement: activations of chunk 0 and gradients of chunk 1 both
    flow d -> d+1) in another order than the peer produced them, the later-consumed one is
    posted early instead, right before the first receive that comes after it in the peer's
    order. Receives only post, so this adds no wait; every RECV still precedes its consumer.
    """
    sent: dict[tuple[int, int], deque[Action]] = defaultdict(deque)  # (src, dst) -> receives in send order
    for d, actions in enumerate(lists):
        for a in actions:
            if a.kind is SEND_ACT or a.kind is SEND_GRAD:
                step = 1 if a.kind is SEND_ACT else -1
                dst, chunk = location_of(virtual_stage_of(d, a.chunk, stages, placement) + step, stages, placement)
                sent[(d, dst)].append(Action(dst, RECV_ACT if step == 1 else RECV_GRAD, a.micro_batch, chunk))
    result = []
    for d, actions in enumerate(lists):
        posted: set[Action] = set()
        out: list[Action] = []
        for a in actions:
            if a.kind is not RECV_ACT and a.kind is not RECV_GRAD:
                out.append(a)
                continue
            if a in posted:
                continue
            step = -1 if a.kind is RECV_ACT else 1
            src = location_of(virtual_stage_of(d, a.chunk, stages, placement) + step, stages, placement)[0]
            queue = sent[(src, d)]
            while queue:
                receive = queue.popleft()
                out.append(receive)
                posted.add(receive)
                if receive == a:
                    break
        result.append(out)
    return result


def _remote(device: int, chunk: int, step: int, stages: int, chunks: int, placement: str) -> bool:
    """True when virtual stage v+step (v: `chunk` of `device`) exists and is on another device."""
    other = virtual_stage_of(device, chunk, stages, placement) + step
    return 0 <= other < stages * chunks and location_of(other, stages, placement)[0] != device

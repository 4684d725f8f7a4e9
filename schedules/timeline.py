"""Run a schedule's action lists in dependency order, the way the runtime would.

One device runs its list in order; SEND and RECV are non-blocking (RECV only
posts), and an F or B that consumes a message waits until its sender ran the
matching SEND, plus the link latency. The validator uses this to find
deadlocks, the simulator to time every action.

Each device keeps a pointer into its own list and runs until it must wait for
a message that was not sent yet; the SEND of that message puts it back in the
ready queue. So every action is visited exactly once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from schedules.actions import ActionKind
from schedules.schedule import Schedule

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, SEND_GRAD = ActionKind.SEND_ACT, ActionKind.SEND_GRAD


@dataclass
class Timeline:
    """Start/end time of every action (same shape as schedule.actions).

    `busy[d]`: total compute (F, B, W) time device d ran. `blocked` lists
    (stage, action index) of devices that never finished (a deadlock);
    `waiting_for` maps such a stage to the message key it waits on:
    (is_gradient, micro_batch, receiving virtual stage).
    """

    start: list[list[float]]
    end: list[list[float]]
    busy: list[float]
    blocked: list[tuple[int, int]]
    waiting_for: dict[int, tuple[int, int, int]]


def execute(schedule: Schedule, cost: list[dict[ActionKind, float]],
            latency: list[list[float]]) -> Timeline:
    """Time every action; cost[d][kind] is the duration of a compute action on device d,
    latency[a][b] the delay of a message from device a to device b."""
    p = schedule.stages
    # message key: (is_gradient, micro_batch, receiving virtual stage)
    arrival: dict[tuple[int, int, int], float] = {}
    waiting: dict[tuple[int, int, int], int] = {}
    start: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    busy = [0.0] * p
    # what a device needs each time it resumes (often: once per micro-batch in 1F1B);
    # a device sends activations to the next device and gradients to the previous one
    devices = [(schedule.actions[d], start[d].append, end[d].append, cost[d][F], cost[d][B],
                cost[d][W], _links(schedule, d, latency)) for d in range(p)]
    ready = deque(range(p))
    while ready:
        d = ready.popleft()
        actions, add_start, add_end, forward, backward, weight, links = devices[d]
        t, work = clock[d], busy[d]
        for i in range(len(start[d]), len(actions)):
            a = actions[i]
            kind = a.kind
            if kind is F or kind is B:
                v, receives_act, receives_grad, _, _ = links[a.chunk]
                backward_pass = kind is B
                if receives_grad if backward_pass else receives_act:  # a message from another device
                    key = (int(backward_pass), a.micro_batch, v)
                    at = arrival.pop(key, None)
                    if at is None:
                        waiting[key] = d
                        break
                    if at > t:
                        t = at
                add_start(t)
                took = backward if backward_pass else forward
                t += took
                work += took
            elif kind is W:
                add_start(t)
                t += weight
                work += weight
            else:
                add_start(t)
                if kind is SEND_ACT or kind is SEND_GRAD:
                    v, _, _, to_next, to_previous = links[a.chunk]
                    if kind is SEND_ACT:
                        key = (0, a.micro_batch, v + 1)
                        arrival[key] = t + to_next
                    else:
                        key = (1, a.micro_batch, v - 1)
                        arrival[key] = t + to_previous
                    if key in waiting:
                        ready.append(waiting.pop(key))
                # RECV only posts; STEP and REDUCE take no time here
            add_end(t)
        clock[d], busy[d] = t, work
    blocked = [(d, len(start[d])) for d in range(p) if len(start[d]) < len(schedule.actions[d])]
    waiting_for = {d: key for key, d in waiting.items()}
    return Timeline(start, end, busy, blocked, waiting_for)


def _links(schedule: Schedule, d: int, latency: list[list[float]]) -> list[tuple[int, bool, bool, float, float]]:
    """Per chunk of device d: (virtual stage, its F receives a message, its B receives a message,
    latency to the next virtual stage's device, latency to the previous one's)."""
    links = []
    for chunk in range(schedule.chunks):
        after, before = (schedule.remote_neighbour(d, chunk, step) for step in (1, -1))
        links.append((schedule.virtual_stage(d, chunk), before is not None, after is not None,
                      latency[d][after] if after is not None else 0.0,
                      latency[d][before] if before is not None else 0.0))
    return links

"""Run a schedule's action lists in dependency order, the way the runtime would.

One device runs its list in order; SEND and RECV are non-blocking (RECV only
posts), and an F or B that consumes a message waits until its sender ran the
matching SEND, plus the link latency. The validator uses this to find
deadlocks, the simulator to time every action.
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

    `blocked` lists (stage, action index) of devices that never finished
    (a deadlock); `waiting_for` maps such a stage to the message key it waits
    on: (is_gradient, micro_batch, receiving virtual stage).
    """

    start: list[list[float]]
    end: list[list[float]]
    blocked: list[tuple[int, int]]
    waiting_for: dict[int, tuple[int, int, int]]


def execute(schedule: Schedule, cost: list[dict[ActionKind, float]],
            latency: list[list[float]]) -> Timeline:
    """Time every action; cost[d][kind] is the duration of a compute action on device d,
    latency[a][b] the delay of a message from device a to device b."""
    p = schedule.stages
    last = schedule.virtual_stages - 1
    # message key: (is_gradient, micro_batch, receiving virtual stage)
    arrival: dict[tuple[int, int, int], float] = {}
    waiting: dict[tuple[int, int, int], int] = {}
    start: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    ready = deque(range(p))
    while ready:
        d = ready.popleft()
        actions = schedule.actions[d]
        add_start, add_end = start[d].append, end[d].append
        t, costs, delay = clock[d], cost[d], latency[d]
        for i in range(len(start[d]), len(actions)):
            a = actions[i]
            kind = a.kind
            if kind is F or kind is B:
                v = a.chunk * p + d
                key = (0, a.micro_batch, v) if kind is F and v > 0 else (
                    (1, a.micro_batch, v) if kind is B and v < last else None)
                if key is not None:
                    at = arrival.get(key)
                    if at is None:
                        waiting[key] = d
                        break
                    if at > t:
                        t = at
                add_start(t)
                t += costs[kind]
            elif kind is W:
                add_start(t)
                t += costs[kind]
            else:
                add_start(t)
                if kind is SEND_ACT or kind is SEND_GRAD:
                    dest = a.chunk * p + d + (1 if kind is SEND_ACT else -1)
                    key = (0 if kind is SEND_ACT else 1, a.micro_batch, dest)
                    arrival[key] = t + delay[dest % p]
                    if key in waiting:
                        ready.append(waiting.pop(key))
            add_end(t)
        clock[d] = t
    blocked = [(d, len(start[d])) for d in range(p) if len(start[d]) < len(schedule.actions[d])]
    waiting_for = {d: key for key, d in waiting.items()}
    return Timeline(start, end, blocked, waiting_for)

"""Run copies of a schedule on nodes whose devices share a few processors (processor sharing).

`execute` (schedules.timeline) gives every device its own processor. When more
processes than cores run on a node (CPU ranks on a small host) that is wrong in
two ways this event simulation models:

* processor sharing: while k compute actions (F, B, W) run on a node with c
  cores, each advances at min(1, c / k) of its own speed; a device that waits for
  a message runs nothing, so the others get its share;
* wake-up latency: a device that sleeps waiting for a message is not running
  when the message arrives; if at that moment at least c other compute actions (or message work)
  run on its node, it starts only `wakeup` seconds later (it waits for a core);
* message CPU: posting a send and taking a received message cost the process CPU
  (gloo's TCP transport copies on the caller's thread, the loopback stack burns
  kernel time), so a SEND with send_cpu > 0 is work on the sender's core and the
  message leaves when it is done; the F or B that takes a message first runs
  recv_cpu of work on the receiver's core. Both share the cores like compute;
* reduction CPU: the data-parallel gradient reduction's own work (packing the bucket,
  the sums, gloo's copies) is CPU of the rank too, so a REDUCE with reduce_cpu > 0 runs
  that much work on the device's core, shared like compute (what the ring transfer costs
  beyond it is the caller's to add: it is not the device's work).

Every copy (replica) of the schedule has its own messages; replica r's device d
runs on node placement[r][d]. RECV and STEP take no time, as in `execute`
(and SEND unless send_cpu is given, REDUCE unless reduce_cpu is); with enough cores, wakeup = 0 and no message CPU
both give the same timeline. Busy time counts compute (F, B, W) only.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from schedules.actions import ActionKind
from schedules.timeline import Timeline
from schedules.costs import Costs
from schedules.gc_pause import gc_paused
from schedules.schedule import Schedule
from schedules.simulate import SimResult, compute_per_device, is_split, result_of_timeline
from schedules.validate import check_structure

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, SEND_GRAD = ActionKind.SEND_ACT, ActionKind.SEND_GRAD
REDUCE = ActionKind.REDUCE
_EPS = 1e-12  # relative: work left below this share of an action counts as done


def execute_shared(schedule: Schedule, cost: list[dict[ActionKind, float]], latency: list[list[float]],
                   placement: Sequence[Sequence[int]], cores: float, wakeup: float = 0.0,
                   send_cpu: Sequence[dict[ActionKind, float]] | None = None,
                   recv_cpu: Sequence[dict[ActionKind, float]] | None = None,
                   reduce_cpu: Sequence[float] | None = None) -> list[Timeline]:
    """One Timeline per replica; cost/latency as for schedules.timeline.execute, placement[r][d]
    the node of replica r's device d, `cores` processors per node (> 0), `wakeup` seconds.
    send_cpu[d]: seconds of device d's CPU per SEND_ACT / SEND_GRAD; recv_cpu[d]: seconds of its
    CPU to take the message an F / B needs (missing kinds and None: free); reduce_cpu[d]: seconds
    of its CPU per REDUCE (None: free)."""
    if not cores > 0:
        raise ValueError(f"execute_shared needs cores > 0 processors per node, got {cores!r}")
    if not wakeup >= 0:
        raise ValueError(f"execute_shared needs wakeup >= 0 seconds, got {wakeup!r}")
    p = schedule.stages
    if any(len(row) != p for row in placement):
        raise ValueError(f"placement needs one node per device ({p}) for every replica")
    for name, table in (("send_cpu", send_cpu), ("recv_cpu", recv_cpu)):
        if table is not None and (len(table) != p or any(not v >= 0 for row in table for v in row.values())):
            raise ValueError(f"execute_shared needs {name} as one dict of seconds >= 0 per device ({p})")
    if reduce_cpu is not None and (len(reduce_cpu) != p or any(not v >= 0 for v in reduce_cpu)):
        raise ValueError(f"execute_shared needs reduce_cpu as seconds >= 0 per device ({p})")
    none: list[dict[ActionKind, float]] = [{} for _ in range(p)]
    sim = _Shared(schedule, cost, latency, [list(row) for row in placement], cores, wakeup,
                  send_cpu or none, recv_cpu or none, list(reduce_cpu or [0.0] * p))
    return sim.run()


class _Shared:
    """State of the event simulation; units are (replica, device) pairs numbered r * p + d."""

    def __init__(self, schedule, cost, latency, placement, cores, wakeup, send_cpu, recv_cpu, reduce_cpu):
        self.schedule, self.cost, self.latency = schedule, cost, latency
        self.send_cpu, self.recv_cpu, self.reduce_cpu = send_cpu, recv_cpu, reduce_cpu
        self.p, self.cores, self.wakeup = schedule.stages, cores, wakeup
        units = len(placement) * self.p
        self.node = [placement[u // self.p][u % self.p] for u in range(units)]
        self.start: list[list[float]] = [[] for _ in range(units)]
        self.end: list[list[float]] = [[] for _ in range(units)]
        self.busy = [0.0] * units
        self.arrival: list[dict] = [{} for _ in placement]   # per replica: message key -> time
        self.waiting: list[dict] = [{} for _ in placement]   # per replica: message key -> unit
        self.running: dict[int, list[float]] = {}            # unit -> [work left, duration]
        self.taking = [False] * units                        # unit runs recv_cpu for its next F/B
        self.taken = [-1] * units                            # index of the last action whose message was taken
        self.outbox: dict[int, tuple] = {}                   # unit -> (replica, key, to) of its SEND in progress
        self.timers: list[tuple[float, int, bool]] = []      # (time, unit, wake-up already paid)

    def run(self) -> list[Timeline]:
        t = 0.0
        ready = list(range(len(self.node)))
        while True:
            # settle instant t: units that can go on do so first (a sender keeps its core), then
            # messages due now wake their receivers, which may find the node's cores busy
            while ready or (self.timers and self.timers[0][0] <= t):
                for u in ready:
                    self._advance(u, t)
                ready = []
                while self.timers and self.timers[0][0] <= t:
                    _, u, paid = heapq.heappop(self.timers)
                    if not paid and self.wakeup > 0 and self._load(self.node[u]) >= self.cores:
                        heapq.heappush(self.timers, (t + self.wakeup, u, True))  # waits for a core
                    else:
                        ready.append(u)
            rate = self._rates()
            t_next = min((t + left / rate[self.node[u]] for u, (left, _) in self.running.items()),
                         default=float("inf"))
            if self.timers and self.timers[0][0] < t_next:
                t_next = self.timers[0][0]
            if t_next == float("inf"):
                break
            for u, job in list(self.running.items()):
                job[0] -= (t_next - t) * rate[self.node[u]]
                if job[0] <= _EPS * job[1]:
                    del self.running[u]
                    if self.taking[u]:  # message taken: its F/B starts when _advance runs again
                        self.taking[u] = False
                    else:
                        self.end[u].append(t_next)
                        if u in self.outbox:
                            self._post(*self.outbox.pop(u), t_next, u)
                    ready.append(u)
            t = t_next
        return self._timelines()

    def _rates(self) -> dict[int, float]:
        counts: dict[int, int] = {}
        for u in self.running:
            counts[self.node[u]] = counts.get(self.node[u], 0) + 1
        return {n: min(1.0, self.cores / k) for n, k in counts.items()}

    def _load(self, node: int) -> int:
        return sum(1 for u in self.running if self.node[u] == node)

    def _advance(self, u: int, t: float) -> None:
        """Run unit u's zero-time actions from time t until it starts compute, waits, or ends."""
        r, d = divmod(u, self.p)
        actions = self.schedule.actions[d]
        while len(self.start[u]) < len(actions):
            a = actions[len(self.start[u])]
            kind = a.kind
            if kind is F or kind is B or kind is W:
                needs = kind is not W and self.schedule.remote_neighbour(d, a.chunk, -1 if kind is F else 1) is not None
                if needs:
                    v = self.schedule.virtual_stage(d, a.chunk)
                    key = (int(kind is B), a.micro_batch, v)
                    at = self.arrival[r].get(key)
                    if at is None:
                        self.waiting[r][key] = u
                        return
                    if at > t:  # sleeps in the receive until the message arrives
                        heapq.heappush(self.timers, (at, u, False))
                        return
                    taking = self.recv_cpu[d].get(kind, 0.0)
                    if taking > 0 and self.taken[u] != len(self.start[u]):
                        self.taken[u] = len(self.start[u])  # reading it costs the receiver CPU first
                        self.taking[u] = True
                        self.running[u] = [taking, taking]
                        return
                    del self.arrival[r][key]
                duration = self.cost[d][kind]
                self.start[u].append(t)
                self.busy[u] += duration
                if duration > 0:
                    self.running[u] = [duration, duration]
                    return
                self.end[u].append(t)
                continue
            self.start[u].append(t)
            if kind is REDUCE and self.reduce_cpu[d] > 0:  # the reducer's work on the device's core
                self.running[u] = [self.reduce_cpu[d], self.reduce_cpu[d]]
                return
            if kind is SEND_ACT or kind is SEND_GRAD:
                step = 1 if kind is SEND_ACT else -1
                to = self.schedule.remote_neighbour(d, a.chunk, step)
                key = (int(kind is SEND_GRAD), a.micro_batch, self.schedule.virtual_stage(d, a.chunk) + step)
                sending = self.send_cpu[d].get(kind, 0.0)
                if sending > 0:  # the message leaves once the sender's CPU work is done
                    self.outbox[u] = (r, key, to)
                    self.running[u] = [sending, sending]
                    return
                self._post(r, key, to, t, u)
            self.end[u].append(t)

    def _post(self, r: int, key: tuple, to: int, t: float, u: int) -> None:
        """Message `key` of replica r leaves unit u at t for device `to`; wake its waiting receiver."""
        self.arrival[r][key] = t + self.latency[u % self.p][to % self.p]
        waiter = self.waiting[r].pop(key, None)
        if waiter is not None:
            heapq.heappush(self.timers, (self.arrival[r][key], waiter, False))

    def _timelines(self) -> list[Timeline]:
        out = []
        for r in range(len(self.arrival)):
            units = range(r * self.p, (r + 1) * self.p)
            blocked = [(u - r * self.p, len(self.start[u])) for u in units
                       if len(self.start[u]) < len(self.schedule.actions[u - r * self.p])]
            waiting_for = {u - r * self.p: key for key, u in self.waiting[r].items()}
            out.append(Timeline([self.start[u] for u in units], [self.end[u] for u in units],
                                [self.busy[u] for u in units], blocked, waiting_for))
        return out


@gc_paused()
def simulate_shared(schedule: Schedule, costs: Costs, placement: Sequence[Sequence[int]], cores: float,
                    wakeup: float = 0.0, send_cpu: Sequence[dict[ActionKind, float]] | None = None,
                    recv_cpu: Sequence[dict[ActionKind, float]] | None = None,
                    reduce_cpu: Sequence[float] | None = None) -> list[SimResult]:
    """Simulate one copy of `schedule` per row of `placement` (replica r's device d on node
    placement[r][d]) where each node's devices share `cores` processors and a message to a
    sleeping device waits `wakeup` seconds when the node's cores are busy (schedules.cluster.shared_cores).
    send_cpu[d] / recv_cpu[d]: CPU seconds device d spends per SEND_ACT / SEND_GRAD and to take the
    message of an F / B, sharing the cores like compute; reduce_cpu[d]: CPU seconds of each REDUCE. One SimResult per replica; with cores >=
    devices per node, wakeup 0 and no message CPU each equals simulate()."""
    check_structure(schedule)
    split = is_split(schedule)
    timelines = execute_shared(schedule, compute_per_device(schedule, costs, split),
                               costs.latency(schedule.stages, wraps=schedule.chunks > 1 and schedule.placement == "loop"), placement, cores, wakeup,
                               send_cpu, recv_cpu, reduce_cpu)
    return [result_of_timeline(schedule, costs, timeline, split) for timeline in timelines]

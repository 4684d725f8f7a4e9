"""`simulate_cluster_step`: one training step of `replicas` copies of a pipeline on a cluster.

Each replica runs the pipeline schedule (simulated by `simulate`, messages
between stages paying the cluster link they cross); then every stage reduces
its gradients with the same stage of the other replicas (schedules.cluster.reductions).
A stage's gradients are final during its last backward: with overlap, tensor i
is ready at that backward's start + ready_fraction[i] x its duration. Ranks
follow the runtime's layout: replica r's stage k is rank r * stages + k, so a
pipeline sits on consecutive ranks and mostly inside a node.

The runtime's own costs (cluster.overheads) are added explicitly: `action` seconds
to every F and B, and after the last stage finishes (its optimizer update,
StageWork.update, included) the fixed `step` seconds plus the all_reduce of
`report_bytes` that every rank sums to agree on the loss (schedules.cluster.reductions.report_time).

When the cluster's devices share processors (cluster.cores), every replica's
pipeline is simulated at once (simulate_shared): compute actions of all ranks on
a node share its cores, and messages to sleeping ranks pay cluster.wakeup while
those cores are busy; each message costs the sender cluster.message_cpu(bytes)[0] of
CPU and the receiver, when its F or B takes it, [1] (the same bytes come back as
gradients), and module compute (forward, backward) takes cluster.interference times
its profiled time (co-running ranks slow each other beyond sharing the cores). With
replicas, the gradient reduction's runtime work (overheads.reduce_call + bytes x
reduce_byte per bucket, measured as the reducer's CPU) is work of the stage's rank
on its node's cores too (a REDUCE after the last backward, simulate_shared's
reduce_cpu), slowing whatever else runs there; the ring transfer time follows it.
Every rank then runs its optimizer update and the step's
fixed work at about the same time, so those are slowed by the node's fair share,
max(1, ranks on the node / cores).

Scaling efficiency compares with one device of the same speed running the
whole model on the same samples (all micro-batches of all replicas), with no
communication: efficiency = single-device time / (devices x step time).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Sequence

from schedules.actions import ActionKind
from schedules.builders import build, with_reductions
from schedules.cluster.spec import Cluster
from schedules.cluster.reductions import (Group, Reduction, allreduce_time, bucket_overhead, buckets, reduction_finish,
                                       report_time)
from schedules.costs import Costs
from schedules.cluster.overheads import contention
from schedules.cluster.shared_cores import simulate_shared
from schedules.schedule import Schedule
from schedules.simulate import SimResult, memory_and_lags, simulate

CLUSTER_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
GRADIENT_KINDS = (ActionKind.BACKWARD, ActionKind.WEIGHT)


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage as measured on the profiled device, per micro-batch.

    grad_bytes: bytes of each gradient tensor in the order the backward finishes them;
    ready_fraction[i]: share of the stage's backward done when tensor i is final (default:
    proportional to cumulative bytes). send_bytes: activation bytes sent to the next stage
    (gradients of the same size come back). memory: parameter-related bytes the stage keeps
    (weights, gradients, optimizer state); activation_memory: bytes held per in-flight
    micro-batch. weight_fraction: share of the backward that is weight-gradient work, which
    zb-h1 runs later as W (0: the stage's backward cannot be split, as pipetrain's first
    stage, whose inputs carry no gradient).
    """

    forward: float
    backward: float
    grad_bytes: tuple[float, ...] = ()
    ready_fraction: tuple[float, ...] | None = None
    send_bytes: float = 0.0
    memory: float = 0.0
    activation_memory: float = 0.0
    update: float = 0.0
    weight_fraction: float = 0.5

    def ready(self) -> list[float]:
        """ready_fraction, or the cumulative-bytes default."""
        if self.ready_fraction is not None:
            if len(self.ready_fraction) != len(self.grad_bytes):
                raise ValueError(f"StageWork has {len(self.grad_bytes)} grad tensors but "
                                 f"{len(self.ready_fraction)} ready fractions; give one each")
            return list(self.ready_fraction)
        total = sum(self.grad_bytes) or 1.0
        out, acc = [], 0.0
        for b in self.grad_bytes:
            acc += b
            out.append(acc / total)
        return out


@dataclass
class ClusterStepResult:
    """Predicted step of a hybrid (pipeline x data-parallel) layout."""

    stages: int
    replicas: int
    micro_batches: int
    schedule: str
    cluster: Cluster
    step_time: float            # seconds per mini-batch (pipeline + exposed reduction)
    pipeline_time: float        # makespan of the pipeline schedule alone
    reduction_exposed: list[float]  # per stage: reduction time not hidden behind compute
    single_device_time: float   # one device, all samples of the step, no communication
    step_overhead: float        # fixed runtime cost per step: overheads.step + the report (report_time)
    memory: list[float]         # predicted bytes per device of each stage
    sim: SimResult = field(repr=False)

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    @property
    def scaling_efficiency(self) -> float:
        """Single-device time / (devices x step time): 1.0 is perfect scaling."""
        return self.single_device_time / (self.devices * self.step_time) if self.step_time else 0.0

    def throughput(self, samples_per_step: int) -> float:
        """Samples per second for a global mini-batch of samples_per_step."""
        return samples_per_step / self.step_time


def _check(stages: int, replicas: int, micro_batches: int, kind: str, cluster: Cluster) -> None:
    for name, value in (("replicas", replicas), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if stages < 1:
        raise ValueError("simulate_cluster_step needs at least one StageWork")
    if kind not in CLUSTER_SCHEDULES:
        raise ValueError(f"simulate_cluster_step supports schedules {CLUSTER_SCHEDULES}, not {kind!r}; "
                         "fix: choose one of those (one flush per mini-batch)")
    if stages * replicas > cluster.devices:
        raise ValueError(f"{stages} stages x {replicas} replicas = {stages * replicas} devices but "
                         f"cluster {cluster.name!r} has {cluster.devices}; fix: fewer stages or replicas")


@lru_cache(maxsize=1024)
def built_schedule(kind: str, stages: int, micro_batches: int) -> Schedule:
    """build()'s action lists, built once: a planner simulates thousands of layouts on a few hundred
    schedules. Shared between callers: do not modify it."""
    return build(kind, stages, micro_batches)


@lru_cache(maxsize=1024)
def _step_plan(kind: str, stages: int, micro_batches: int,
               reduce_on_cores: bool) -> tuple[Schedule, tuple[int, ...], tuple[list[int], list[list]]]:
    """The schedule a step simulates (built_schedule, with REDUCE actions where the reduction's CPU is
    simulated), the index of each stage's last backward and its memory_and_lags: a planner simulates each
    a few times, under other costs. Shared between callers: do not modify them."""
    plan = built_schedule(kind, stages, micro_batches)
    if reduce_on_cores:
        plan = with_reductions(plan)
    # gradients are final during the last backward (after the last W with zb-h1)
    last = tuple(max(i for i, a in enumerate(actions) if a.kind in GRADIENT_KINDS) for actions in plan.actions)
    return plan, last, memory_and_lags(plan)


def action_costs(work: Sequence[StageWork], cluster: Cluster, split: bool = False) -> Costs:
    """Seconds of each stage's F, B (and, split, W) on the cluster's devices, runtime overhead included,
    and of each message between neighbouring stages over the link it crosses (stage k is rank k)."""
    extra = cluster.overheads
    comm = []
    for k in range(len(work) - 1):
        bandwidth, latency = cluster.link(k, k + 1)
        comm.append(latency + work[k].send_bytes / bandwidth)
    slow = cluster.interference / cluster.speed  # interference is 1 unless cores are shared
    w_share = [w.weight_fraction if split else 0.0 for w in work]
    return Costs(forward=[w.forward * slow + extra.action for w in work],
                 backward=[w.backward * (1 - f) * slow + extra.action for w, f in zip(work, w_share)],
                 weight=[w.backward * f * slow + (extra.action if split else 0.0) for w, f in zip(work, w_share)],
                 comm=comm)


def simulate_cluster_step(work: Sequence[StageWork], cluster: Cluster, *, replicas: int = 1,
                    micro_batches: int = 1, schedule: str = "1f1b",
                    reduction: Reduction = Reduction()) -> ClusterStepResult:
    """Predict one training step: the pipeline schedule of every replica, then each stage's
    gradient all-reduce across replicas (overlapped with the last backward if asked)."""
    p = len(work)
    _check(p, replicas, micro_batches, schedule, cluster)
    speed = cluster.speed
    extra = cluster.overheads
    split = schedule == "zb-h1"  # B: the input-gradient part; W: the weight-gradient part
    costs = action_costs(work, cluster, split)
    # with shared cores the reduction's CPU is simulated as a REDUCE action of each stage
    reduce_on_cores = cluster.cores is not None and replicas > 1
    plan, last_gradient, held = _step_plan(schedule, p, micro_batches, reduce_on_cores)
    if cluster.cores is None:
        # replicas are identical: one pipeline stands for all
        sims = [simulate(plan, costs, validate=False, held=held)]
        tail = 1.0
    else:
        placement = [[cluster.node_of(r * p + k) for k in range(p)] for r in range(replicas)]
        msg = [cluster.message_cpu(w.send_bytes) for w in work]  # link k -> k + 1, both directions
        send_cpu = [{ActionKind.SEND_ACT: msg[k][0], ActionKind.SEND_GRAD: msg[k - 1][0] if k else 0.0}
                    for k in range(p)]
        recv_cpu = [{ActionKind.FORWARD: msg[k - 1][1] if k else 0.0, ActionKind.BACKWARD: msg[k][1]}
                    for k in range(p)]
        reduce_cpu = [sum(bucket_overhead(sum(w.grad_bytes[i] for i in members), cluster)
                          for members in buckets(w.grad_bytes, reduction.bucket_bytes)) if reduce_on_cores else 0.0
                      for w in work]
        sims = simulate_shared(plan, costs, placement, cluster.cores, cluster.wakeup, send_cpu, recv_cpu,
                               reduce_cpu)
        per_node = Counter(node for row in placement for node in row)
        tail = max(contention(n, cluster.cores) for n in per_node.values())
    sim = max(sims, key=lambda s: s.makespan)
    exposed, ends = [], []
    for k, w in enumerate(work):
        last_b = last_gradient[k]
        # the reduction waits for the replica whose last backward ends last
        latest = max(sims, key=lambda s: s.end[k][last_b])
        b_start, b_end = latest.start[k][last_b], latest.end[k][last_b]
        # zb-h1 sets weight gradients outside autograd's accumulation, so the runtime reduces after the last W
        ready = [b_end] * len(w.grad_bytes) if split else [b_start + f * (b_end - b_start) for f in w.ready()]
        group = Group.of_ranks([r * p + k for r in range(replicas)], cluster)
        stage_end = max(s.end[k][-1] for s in sims) if plan.actions[k] else 0.0
        if reduce_on_cores:  # the REDUCE's CPU is in stage_end; the buckets' ring transfers follow it
            finish = stage_end + sum(allreduce_time(sum(w.grad_bytes[i] for i in members), group, cluster,
                                                    reduction.hierarchical)
                                     for members in buckets(w.grad_bytes, reduction.bucket_bytes))
            exposed.append(finish - max(s.end[k][last_b] for s in sims))
        else:
            finish = reduction_finish(list(w.grad_bytes), ready, group, cluster, reduction)
            exposed.append(max(0.0, finish - stage_end))
        ends.append(max(stage_end, finish) + tail * w.update / speed)
    fixed = tail * extra.step
    if extra.report_bytes > 0:  # every rank of the job takes part, after the slowest stage is done
        fixed += report_time(extra.report_bytes, p * replicas, cluster)
    single = (replicas * micro_batches * sum(w.forward + w.backward for w in work)
              + sum(w.update for w in work)) / speed
    memory = [w.memory + peak * w.activation_memory for w, peak in zip(work, sim.peak_in_flight)]
    return ClusterStepResult(stages=p, replicas=replicas, micro_batches=micro_batches, schedule=schedule,
                        cluster=cluster, step_time=max(ends) + fixed, pipeline_time=sim.makespan,
                        reduction_exposed=exposed, single_device_time=single, step_overhead=fixed,
                        memory=memory, sim=sim)

"""The samples/s a compared method would reach on a named cluster, predicted from what its run measured.

The local engine runs every stage in one process, one after another, so its samples/s measure the
runtime's own work, not pipeline speed (a 4-stage pipeline looks 4x slower than one process). What
such a run does measure is each stage's compute: the runner times every F and B (the busy time of
StepResult), and counts the activation bytes each stage sends. From those the cost model
(schedules.cluster) predicts the method on `devices` devices of the measuring machine's speed:
data parallelism as `devices` replicas, each computing its share of the mini-batch, then its gradient
all-reduce as the runtime does it by default (fused buckets, overlapped with the backward); a
pipeline of `devices` stages, sync 1F1B with its bubble, async 1F1B in steady state (no flush).

Assumptions:
- forward : backward = 1 : BACKWARD_RATIO, since the runner times them together;
- a data-parallel replica's shard costs its share of the time measured on the whole mini-batch
  (compute linear in the samples: small batches are less efficient, so this favours data parallelism);
- the staleness policies' weight copies and predictions run inside F and B, so their cost is in the
  busy time; the optimizer update is not timed per stage and is left out for every method;
- messages and the runtime's overheads cost what the cluster says: by default `local_cluster`,
  whose links and per-action overheads were measured for the distributed engine on the development
  machine.
Each run is predicted from its own measurements, so on a machine shared with other jobs two methods
with the same compute can differ by the load each met.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from pipetrain import PipelineOptions
from pipetrain.apps.run_summary import RunSummary
from schedules import PRESETS, Cluster, Reduction, StageWork, simulate_cluster_step, stream_step_time

BACKWARD_RATIO = 2.0  # the usual estimate (schedules.Costs.from_plan's default): a backward costs two forwards


def local_cluster(devices: int) -> Cluster:
    """`devices` devices as fast as this machine, each with its own core, on gloo-local4's links.

    The gloo-local4 preset is 4 CPU processes sharing 2 cores, fitted on the development machine
    (README, "Cost-model calibration"); this keeps its loopback bandwidth and the distributed
    engine's overheads and drops the core sharing, so no stage waits for another's processor."""
    base = PRESETS["gloo-local4"]
    return dataclasses.replace(base, nodes=1, devices_per_node=devices, cores=None, wakeup=0.0, send_cpu=0.0,
                               send_cpu_byte=0.0, recv_cpu=0.0, recv_cpu_byte=0.0, interference=1.0,
                               name=f"{devices} of this machine's cores, one per rank, gloo-local4 links")


def runtime_reduction() -> Reduction:
    """The gradient all-reduce the runtime does by default (PipelineOptions: bucket_mb, allreduce="hybrid",
    overlap)."""
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineOptions)}
    return Reduction(bucket_bytes=defaults["bucket_mb"] * 1e6, hierarchical=None, overlap=defaults["overlap"])


def stage_seconds(summary: RunSummary) -> list[float]:
    """Each stage's compute seconds in a typical step of the run: the median over its steps, robust to the
    moments other jobs took the processor (empty for a run without steps)."""
    return [statistics.median(per_step) for per_step in zip(*summary.step_busy_seconds)]


def predicted_samples_per_second(summary: RunSummary, cluster: Cluster, devices: int) -> float:
    """Samples/s of the run's method on `devices` devices of `cluster`, from the run's measured per-stage
    compute (stage_seconds) and bytes; NaN for a run that measured nothing, e.g. one that diverged at once.

    A one-stage run is data parallelism over `devices` replicas; a pipeline must have `devices` stages."""
    c = summary.config
    busy = stage_seconds(summary)
    if not summary.steps or not busy:
        return math.nan
    stages = len(busy)
    if stages == 1:
        replicas = devices
    elif stages == devices:
        replicas = 1
    else:
        raise ValueError(f"a {stages}-stage run cannot be predicted on {devices} devices: the run records no "
                         "per-stage gradient bytes for pipeline replicas; fix: predict on as many devices as stages")
    # The run's replicas (data_parallel under torchrun) each computed their share of the samples.
    per_step = summary.samples / summary.steps / c.data_parallel
    micro = c.batch_size / (replicas * c.micro_batches)  # samples per micro-batch on the cluster
    forward_share = 1.0 / (1.0 + BACKWARD_RATIO)
    sent = summary.stage_activation_bytes or [0.0] * stages
    work = []
    for seconds, nbytes in zip(busy, sent):
        compute = seconds / per_step * micro
        work.append(StageWork(forward=compute * forward_share, backward=compute * (1 - forward_share),
                              send_bytes=nbytes / (per_step * summary.steps) * micro,
                              grad_bytes=tuple(summary.gradient_bytes) if replicas > 1 else ()))
    if c.schedule == "async-1f1b":
        step = stream_step_time(work, cluster, micro_batches=c.micro_batches)
    else:
        step = simulate_cluster_step(work, cluster, replicas=replicas, micro_batches=c.micro_batches,
                                     schedule=c.schedule, reduction=runtime_reduction()).step_time
    return c.batch_size / step

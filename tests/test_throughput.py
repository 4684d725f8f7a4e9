"""pipetrain.apps.throughput: predicted samples/s from a run's measured per-stage costs, against hand
computation on a cluster whose numbers make it easy."""
from __future__ import annotations

import math

import pytest

from pipetrain.apps.throughput import local_cluster, predicted_samples_per_second
from pipetrain.apps.training import RunConfig, RunSummary
from schedules import PRESETS, Cluster
from schedules.cluster.reductions import ring_allreduce_time

BANDWIDTH = 1e9
CLUSTER = Cluster(nodes=1, devices_per_node=4, intra_bandwidth=BANDWIDTH, intra_latency=0.0,
                  inter_bandwidth=BANDWIDTH, inter_latency=0.0, name="four")
BATCH, M, STEPS = 64, 8, 10
T = 0.003  # seconds of forward + backward of one micro-batch at each of the 4 stages


def summary(stages: int, schedule: str = "1f1b", busy: float = T * M * STEPS, data_parallel: int = 1,
            micro_batches: int = M) -> RunSummary:
    """A run that measured ``busy`` compute seconds at each stage over STEPS mini-batches of BATCH samples
    and sent no activation bytes (so messages are free)."""
    config = RunConfig(model="vgg", dataset="digits", stages=stages, micro_batches=micro_batches,
                       batch_size=BATCH, schedule=schedule, staleness="stash" if schedule == "async-1f1b" else "none",
                       data_parallel=data_parallel)
    # One step taken by another job (10x slower) is left out by the median.
    steps = [[busy / STEPS] * stages for _ in range(STEPS - 1)] + [[10 * busy / STEPS] * stages]
    return RunSummary(config, steps=STEPS, samples=BATCH * STEPS, step_busy_seconds=steps,
                      stage_activation_bytes=[0.0] * stages, gradient_bytes=[4_000_000, 4_000_000])


def test_sync_1f1b_pays_its_bubble():
    # (m + p - 1) slots of one micro-batch's forward + backward per mini-batch
    predicted = predicted_samples_per_second(summary(4), CLUSTER, devices=4)
    assert predicted == pytest.approx(BATCH / ((M + 4 - 1) * T))


def test_async_1f1b_streams_without_a_flush():
    predicted = predicted_samples_per_second(summary(4, "async-1f1b"), CLUSTER, devices=4)
    assert predicted == pytest.approx(BATCH / (M * T))


def test_data_parallel_is_a_quarter_of_the_compute_each_plus_the_gradient_all_reduce():
    # The one-stage run measured the whole model: 4 T per micro-batch of BATCH / M samples. On 4 replicas
    # each computes BATCH / 4 samples, then the 8 MB of gradients (one bucket) go round a ring of 4.
    whole = 4 * T * M * STEPS
    compute = whole / (BATCH * STEPS) * BATCH / 4
    ring = ring_allreduce_time(8e6, 4, BANDWIDTH, 0.0)
    assert ring > 0.1 * compute  # the all-reduce is priced, not free
    predicted = predicted_samples_per_second(summary(1, busy=whole, micro_batches=1), CLUSTER, devices=4)
    assert predicted == pytest.approx(BATCH / (compute + ring))


def test_a_run_under_torchrun_counts_the_samples_of_one_replica():
    local = summary(1, busy=1.0, micro_batches=1)
    replicated = summary(1, busy=0.5, data_parallel=2, micro_batches=1)  # each replica computed half the samples
    assert predicted_samples_per_second(replicated, CLUSTER, 4) == pytest.approx(
        predicted_samples_per_second(local, CLUSTER, 4))


def test_a_run_that_measured_nothing_predicts_nan_and_a_mismatched_pipeline_is_an_error():
    diverged = RunSummary(RunConfig(model="vgg", dataset="digits", batch_size=BATCH), diverged="NaN loss")
    assert math.isnan(predicted_samples_per_second(diverged, CLUSTER, 4))
    with pytest.raises(ValueError, match="predict on as many devices as stages"):
        predicted_samples_per_second(summary(2), CLUSTER, devices=4)


def test_local_cluster_gives_every_rank_its_own_core_on_gloo_local4_links():
    preset = PRESETS["gloo-local4"]
    cluster = local_cluster(4)
    assert cluster.devices == 4 and cluster.cores is None and cluster.interference == 1.0
    assert (cluster.intra_bandwidth, cluster.overheads, cluster.speed) == (preset.intra_bandwidth,
                                                                             preset.overheads, 1.0)
    assert cluster.name == "4 of this machine's cores, one per rank, gloo-local4 links"

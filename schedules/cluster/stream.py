"""`stream_step_time`: seconds per mini-batch of an async-1f1b stream (PipeDream, no flush) on a cluster.

A stream never flushes: after its warm-up every stage alternates forwards and backwards of
consecutive mini-batches, so what sets its throughput is the slope of the makespan in the number
of mini-batches. It is measured between two simulated stream lengths, where warm-up and drain
cancel. F, B and the messages cost what simulate_cluster_step charges (action_costs). Each stage
applies its update (StageWork.update) once every `micro_batches` backwards; it is spread over
those backwards, which gives the same period for the stage that bounds the stream. The runtime's
fixed work per step and its report are not charged: a stream builds its executors once and posts
each mini-batch's report without waiting for it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from schedules.builders import build
from schedules.cluster.spec import Cluster
from schedules.cluster.step import StageWork, action_costs
from schedules.simulate import simulate


def stream_step_time(work: Sequence[StageWork], cluster: Cluster, *, micro_batches: int = 1,
                     mini_batches: int = 8) -> float:
    """Seconds per mini-batch of one pipeline (stage k on rank k) streaming async-1f1b in steady state:
    (makespan of 2 x mini_batches - makespan of mini_batches) / mini_batches."""
    if not work:
        raise ValueError("stream_step_time needs at least one StageWork")
    for name, value in (("micro_batches", micro_batches), ("mini_batches", mini_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if len(work) > cluster.devices:
        raise ValueError(f"{len(work)} stages but cluster {cluster.name!r} has {cluster.devices} devices; "
                         "fix: fewer stages or a bigger cluster")
    if cluster.cores is not None:
        raise ValueError(f"cluster {cluster.name!r} shares cores between devices, which the stream model does "
                         "not simulate; fix: use a Cluster with cores=None (one processor per device)")
    amortised = [dataclasses.replace(w, backward=w.backward + w.update / micro_batches) for w in work]
    costs = action_costs(amortised, cluster)

    def makespan(n: int) -> float:
        return simulate(build("async-1f1b", len(work), micro_batches, mini_batches=n), costs).makespan

    return (makespan(2 * mini_batches) - makespan(mini_batches)) / mini_batches

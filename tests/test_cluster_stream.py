"""stream_step_time: the steady-state period of an async-1f1b stream, against hand computation."""
from __future__ import annotations

import pytest

from schedules.cluster import Cluster
from schedules.cluster.step import StageWork
from schedules.cluster.stream import stream_step_time

FREE = Cluster(nodes=1, devices_per_node=4, intra_bandwidth=float("inf"), intra_latency=0.0,
               inter_bandwidth=float("inf"), inter_latency=0.0)


@pytest.mark.parametrize("m", [1, 3, 8])
def test_equal_stages_and_free_messages_take_m_forwards_and_backwards_per_mini_batch(m):
    # No flush: the p - 1 warm-up slots of a 1F1B pipeline are paid once per stream, not per mini-batch.
    assert stream_step_time([StageWork(1.0, 2.0)] * 4, FREE, micro_batches=m) == pytest.approx(3.0 * m)


def test_the_slowest_stage_and_its_update_set_the_period():
    work = [StageWork(1.0, 2.0), StageWork(2.0, 4.0, update=5.0), StageWork(1.0, 2.0)]
    assert stream_step_time(work, FREE, micro_batches=4) == pytest.approx(4 * 6.0 + 5.0)


def test_messages_on_the_critical_loop_slow_the_stream():
    # 2 stages, m = 1, 2 s per message each way. Stage 0 keeps p - k = 2 micro-batches in flight and
    # each makes the round trip F0 + message + F1 B1 + message + B0 = 1 + 2 + 3 + 2 + 2 = 10 s, so one
    # finishes every 10 / 2 = 5 s: more than a stage's 3 s of compute.
    slow = Cluster(nodes=1, devices_per_node=2, intra_bandwidth=1e6, intra_latency=0.0,
                   inter_bandwidth=1e6, inter_latency=0.0)
    work = [StageWork(1.0, 2.0, send_bytes=2e6), StageWork(1.0, 2.0)]
    assert stream_step_time(work, slow, micro_batches=1) == pytest.approx(5.0)


def test_shared_cores_and_bad_counts_are_clear_errors():
    shared = Cluster(nodes=1, devices_per_node=4, intra_bandwidth=1e9, intra_latency=0.0,
                     inter_bandwidth=1e9, inter_latency=0.0, cores=2)
    with pytest.raises(ValueError, match="cores=None"):
        stream_step_time([StageWork(1.0, 2.0)] * 2, shared)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        stream_step_time([StageWork(1.0, 2.0)], FREE, micro_batches=0)
    with pytest.raises(ValueError, match="5 stages but cluster"):
        stream_step_time([StageWork(1.0, 2.0)] * 5, FREE)

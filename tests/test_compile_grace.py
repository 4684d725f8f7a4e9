"""compile=: a rank waiting for a peer that compiles is not told that the peer died (pipetrain.comm.compile_grace).

The distributed check stands in for a slow inductor with a torch.compile backend that runs the captured graph as it
is (the "eager" backend) after sleeping longer than wrap's timeout on the first graph it compiles. Without the grace
the waiting rank raises PeerFailure after ``timeout`` seconds; with it the pipeline trains and predicts, and once a
shape has settled the wait is ``timeout`` again.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_world
from helpers import batches, wrap_unprofiled
from pipetrain.comm.compile_grace import COMPILE_SECONDS, CompileGrace, group_timeout
from runtime_models import make, sgd

TIMEOUT = 8.0  # wrap's timeout in the distributed check: shorter than the simulated compile
COMPILE_DELAY = 20.0  # what the first graph of a mode takes to "compile" on the rank that is slow for it


def test_unsettled_shapes_wait_for_a_compile_and_settled_ones_for_the_timeout():
    grace = CompileGrace(timeout=30.0, positions=2)
    a, b = ((8, 4),), ((3, 4),)
    assert grace.timeout(a) == timedelta(seconds=COMPILE_SECONDS)
    for finished in range(3):  # a peer may lag up to `positions` mini-batches: settled after positions + 1
        assert grace.timeout(a) == timedelta(seconds=COMPILE_SECONDS), finished
        grace.finished_mini_batch([a, a, a, b])  # a mini-batch whose last micro-batch is smaller
    assert grace.timeout(a) == grace.timeout(b) == timedelta(seconds=30.0)
    assert grace.timeout(((9, 4),)) == timedelta(seconds=COMPILE_SECONDS)  # a new shape may compile again
    with grace.predicting():  # predict's graphs are others: they compile on their first call
        assert grace.timeout(a) == timedelta(seconds=COMPILE_SECONDS)
    assert grace.timeout(a) == timedelta(seconds=30.0)
    # A timeout longer than the grace is kept; without compile nothing changes.
    assert CompileGrace(timeout=900.0, positions=2).timeout(a) == timedelta(seconds=900.0)
    assert group_timeout(30.0, compiles=True) == COMPILE_SECONDS and group_timeout(30.0, compiles=False) == 30.0


class SlowFirstCompile:
    """A torch.compile backend: the captured graph run as it is, after COMPILE_DELAY seconds on the first training
    graph of rank 1 (which rank 0 waits on for gradients) and the first no-grad graph of rank 0 (which rank 1 waits
    on for predict's activations)."""

    def __init__(self):
        self.slow_modes = set()

    def __call__(self, graph_module, example_inputs):
        mode = "train" if torch.is_grad_enabled() else "predict"
        slow_rank = 1 if mode == "train" else 0
        if dist.get_rank() == slow_rank and mode not in self.slow_modes:
            self.slow_modes.add(mode)
            time.sleep(COMPILE_DELAY)
        return graph_module.forward

    def __repr__(self) -> str:  # what the ranks compare at wrap: the same on both
        return "SlowFirstCompile()"


def train_with_a_slow_compile(rank, world):
    data = batches("skip", 4, 8, seed=3)
    pipe = wrap_unprofiled(make("skip"), data[0][0][:2], stages=2, micro_batches=2, schedule="1f1b", optimizer=sgd,
                           partitioner="uniform", engine="distributed",
                           compile={"backend": SlowFirstCompile()}, timeout=TIMEOUT)
    losses = [pipe.step(x, y) for x, y in data]
    grace = pipe._parts.connections.grace
    settled = grace.timeout(next(iter(grace.finished))[1])  # the shapes of the micro-batches trained
    prediction = pipe.predict(data[0][0])
    return losses, settled.total_seconds(), prediction


@pytest.mark.slow
def test_a_peer_compiling_longer_than_the_timeout_is_waited_for(tmp_path):
    per_rank = run_world(2, "test_compile_grace", "train_with_a_slow_compile", tmp_path)
    eager = wrap_unprofiled(make("skip"), batches("skip", 4, 8, seed=3)[0][0][:2], stages=2, micro_batches=2,
                            schedule="1f1b", optimizer=sgd, partitioner="uniform", engine="local")
    data = batches("skip", 4, 8, seed=3)
    want = [eager.step(x, y) for x, y in data]
    for losses, settled, prediction in per_rank:
        assert losses == pytest.approx(want, rel=1e-6)  # the "eager" backend runs the same kernels
        assert settled == TIMEOUT  # 4 steps at 2 positions: the shape settled, a hang is reported after TIMEOUT
        torch.testing.assert_close(prediction, eager.predict(data[0][0]), rtol=1e-6, atol=1e-6)

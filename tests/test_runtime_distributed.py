"""The distributed engine (gloo on loopback) equals the local engine bit for bit."""
import time
from pathlib import Path

import pytest
import torch

from dist_harness import run_world
from runtime_models import RANDOM, data, loss_fn, make, reference_training, sgd
from helpers import batches, wrap_unprofiled

# (model, schedule, staleness, micro_batches)
WORLD2 = [
    ("skip", "gpipe", "none", 4), ("skip", "1f1b", "none", 4), ("skip", "interleaved-1f1b", "none", 4),
    ("skip", "async-1f1b", "vanilla", 1), ("skip", "async-1f1b", "stash", 1), ("skip", "async-1f1b", "spectrain", 1),
    ("skip", "async-1f1b", "stash", 2), ("skip", "async-1f1b", "spectrain", 3), ("skip", "async-1f1b", "2bw", 2),
    ("skip", "async-1f1b", "nesterov", 2),
    ("convbn", "1f1b", "none", 4), ("tied", "1f1b", "none", 4), ("tied", "async-1f1b", "stash", 1),
    ("skip", "zb-h1", "none", 4),
    # Dropout: every engine must draw the same masks (seeded per update, stage and micro-batch).
    ("dropout", "1f1b", "none", 4), ("dropout", "async-1f1b", "stash", 2), ("dropout", "zb-h1", "none", 4),
]
WORLD4 = [("skip", "1f1b", "none", 4), ("mlp", "interleaved-1f1b", "none", 4),
          ("skip", "async-1f1b", "spectrain", 1), ("tied", "gpipe", "none", 4), ("convbn", "zb-h1", "none", 4),
          ("dropout", "interleaved-1f1b", "none", 4), ("dropout", "async-1f1b", "spectrain", 1),
          ("mlp", "async-1f1b", "spectrain", 4), ("mlp", "async-1f1b", "2bw", 3), ("mlp", "async-1f1b", "nesterov", 4)]


def train(engine, stages, name, schedule, staleness, micro_batches):
    bs = batches(name, size=12, last=7)
    pipe = wrap_unprofiled(make(name), bs[0][0][:2], stages=stages, micro_batches=micro_batches, schedule=schedule,
                           staleness=staleness, loss_fn=loss_fn(name), optimizer=sgd, partitioner="uniform",
                           engine=engine)
    # The losses and the staleness diagnostics (NaN where no micro-batch was sampled, named so it compares equal).
    losses = [(r.loss, r.prediction_distance, [e if e == e else "nan" for e in r.prediction_error])
              for r in pipe.train(bs)]
    prediction = pipe.predict(data(name, 6, seed=9)[0])
    return losses, pipe.state_dict(), prediction


def scenarios(rank, world, cases):
    return [train("distributed", world, *case) for case in cases]


@pytest.mark.slow
@pytest.mark.parametrize("world,cases", [(2, WORLD2), (4, WORLD4)], ids=["world2", "world4"])
def test_distributed_equals_local_exactly(tmp_path, world, cases, one_thread):
    # one_thread: the same kernels and thread count as the ranks, for bitwise equality
    per_rank = run_world(world, "test_runtime_distributed", "scenarios", tmp_path, cases)
    for i, case in enumerate(cases):
        losses, expected, prediction = train("local", world, *case)
        merged = {}
        for rank in range(world):
            rank_losses, state, rank_prediction = per_rank[rank][i]
            assert rank_losses == losses, f"{case}: rank {rank} reports other losses"
            assert torch.equal(rank_prediction, prediction), f"{case}: rank {rank} prediction differs"
            merged.update(state)
        assert set(merged) == set(expected), case
        for key, value in expected.items():
            assert torch.equal(merged[key], value), f"{case}: {key} differs"
        if case[2] == "none" and case[0] not in RANDOM:  # synchronous: also the unsplit model with accumulation
            ref = reference_training(case[0], batches(case[0], size=12, last=7), case[3]).state_dict()
            for key, value in ref.items():
                torch.testing.assert_close(merged[key], value, atol=1e-5, rtol=0, msg=f"{case}: {key}")


def long_async_stream(rank, world):
    """A 200-mini-batch async stream: the most sends this rank keeps alive at any mini-batch."""
    x, y = data("mlp", 8)
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=world, micro_batches=2, schedule="async-1f1b",
                           staleness="vanilla", optimizer=sgd, partitioner="uniform",
                           engine="distributed")
    most, steps = 0, []
    for result in pipe.train((x, y) for _ in range(200)):
        most = max(most, len(pipe._parts.connections.transport.pending_sends))
        steps.append(result.step)
    return most, steps


@pytest.mark.slow
def test_a_never_flushed_stream_keeps_a_bounded_number_of_sends_alive(tmp_path):
    # gloo marks a send complete only once it is waited on; without the window an async stream kept
    # every activation and gradient it ever sent (400 after 200 mini-batches here: a memory leak).
    from pipetrain.comm.transport import SEND_WINDOW

    for most, steps in run_world(2, "test_runtime_distributed", "long_async_stream", tmp_path):
        assert steps == list(range(1, 201))
        assert most <= SEND_WINDOW, most


class HeldSGD(torch.optim.SGD):
    """SGD whose step waits until a file exists (another rank says it got its step's result), unless signal is None."""

    def __init__(self, params, signal):
        super().__init__(params, lr=0.1, momentum=0.9)  # as runtime_models.sgd
        self.signal = signal

    def step(self, closure=None):
        if self.signal is not None:  # None: a rank whose update is not held
            for _ in range(600):  # 30 s at most: a rank waiting for this one's report would never write it
                if self.signal.exists():
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError("the first rank never finished its step while this rank's update was held")
        return super().step(closure)


def report_before_update(rank, world, signal_dir):
    signal = Path(signal_dir) / "rank0-has-its-result"
    # Every rank builds the same optimizer (wrap checks they agree); only the last rank's holds its update.
    optimizer = lambda params: HeldSGD(params, signal if rank == 1 else None)  # noqa: E731
    x, y = data("mlp", 8)
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=2, micro_batches=2, optimizer=optimizer, partitioner="uniform",
                           engine="distributed", timeout=60)
    loss = pipe.step(x, y)
    if rank == 0:
        signal.touch()  # only now may the last rank apply its update
    return loss


@pytest.mark.slow
def test_a_sync_step_has_its_report_before_the_updates_run(tmp_path):
    # The last rank's optimizer step is held until rank 0 has returned from its step with the global loss:
    # that is possible only if the step report travels before the updates (it did after them, and
    # the first rank waited for the slowest rank's optimizer).
    losses = run_world(2, "test_runtime_distributed", "report_before_update", tmp_path / "out", str(tmp_path))
    x, y = data("mlp", 8)
    reference = wrap_unprofiled(make("mlp"), x[:2], stages=2, micro_batches=2, optimizer=sgd, partitioner="uniform",
                                engine="local")
    assert losses[0] == losses[1] == reference.step(x, y)


COLLECTIVES = ("all_reduce", "gather", "broadcast", "all_gather", "reduce", "reduce_scatter", "all_to_all", "barrier")


def collectives_per_step(rank, world):
    """The collectives this rank calls in each of three sync steps (after a first step, which agrees
    the boundary shapes)."""
    bs = batches("mlp", size=8, last=8)
    pipe = wrap_unprofiled(make("mlp"), bs[0][0][:2], stages=world, micro_batches=4, optimizer=sgd,
                           partitioner="uniform", engine="distributed")
    pipe.step(*bs[0])
    calls = []
    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}
    for name, original in originals.items():
        setattr(torch.distributed, name, lambda *a, _n=name, _f=original, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        per_step = []
        for x, y in bs:
            calls.clear()
            pipe.step(x, y)
            per_step.append(sorted(calls))
    finally:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)
    return per_step


@pytest.mark.slow
def test_a_sync_step_takes_one_collective_for_its_decision_and_report(tmp_path):
    # The skip-or-step flags ride in the step report's sum: on gloo one gather to rank 0 and one broadcast
    # back per step (an all-reduce of the flags, then a gather and a broadcast of the report, before).
    per_rank = run_world(3, "test_runtime_distributed", "collectives_per_step", tmp_path)
    for rank, per_step in enumerate(per_rank):
        assert per_step == [["broadcast", "gather"]] * 3, (rank, per_step)

"""Checkpoints: exact resume in a new process, crash-safe saves, re-partitioning, export to the unsplit model."""
import multiprocessing
import os

import pytest
import torch

import pipetrain
from dist_harness import run_world
from runtime_models import data, loss_fn, make, sgd

STEPS = 6


def stream(name="convbn", steps=STEPS, size=8):
    x, y = data(name, steps * size)
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(steps)]


def new_pipe(engine="local", stages=2, schedule="1f1b", staleness="none", name="convbn", **kw):
    micro = 1 if schedule == "async-1f1b" else 2
    return pipetrain.wrap(make(name), data(name, 2)[0], stages=stages, micro_batches=micro, schedule=schedule,
                          staleness=staleness, loss_fn=loss_fn(name), optimizer=sgd, partitioner="uniform",
                          profile=False, engine=engine, **kw)


def train(pipe, batches):
    return [r.loss for r in pipe.train(batches)]


CASES = [("1f1b", "none"), ("async-1f1b", "stash"), ("async-1f1b", "spectrain")]


def first_half(rank, world, root, engine):
    """6 steps straight, and 3 steps + save, per case (async: the stream drains after 3 in both)."""
    out = {}
    for schedule, staleness in CASES:
        full = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness)
        train(full, stream()[:3])
        train(full, stream()[3:])
        half = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness)
        train(half, stream()[:3])
        half.save(os.path.join(root, f"{schedule}-{staleness}"))
        out[(schedule, staleness)] = full.state_dict()
    return out


def second_half(rank, world, root, engine):
    out = {}
    for schedule, staleness in CASES:
        pipe = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness)
        assert pipe.resume(os.path.join(root, f"{schedule}-{staleness}"))
        assert pipe.updates == 3
        train(pipe, stream()[3:])
        out[(schedule, staleness)] = pipe.state_dict()
    return out


@pytest.mark.parametrize("engine", ["local", "distributed"])
def test_resume_in_a_new_process_is_exact(tmp_path, engine):
    world = 2 if engine == "distributed" else 1
    root = str(tmp_path / "ckpt")
    full = run_world(world, "test_checkpoint", "first_half", tmp_path / "a", root, engine)
    resumed = run_world(world, "test_checkpoint", "second_half", tmp_path / "b", root, engine)
    for case in CASES:
        for rank in range(world):
            a, b = full[rank][case], resumed[rank][case]
            assert set(a) == set(b)
            for key in a:
                assert torch.equal(a[key], b[key]), f"{engine} {case} {key}"


def _save_then_crash(root):
    pipe = new_pipe()
    train(pipe, stream()[:2])
    pipe.save(root)
    train(pipe, stream()[2:4])
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        os._exit(3)  # killed after the first stage file of the second checkpoint

    torch.save = dying_save
    pipe.save(root)


def test_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = str(tmp_path / "ckpt")
    proc = multiprocessing.get_context("spawn").Process(target=_save_then_crash, args=(root,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 3
    assert (tmp_path / "ckpt" / "step-00000004").exists()  # the broken one is there, but not published
    pipe = new_pipe()
    pipe.load(root)
    assert pipe.updates == 2
    reference = new_pipe()
    train(reference, stream()[:2])
    assert all(torch.equal(reference.state_dict()[k], v) for k, v in pipe.state_dict().items())


def test_repartition_four_stages_into_two_and_into_the_unsplit_model(tmp_path):
    pipe = new_pipe(stages=4, name="skip")
    train(pipe, stream("skip", 3))
    pipe.save(tmp_path)
    x = data("skip", 5, seed=4)[0]
    expected = pipe.predict(x)
    two = new_pipe(stages=2, name="skip")
    two.load(tmp_path)
    torch.testing.assert_close(two.predict(x), expected, atol=1e-6, rtol=0)
    # Optimizer state moved too: one more identical step keeps the two pipelines equal.
    more = stream("skip", 4)[3:]
    train(pipe, more)
    train(two, more)
    for key, value in pipe.state_dict().items():
        torch.testing.assert_close(two.state_dict()[key], value, atol=1e-6, rtol=0)
    unsplit = make("skip")
    unsplit.load_state_dict(pipetrain.export_state_dict(tmp_path))
    unsplit.eval()
    torch.testing.assert_close(unsplit(x), expected, atol=1e-6, rtol=0)  # the model as saved


def test_checkpoint_of_another_model_is_refused(tmp_path):
    pipe = new_pipe(name="mlp")
    train(pipe, stream("mlp", 1))
    pipe.save(tmp_path)
    other = new_pipe(name="skip")
    with pytest.raises(ValueError, match="does not fit this model"):
        other.load(tmp_path)


def test_save_inside_an_async_stream_is_refused(tmp_path):
    pipe = new_pipe(schedule="async-1f1b", staleness="stash")
    for result in pipe.train(stream()):
        with pytest.raises(RuntimeError, match="between train"):
            pipe.save(tmp_path)
        break


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    pipe = new_pipe(name="mlp")
    for batch in stream("mlp", 4):
        pipe.step(*batch)
        pipe.save(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text() == "step-00000004"


def load_local_checkpoint_distributed(rank, world, root):
    pipe = new_pipe("distributed", world)
    pipe.load(root)
    train(pipe, stream()[3:4])
    return pipe.state_dict()




def test_checkpoint_moves_from_the_local_to_the_distributed_engine(tmp_path, one_thread):
    local = new_pipe("local", 2)
    train(local, stream()[:3])
    local.save(tmp_path / "ckpt")
    train(local, stream()[3:4])
    per_rank = run_world(2, "test_checkpoint", "load_local_checkpoint_distributed", tmp_path / "ranks",
                         str(tmp_path / "ckpt"))
    merged = {k: v for state in per_rank for k, v in state.items()}
    assert set(merged) == set(local.state_dict())
    for key, value in local.state_dict().items():
        assert torch.equal(merged[key], value), key

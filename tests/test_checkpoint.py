"""Checkpoints: exact resume in a new process, crash-safe saves, re-partitioning, export to the unsplit model."""
import multiprocessing
import os

import pytest
import torch

import pipetrain
from pipetrain import checkpoint as ckpt
from dist_harness import run_world
from runtime_models import data, loss_fn, make, sgd
from helpers import wrap_unprofiled

STEPS = 6


def stream(name="convbn", steps=STEPS, size=8):
    x, y = data(name, steps * size)
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(steps)]


def new_pipe(engine="local", stages=2, schedule="1f1b", staleness="none", name="convbn", **kw):
    micro = 1 if schedule == "async-1f1b" else 2
    return wrap_unprofiled(make(name), data(name, 2)[0], stages=stages, micro_batches=micro, schedule=schedule,
                           staleness=staleness, loss_fn=loss_fn(name), optimizer=sgd, partitioner="uniform",
                           engine=engine, **kw)


def train(pipe, batches):
    return [r.loss for r in pipe.train(batches)]


CASES = [("1f1b", "none"), ("async-1f1b", "stash"), ("async-1f1b", "spectrain"), ("async-1f1b", "nesterov")]
# The delay corrections keep state in the optimizer (DC-ASGD's MeanSquare) and read the update count (PipeMare).
OPTIONS = {"nesterov": dict(spike_compensation=True, dc_lambda=0.5, stage_lr_warmup=4, stage_momentum=True,
                            error_feedback=True)}


def first_half(rank, world, root, engine):
    """6 steps straight, and 3 steps + save, per case (async: the stream drains after 3 in both)."""
    out = {}
    for schedule, staleness in CASES:
        full = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness, **OPTIONS.get(staleness, {}))
        train(full, stream()[:3])
        train(full, stream()[3:])
        half = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness, **OPTIONS.get(staleness, {}))
        train(half, stream()[:3])
        half.save(os.path.join(root, f"{schedule}-{staleness}"))
        out[(schedule, staleness)] = full.state_dict()
    return out


def second_half(rank, world, root, engine):
    out = {}
    for schedule, staleness in CASES:
        pipe = new_pipe(engine, world if engine == "distributed" else 2, schedule, staleness, **OPTIONS.get(staleness, {}))
        assert pipe.resume(os.path.join(root, f"{schedule}-{staleness}"))
        assert pipe.updates == 3
        train(pipe, stream()[3:])
        out[(schedule, staleness)] = pipe.state_dict()
    return out


@pytest.mark.slow
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


def _save_then_crash(root, threads):
    torch.set_num_threads(threads)  # the parent's count: the reference below must run the same kernels
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
    proc = multiprocessing.get_context("spawn").Process(target=_save_then_crash, args=(root, torch.get_num_threads()))
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




@pytest.mark.slow
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


# ----- never lose a run: retention, refusing to save below another run, durability, bad files -----

def snapshot(root):
    """Every file under ``root`` with its bytes: a failed save or load must change none of them."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_retention_never_deletes_the_checkpoint_latest_names(tmp_path):
    for step in (3, 5, 8):  # a rollback: step 3 is published while newer directories exist
        ckpt.step_dir(tmp_path, step).mkdir()
        (ckpt.step_dir(tmp_path, step) / "manifest.json").write_text("{}")
    ckpt.publish(tmp_path, 3)
    assert (tmp_path / "latest").read_text() == "step-00000003"
    assert (tmp_path / "step-00000003" / "manifest.json").exists()


def test_a_fresh_run_refuses_to_save_below_another_runs_checkpoint(tmp_path):
    other = new_pipe(name="mlp")
    for batch in stream("mlp", 4):
        other.step(*batch)
        other.save(tmp_path)
    before = snapshot(tmp_path)
    fresh = new_pipe(name="mlp")  # the same command again, without --resume
    fresh.step(*stream("mlp", 1)[0])
    with pytest.raises(pipetrain.CheckpointError, match=r"step 4, newer than the step 1.*--resume.*"
                                                       r"pipe\.resume.*another directory"):
        fresh.save(tmp_path)
    assert snapshot(tmp_path) == before
    # Resuming from that run and saving its later steps is what the directory is for.
    resumed = new_pipe(name="mlp")
    assert resumed.resume(tmp_path) and resumed.updates == 4
    resumed.step(*stream("mlp", 5)[4])
    resumed.save(tmp_path)
    assert (tmp_path / "latest").read_text() == "step-00000005"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000005"]


def fresh_save_below(rank, world, root):
    pipe = new_pipe("distributed", world, name="mlp")
    pipe.step(*stream("mlp", 1)[0])
    try:
        pipe.save(root)
    except pipetrain.CheckpointError as exc:
        return str(exc)
    return "saved"


@pytest.mark.slow
def test_every_rank_refuses_a_save_below_another_runs_checkpoint(tmp_path, one_thread):
    root = tmp_path / "ckpt"
    other = new_pipe("local", 2, name="mlp")
    for batch in stream("mlp", 3):
        other.step(*batch)
    other.save(root)
    before = snapshot(root)
    messages = run_world(2, "test_checkpoint", "fresh_save_below", tmp_path / "ranks", str(root))
    assert all("newer than the step 1" in m for m in messages), messages  # both ranks, no barrier left waiting
    assert snapshot(root) == before


def test_files_and_directories_are_fsynced_before_latest_flips(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    pipe = new_pipe(name="mlp")
    pipe.step(*stream("mlp", 1)[0])
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = pipe.save(tmp_path)
    root, step = str(tmp_path), str(target)
    replaces = {e[2]: i for i, e in enumerate(events) if e[0] == "replace"}
    synced = {}
    for i, e in enumerate(events):
        if e[0] == "fsync":
            synced.setdefault(e[1], []).append(i)
    for name in ("stage0.pt", "stage1.pt", "manifest.json"):
        dst = f"{step}/{name}"
        src = next(e[1] for e in events if e[0] == "replace" and e[2] == dst)
        assert min(synced.get(src, [len(events)])) < replaces[dst], f"{name} renamed before its data was synced"
    flip = replaces[f"{root}/latest"]
    last_in_step = max(i for d, i in replaces.items() if d.startswith(step + "/"))
    assert any(last_in_step < i < flip for i in synced.get(step, [])), "step directory not synced before latest"
    assert any(i < flip for i in synced.get(root, [])), "root not synced before latest flips"
    assert any(i > flip for i in synced.get(root, [])), "root not synced after latest flips"
    latest_src = next(e[1] for e in events if e[0] == "replace" and e[2] == f"{root}/latest")
    assert min(synced.get(latest_src, [len(events)])) < flip


def two_checkpoints(root, name="mlp"):
    pipe = new_pipe(name=name)
    for batch in stream(name, 2):
        pipe.step(*batch)
        pipe.save(root)
    return root / "step-00000002"


def assert_refused(root, match):
    """Loading, resuming and exporting all give one CheckpointError; nothing changes on disk or in the pipe."""
    before = snapshot(root)
    pipe = new_pipe(name="mlp")
    untouched = {k: v.clone() for k, v in pipe.state_dict().items()}
    for attempt in (lambda: pipe.load(root), lambda: pipe.resume(root), lambda: pipetrain.export_state_dict(root)):
        with pytest.raises(pipetrain.CheckpointError, match=match):
            attempt()
    assert snapshot(root) == before
    assert pipe.updates == 0 and all(torch.equal(untouched[k], v) for k, v in pipe.state_dict().items())


def test_a_truncated_stage_file_is_refused_by_name(tmp_path):
    stage = two_checkpoints(tmp_path) / "stage1.pt"
    stage.write_bytes(stage.read_bytes()[:stage.stat().st_size // 2])
    assert_refused(tmp_path, r"stage1\.pt .*truncated or corrupted.*pipe\.load\(.*step-00000001")


def test_a_corrupted_stage_file_is_refused_by_name(tmp_path):
    stage = two_checkpoints(tmp_path) / "stage0.pt"
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: torch.load itself reads it without complaint
    stage.write_bytes(bytes(data))
    assert_refused(tmp_path, r"stage0\.pt .*truncated or corrupted.*step-00000001")


def test_a_missing_manifest_is_refused_not_taken_for_no_checkpoint(tmp_path):
    (two_checkpoints(tmp_path) / "manifest.json").unlink()
    assert_refused(tmp_path, r"latest names 'step-00000002'.*manifest\.json does not exist.*step-00000001")


def test_a_manifest_of_another_model_is_refused(tmp_path):
    step = two_checkpoints(tmp_path / "mlp")
    other = two_checkpoints(tmp_path / "skip", name="skip")
    (step / "manifest.json").write_bytes((other / "manifest.json").read_bytes())
    assert_refused(tmp_path / "mlp", r"stage0\.pt does not match .*manifest\.json")


# ----- no process holds the whole model: loads open only what they need, memory-mapped -----

def file_mappings(directory):
    """(start, end, file) of every region of this process's memory mapped from a file under ``directory``."""
    out = []
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip().startswith(str(directory)):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            out.append((start, end, fields[5].strip()))
    return out


def mapped_from(t, mappings):
    """The file whose mapping holds ``t``'s data, or None."""
    return next((f for start, end, f in mappings if start <= t.data_ptr() < end), None)


needs_proc_maps = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux's /proc/self/maps")


@needs_proc_maps
def test_a_stage_file_is_read_memory_mapped(tmp_path):
    step = two_checkpoints(tmp_path)
    manifest = ckpt.read_manifest(step)
    module = ckpt.read_stage_file(step, 1, manifest)["module"]
    mappings = file_mappings(step)
    assert module and all(mapped_from(t, mappings) == str(step / "stage1.pt") for t in module.values())


@needs_proc_maps
def test_loaded_optimizer_state_does_not_stay_in_the_checkpoint_files(tmp_path):
    two_checkpoints(tmp_path)
    pipe = new_pipe(name="mlp")
    pipe.load(tmp_path)
    state = [t for rt in pipe.held_stages.values() for s in rt.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    mappings = file_mappings(tmp_path)
    assert state and not [mapped_from(t, mappings) for t in state if mapped_from(t, mappings)]


def load_counting_files(rank, world, root):
    """Load the 4-stage checkpoint into this rank's stage of 2, noting every file torch.load opens."""
    pipe = new_pipe("distributed", world, name="skip")
    opened, real_load = [], torch.load

    def counting_load(f, *args, **kwargs):
        opened.append(os.path.basename(f))
        return real_load(f, *args, **kwargs)

    torch.load = counting_load
    try:
        pipe.load(root)
    finally:
        torch.load = real_load
    return {"opened": opened, "state": pipe.state_dict()}


def test_each_rank_opens_only_the_stage_files_holding_its_names(tmp_path):
    four = new_pipe(stages=4, name="skip")
    train(four, stream("skip", 3))
    four.save(tmp_path / "ckpt")
    saved = {v: set(rt.module.state_dict()) for v, rt in four.held_stages.items()}
    per_rank = run_world(2, "test_checkpoint", "load_counting_files", tmp_path / "ranks", str(tmp_path / "ckpt"))
    for rank, result in enumerate(per_rank):
        expected = [f"stage{v}.pt" for v, names in saved.items() if names & set(result["state"])]
        assert result["opened"] == expected, rank
    assert all(len(r["opened"]) < 4 for r in per_rank)  # neither rank read the whole model
    merged = {k: v for r in per_rank for k, v in r["state"].items()}
    assert set(merged) == set(four.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in four.state_dict().items())

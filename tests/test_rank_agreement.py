"""Every rank agrees, with real gloo ranks on loopback: at wrap on what it trains, replicas start equal,
save and load are all-or-nothing, a failed step leaves a run that goes on, and every wait names whom it
waited for. The references are independent: the same run on one seed, the local engine, the bytes on disk."""
from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.comm import replica_start
from dist_harness import free_port, run_world, start_ranks
from runtime_models import data, make, sgd
from helpers import wrap_unprofiled

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

TIMEOUT = 5.0


def _state_digest(pipe: pipetrain.Pipeline) -> str:
    digest = hashlib.sha256()
    for k, t in sorted(pipe.state_dict().items()):
        digest.update(k.encode() + t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for stage in pipe.held_stages.values():
        for state in stage.optimizer.state.values():
            for v in state.values():
                digest.update(torch.as_tensor(v).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ----- wrap: replicas start equal, every rank agrees on what it trains ------------------------------------

def _width_mlp(last: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, last), nn.Tanh(), nn.Linear(last, 4))


def agreement_scenarios(rank, world):
    """4 ranks = 2 stages x 2 replicas."""
    out = {}
    batches = [data("convbn", 8, seed=s) for s in (1, 2)]
    for key, seed in (("seed per replica", rank // 2), ("one seed", 0)):
        pipe = wrap_unprofiled(make("convbn", seed=seed), batches[0][0][:2], stages=2, micro_batches=2, data_parallel=2,
                               optimizer=sgd, partitioner="uniform", timeout=30)
        for x, y in batches:
            pipe.step(x, y)
        out[key] = pipe.state_dict()
    # Replicas that read the same tensors (a meta-device model: each module's initialiser from wrap's seed) compare
    # digests and send nothing; a model built in memory is sent from replica 0, one bucketed broadcast per stage.
    sends = []
    send = replica_start._sync_module_states
    replica_start._sync_module_states = lambda *args, **kw: (sends.append(1), send(*args, **kw))
    x = data("mlp", 4)[0]
    for key, build in (("sends, meta model", "meta"), ("sends, model in memory", "cpu")):
        with torch.device(build):
            model = make("mlp", seed=rank)
        sends.clear()
        wrap_unprofiled(model, x[:2], stages=2, micro_batches=2, data_parallel=2, optimizer=sgd,
                        partitioner="uniform", timeout=30)
        out[key] = len(sends)
    replica_start._sync_module_states = send
    mismatches = {
        "micro_batches": dict(micro_batches=4 if rank == 3 else 2),
        "optimizer": dict(optimizer=(lambda p: torch.optim.SGD(p, lr=0.2 if rank == 1 else 0.1))),
        "stages": dict(stages=4, data_parallel=1) if rank == 2 else {},
        "width": dict(model=_width_mlp(24 if rank == 1 else 16)),
    }
    for key, change in mismatches.items():
        kw = dict(model=_width_mlp(16), stages=2, data_parallel=2, micro_batches=2, optimizer=sgd,
                  partitioner="uniform", timeout=30)
        kw.update(change)
        try:
            wrap_unprofiled(kw.pop("model"), x[:2], **kw)
            out[key] = "wrapped"
        except ValueError as error:
            out[key] = str(error)
    return out


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    return run_world(4, "test_rank_agreement", "agreement_scenarios", tmp_path_factory.mktemp("agreement"))


def test_replicas_built_from_different_seeds_train_as_one_seed(agreement):
    # Without the start from replica 0's tensors, replica 1 (seed 1) would train other weights than replica 0,
    # the gradient average would mix them, and replica 0's checkpoint would drop what replica 1 learnt.
    for rank in range(4):
        mixed, one = agreement[rank]["seed per replica"], agreement[rank]["one seed"]
        assert mixed.keys() == one.keys()
        assert all(torch.equal(mixed[k], one[k]) for k in one), f"rank {rank}"
    for position in (0, 1):  # the replicas of a stage hold the same parameters (BatchNorm statistics are per shard)
        a, b = agreement[position]["one seed"], agreement[2 + position]["one seed"]
        params = [k for k in a if not k.rsplit(".", 1)[-1].startswith(("running_", "num_batches"))]
        assert params and all(torch.equal(a[k], b[k]) for k in params)


def test_replicas_that_read_the_same_tensors_send_nothing(agreement):
    assert [agreement[rank]["sends, meta model"] for rank in range(4)] == [0] * 4
    assert [agreement[rank]["sends, model in memory"] for rank in range(4)] == [1] * 4


@pytest.mark.parametrize("case, field, odd", [
    ("micro_batches", "option micro_batches", "rank 3: 4"),
    ("optimizer", "optimizer (class, hyper-parameters)", "rank 1: torch.optim.sgd.SGD [{'dampening'"),
    ("stages", "option stages", "rank 2: 4"),
    ("width", "parameter and buffer names, shapes, dtypes", "rank 1: 6 tensors"),
])
def test_a_mismatch_is_one_error_on_every_rank_naming_field_and_ranks(agreement, case, field, odd):
    messages = [agreement[rank][case] for rank in range(4)]
    assert all(m == messages[0] for m in messages), messages  # the same error everywhere
    message = messages[0]
    assert message.startswith("wrap(): the ranks would not train the same thing"), message
    assert f"  {field}: " in message and odd in message, message
    if case == "optimizer":
        assert "'lr': 0.2" in message and "ranks 0, 2, 3:" in message, message


# ----- save and load: all or nothing --------------------------------------------------------------------

def _new(rank, **kw):
    options = dict(stages=2, micro_batches=4, optimizer=sgd, partitioner="uniform", timeout=30)
    options.update(kw)
    return wrap_unprofiled(make("mlp"), data("mlp", 2)[0], **options)


def checkpoint_scenarios(rank, world, root):
    root = Path(root)
    out = {}
    pipe = _new(rank)
    pipe.step(*data("mlp", 8, seed=1))
    pipe.save(root)
    saved = _state_digest(pipe)
    pipe.step(*data("mlp", 8, seed=2))
    # rank 1 may write files of at most 1 KiB: its stage file does not fit (EFBIG), rank 0's does.
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    start = time.perf_counter()
    try:
        pipe.save(root)
        out["full"] = "saved"
    except pipetrain.CheckpointError as error:
        out["full"] = str(error)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    out["seconds to refuse the save"] = time.perf_counter() - start
    out["latest after the failed save"] = (root / "latest").read_text()
    pipe.step(*data("mlp", 8, seed=3))  # the pipeline goes on
    out["retry"] = str(pipe.save(root))
    trained = _state_digest(pipe)

    old = root / "step-00000001"
    torch.distributed.barrier()
    if rank == 0:  # one byte of stage 1's file (read only by rank 1) flipped
        with open(old / "stage1.pt", "r+b") as f:
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    start = time.perf_counter()
    out["tampered"] = _refusal(lambda: pipe.load(old))
    out["seconds to refuse the load"] = time.perf_counter() - start
    out["unchanged after tampered"] = _state_digest(pipe) == trained
    torch.distributed.barrier()
    if rank == 0:
        with open(old / "stage1.pt", "r+b") as f:
            f.seek(200)
            f.write(byte)
        manifest = json.loads((old / "manifest.json").read_text())
        original = (old / "manifest.json").read_bytes()
        manifest["step"] = 300
        (old / "manifest.json").write_text(json.dumps(manifest))
    torch.distributed.barrier()
    out["edited manifest"] = _refusal(lambda: pipe.load(old))
    out["unchanged after edited manifest"] = _state_digest(pipe) == trained
    torch.distributed.barrier()
    if rank == 0:
        (old / "manifest.json").write_bytes(original)
    torch.distributed.barrier()
    pipe.load(old)  # the old checkpoint still loads, exactly
    out["old checkpoint loads"] = _state_digest(pipe) == saved and pipe.updates == 1

    # A checkpoint directory that only rank 0 sees (as on machines that do not share it): no rank resumes alone.
    elsewhere = root.parent / f"empty-on-rank{rank}"
    out["resume seen by rank 0 only"] = _refusal(lambda: pipe.resume(root if rank == 0 else elsewhere))
    out["resume where no rank finds one"] = pipe.resume(elsewhere)

    adam = _new(rank, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    out["another optimizer"] = _refusal(lambda: adam.load(old))
    slower = _new(rank, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slower.load(old)
    out["hyper-parameter warnings"] = [str(w.message) for w in caught if "hyper-parameters" in str(w.message)]
    out["lr after resume"] = slower.held_stages[rank].optimizer.param_groups[0]["lr"]
    return out


def _refusal(load) -> str:
    try:
        load()
    except pipetrain.CheckpointError as error:
        return str(error)
    return "loaded"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoints")
    return run_world(2, "test_rank_agreement", "checkpoint_scenarios", tmp / "ranks", str(tmp / "ckpt"))


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_last_checkpoint(checkpoints):
    messages = [checkpoints[r]["full"] for r in range(2)]
    print("seconds to refuse the save, per rank:", [round(c["seconds to refuse the save"], 3) for c in checkpoints],
          "the load:", [round(c["seconds to refuse the load"], 3) for c in checkpoints])
    assert messages[0] == messages[1], messages
    assert "failed on 1 rank:\n  rank 1: OSError: [Errno 27] File too large" in messages[0], messages[0]
    assert "stage1.pt" in messages[0] and "still names step-00000001" in messages[0], messages[0]
    assert all(checkpoints[r]["latest after the failed save"] == "step-00000001" for r in range(2))
    assert all(checkpoints[r]["retry"].endswith("step-00000003") for r in range(2))
    assert all(checkpoints[r]["old checkpoint loads"] for r in range(2))


@pytest.mark.parametrize("case, expected", [
    ("tampered", r"rank 1: CheckpointError: \S*stage1\.pt does not match"),
    ("edited manifest", r"rank 0: CheckpointError: \S*manifest\.json was edited or corrupted"),
])
def test_a_refused_load_is_refused_by_every_rank_and_changes_no_state(checkpoints, case, expected):
    import re
    messages = [checkpoints[r][case] for r in range(2)]
    assert messages[0] == messages[1], messages  # rank 0 could read its own file, yet it loads nothing either
    assert re.search(expected, messages[0]) and "No rank loaded anything" in messages[0], messages[0]
    assert all(checkpoints[r][f"unchanged after {case}"] for r in range(2))


def test_a_checkpoint_only_some_ranks_see_is_resumed_by_none(checkpoints):
    messages = [checkpoints[r]["resume seen by rank 0 only"] for r in range(2)]
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("resume failed on 2 ranks:\n  rank 0: finds a checkpoint under "), messages[0]
    assert "\n  rank 1: finds none under " in messages[0] and "empty-on-rank1" in messages[0], messages[0]
    assert all(checkpoints[r]["resume where no rank finds one"] is False for r in range(2))


def test_resuming_with_another_optimizer_class_is_refused_and_hyper_parameters_follow_the_checkpoint(checkpoints):
    for r in range(2):
        message = checkpoints[r]["another optimizer"]
        assert "holds the state of a torch.optim.sgd.SGD optimizer" in message and "torch.optim.adam.Adam" in message
        assert "weights=" in message, message
        assert checkpoints[r]["lr after resume"] == 0.1  # the checkpoint's, said in a warning
        assert any("lr 0.01 -> 0.1" in w for w in checkpoints[r]["hyper-parameter warnings"]), checkpoints[r]


# ----- pipetrain's own process group: a failed step, then a rank stopped in a save ---------------------

def _own_group_rank(rank, port, out, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    out = Path(out)
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=4, optimizer=sgd,
                           partitioner="uniform", timeout=TIMEOUT)  # pipetrain starts the group
    pipe.step(*data("mlp", 8, seed=1))
    x, y = data("mlp", 8, seed=9)
    y[-1] = 99  # the last stage's loss raises; rank 0 waits TIMEOUT for gradients that never come
    try:
        pipe.step(x, y)
    except Exception as error:  # noqa: BLE001  (the test reads what each rank saw)
        (out / f"failed{rank}").write_text(f"{type(error).__name__}: {error}")
    for seed in (2, 3, 4):
        pipe.step(*data("mlp", 8, seed=seed))
    torch.save(pipe.state_dict(), out / f"state{rank}.pt")
    if rank == 1:  # stopped in the middle of the save, before it writes its stage file
        write = pipetrain.checkpoint.save.atomic_save

        def stop(*args):
            (out / "t0").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return write(*args)
        pipetrain.checkpoint.save.atomic_save = stop
    try:
        pipe.save(out / "ckpt")
        (out / f"save{rank}").write_text("saved")
    except Exception as error:  # noqa: BLE001
        (out / f"save{rank}").write_text(f"{time.time()}\n{type(error).__name__}: {error}")
    os._exit(0)


def test_a_failed_step_and_a_rank_stopped_in_a_save_under_pipetrains_own_process_group(tmp_path):
    ctx = start_ranks(_own_group_rank, (free_port(), str(tmp_path), 2), 2, join=False)
    ctx.processes[0].join(180)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()  # rank 1 is stopped: SIGKILL ends it all the same
        p.join()
    assert ctx.processes[0].exitcode == 0
    # The failed step: rank 1 raised its own error, rank 0 named it; then 3 good steps with timeout=5 equal
    # the local engine that never saw the bad batch, though the failed wait used up the same timeout.
    assert (tmp_path / "failed1").read_text().startswith("IndexError")
    assert "rank 1 raised IndexError" in (tmp_path / "failed0").read_text()
    reference = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=4, optimizer=sgd,
                                partitioner="uniform", engine="local")
    for seed in (1, 2, 3, 4):
        reference.step(*data("mlp", 8, seed=seed))
    got = {**torch.load(tmp_path / "state0.pt"), **torch.load(tmp_path / "state1.pt")}
    expected = reference.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    # The stopped save: rank 0 names rank 1 and the save (how long it waited is printed, not asserted: a loaded
    # machine may stretch it; a wait that never ended would fail the run's own deadline).
    stamp, message = (tmp_path / "save0").read_text().split("\n", 1)
    waited = float(stamp) - float((tmp_path / "t0").read_text())
    print(f"rank 0 gave up on the stopped rank 1 {waited:.1f} s after it stopped (timeout {TIMEOUT:g} s)")
    assert message.startswith("PeerFailure: save of step 4 under") and "rank 1 never reached it" in message, message
    assert not (tmp_path / "ckpt" / "latest").exists()


RENDEZVOUS = """
import os, socket, sys, time
held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()  # accepts connections, never answers: another program holding the port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]), RANK="1", WORLD_SIZE="2")
import pipetrain
from torch import nn
import torch
try:
    pipetrain.wrap(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), torch.randn(2, 4), stages=2, timeout=3)
except Exception as error:
    print(type(error).__name__ + ": " + str(error), flush=True)
os._exit(0)  # the rendezvous thread is still blocked in its handshake
"""


def test_the_rendezvous_pipetrain_makes_gives_up_after_the_timeout_naming_the_address():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", RENDEZVOUS], capture_output=True, text=True, timeout=60)
    line = next(line for line in done.stdout.splitlines() if "Failure" in line or "Error" in line)
    assert line.startswith("PeerFailure: rank 1: the rendezvous at 127.0.0.1:"), line
    assert "(MASTER_ADDR:MASTER_PORT) of 2 ranks did not complete" in line and "no answer" in line, line


LATE_STARTER = """
import os, sys, time
from pathlib import Path
import torch
import pipetrain
arrived = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    arrived.touch()  # rank 0 starts waiting at the rendezvous now
else:
    while not arrived.exists():
        time.sleep(0.05)
    time.sleep(3)  # start-up work of its own: rank 1 arrives at least 3 s after rank 0 began to wait
torch.manual_seed(0)
pipe = pipetrain.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), torch.randn(2, 4),
                      stages=2, micro_batches=2, timeout=1, profile=False, loss_fn=torch.nn.functional.cross_entropy,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
loss = pipe.step(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))
if os.environ["RANK"] == "0":
    print(f"trained: loss {loss:.4f}", flush=True)
pipe.close()
"""


def test_under_torchrun_a_rank_that_starts_late_is_waited_for_at_the_rendezvous(tmp_path):
    # wrap(timeout=1) and a rank that reaches wrap() at least 3 s after the other began to wait there (a sleep is a
    # lower bound on any machine, however loaded): under torchrun the rendezvous waits for start-up work (its
    # agent stops the job if a worker dies), so both train; with the 1 s timeout there, rank 0 would stop.
    import subprocess
    import sys
    script = tmp_path / "late_starter.py"
    script.write_text(LATE_STARTER)
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(script),
                           str(tmp_path / "arrived")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained: loss" in done.stdout

"""A rank that dies or hangs stops every other rank, with an error naming it and what it waited for.

How long each survivor took after the victim is printed, not asserted (a loaded 2-core machine stretches
it); a survivor that waited for ever fails the run's deadline (``_run``)."""
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import partitioners
from dist_harness import free_port, start_ranks
from runtime_models import data, make, sgd
from helpers import wrap_unprofiled

WORLD, VICTIM, TIMEOUT = 4, 2, 8.0


def _hang(out):
    Path(out, "t0").write_text(str(time.time()))
    time.sleep(120)


def _outside_the_step(rank, out, mode, world, victim):
    """wrap() with a victim that hangs before it reaches wrap ("hang-before-wrap") or, as rank 0, while it
    partitions the model, so the others wait in the plan broadcast ("hang-in-plan"); or a one-mini-batch
    async-1f1b stream whose victim hangs after its compute, before the end-of-step report ("hang-at-report")."""
    if mode == "hang-before-wrap" and rank == victim:
        _hang(out)
    if mode == "hang-in-plan" and rank == victim:
        partition = partitioners.partition
        partitioners.partition = lambda *args, **kw: (_hang(out), partition(*args, **kw))[1]
    x, y = data("mlp", 8)
    # A sync step's report rides in the skip-or-step agreement (that wait is hang-at-step's); an async-1f1b
    # stream sends each mini-batch's report on its own, after the mini-batch's STEP.
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=world, micro_batches=4, optimizer=sgd, partitioner="uniform",
                           engine="distributed", timeout=TIMEOUT,
                           **({"schedule": "async-1f1b", "staleness": "vanilla"} if mode == "hang-at-report" else {}))
    if mode == "hang-at-report":
        if rank == victim:
            reporter = pipe._parts.connections.reporter
            post = reporter.post
            reporter.post = lambda *args: (_hang(out), post(*args))[1]
        list(pipe.train([(x, y)]))


def _rank(rank, port, out, mode, world, victim):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if mode in ("hang-before-wrap", "hang-in-plan", "hang-at-report"):
        try:
            _outside_the_step(rank, out, mode, world, victim)
            Path(out, f"rank{rank}").write_text("finished")
        except Exception as error:  # noqa: BLE001  (the test reads what each rank reported)
            Path(out, f"rank{rank}").write_text(f"{time.time()}\n{type(error).__name__}: {error}")
            os._exit(1)
        os._exit(0)
    x, y = data("mlp", 8)
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=world, micro_batches=4, optimizer=sgd, partitioner="uniform",
                           engine="distributed", timeout=TIMEOUT,
                           precision="fp16" if mode == "hang-at-step" else "fp32")
    pipe.step(x, y)
    if rank == VICTIM and mode == "hang-at-step":
        # Every compute and message of the step done, the victim hangs before the skip-or-step
        # agreement: the others wait in that collective, not in a point-to-point receive.
        scaler = pipe._parts.steppers[VICTIM].scaler
        def unscale_then_hang(*args, _unscale=scaler.unscale_local_):
            Path(out, "t0").write_text(str(time.time()))
            time.sleep(120)
            return _unscale(*args)
        scaler.unscale_local_ = unscale_then_hang
    elif rank == VICTIM and mode in ("die", "hang"):
        def fail(module, inputs):  # mid-step: after the first micro-batch's forward on this stage
            if fail.calls == 1:
                Path(out, "t0").write_text(str(time.time()))
                if mode == "die":
                    os._exit(17)
                time.sleep(120)  # hang
            fail.calls += 1
        fail.calls = 0
        pipe.held_stages[VICTIM].module.register_forward_pre_hook(fail)
    if mode in ("bad-label", "go-on"):  # every rank steps on a label out of range: the last stage's loss raises
        bad = y.clone()
        bad[-1] = 99
        Path(out, "t0").write_text(str(time.time()))
    if mode == "go-on":  # every rank raises, catches it and trains on: the next step equals never seeing it
        try:
            pipe.step(x, bad)
        except Exception as error:  # noqa: BLE001
            Path(out, f"error{rank}").write_text(f"{type(error).__name__}: {error}")
        pipe.step(*data("mlp", 8, seed=2))
        torch.save(pipe.state_dict(), Path(out, f"state{rank}.pt"))
        # A second pipeline in the same process group fails in its turn: its errors are its own.
        second = wrap_unprofiled(make("mlp"), x[:2], stages=world, micro_batches=4, optimizer=sgd,
                                 partitioner="uniform", engine="distributed", timeout=2.0)
        bad[-1] = -5
        try:
            second.step(x, bad)
        except Exception as error:  # noqa: BLE001
            Path(out, f"second{rank}").write_text(f"{type(error).__name__}: {error}")
        os._exit(0)
    try:
        pipe.step(x, bad if mode == "bad-label" else y)
        Path(out, f"rank{rank}").write_text("finished")
    except Exception as error:  # noqa: BLE001  (the test reads what each rank reported)
        Path(out, f"rank{rank}").write_text(f"{time.time()}\n{type(error).__name__}: {error}")
        os._exit(1)
    os._exit(0)


def _run(tmp_path, mode, victim=VICTIM, world=WORLD):
    port = free_port()
    ctx = start_ranks(_rank, (port, str(tmp_path), mode, world, victim), world, join=False)
    deadline = time.time() + 120
    for r, p in enumerate(ctx.processes):
        if r != victim:  # a hanging victim never ends by itself
            p.join(max(1, deadline - time.time()))
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "hang"])
def test_other_ranks_stop_within_the_timeout_naming_the_rank(tmp_path, mode):
    codes = _run(tmp_path, mode)
    t0 = float((tmp_path / "t0").read_text())
    survivors = [r for r in range(WORLD) if r != VICTIM]
    for r in survivors:
        assert codes[r] == 1, f"rank {r} exit code {codes[r]}"
        stamp, message = (tmp_path / f"rank{r}").read_text().split("\n", 1)
        print(f"{mode}: rank {r} stopped {float(stamp) - t0:.1f} s after rank {VICTIM} {'died' if mode == 'die' else 'hung'} "
              f"(timeout {TIMEOUT:g} s)")
        # Each survivor stops (one that waited for ever would fail _run's deadline); how long after the
        # victim is printed, not asserted: a loaded machine stretches it.
        assert "PeerFailure" in message and "rank" in message
    # The victim's neighbours name it.
    for r in (VICTIM - 1, VICTIM + 1):
        assert f"rank {VICTIM}" in (tmp_path / f"rank{r}").read_text()


@pytest.mark.slow
def test_a_rank_hung_before_a_collective_stops_the_others_within_the_timeout(tmp_path):
    # The default process group of this test waits 60 s; every collective of pipetrain must give up
    # after wrap(timeout=8) instead.
    codes = _run(tmp_path, "hang-at-step")
    t0 = float((tmp_path / "t0").read_text())
    for r in (r for r in range(WORLD) if r != VICTIM):
        assert codes[r] == 1, f"rank {r} exit code {codes[r]}"
        stamp, message = (tmp_path / f"rank{r}").read_text().split("\n", 1)
        print(f"hang-at-step: rank {r} stopped {float(stamp) - t0:.1f} s after rank {VICTIM} hung (timeout {TIMEOUT:g} s)")
        assert "PeerFailure" in message and "skip-or-step agreement" in message, message


@pytest.mark.slow
@pytest.mark.parametrize("mode, victim, waits_in", [
    ("hang-in-plan", 0, "the plan broadcast from rank 0"),
    ("hang-before-wrap", 1, "wrap(): agreeing on what every rank trains"),
    ("hang-at-report", 1, "the end-of-step report"),
])
def test_a_rank_hung_outside_the_step_stops_the_others_within_the_timeout(tmp_path, mode, victim, waits_in):
    # The default group waits 60 s; the set-up's collectives (group creation, the plan broadcast) and
    # the step report must give up after wrap(timeout=8) and say what they waited for. Two ranks suffice.
    codes = _run(tmp_path, mode, victim, world=2)
    t0 = float((tmp_path / "t0").read_text())
    for r in (r for r in range(2) if r != victim):
        assert codes[r] == 1, f"rank {r} exit code {codes[r]}"
        stamp, message = (tmp_path / f"rank{r}").read_text().split("\n", 1)
        print(f"{mode}: rank {r} stopped {float(stamp) - t0:.1f} s after rank {victim} hung (timeout {TIMEOUT:g} s)")
        assert "PeerFailure" in message and waits_in in message and "timeout=" in message, message


@pytest.mark.slow
def test_a_step_that_raises_on_one_rank_is_named_by_the_others(tmp_path):
    # The last stage's loss raises (a label out of range); rank 0 waits for gradients that never come and
    # stops after the timeout with a PeerFailure that names rank 1's own error, read from the store.
    codes = _run(tmp_path, "bad-label", victim=None, world=2)  # rank 1 raises and ends by itself
    assert codes == [1, 1]
    victim = (tmp_path / "rank1").read_text().split("\n", 1)[1]
    assert victim.startswith("IndexError"), victim
    _, message = (tmp_path / "rank0").read_text().split("\n", 1)
    assert message.startswith("PeerFailure") and "rank 1 raised IndexError" in message, message


@pytest.mark.slow
def test_every_rank_carries_on_after_a_step_that_raised_as_if_it_never_ran(tmp_path):
    # Both ranks raise in the failed step (rank 1 its IndexError, rank 0 a PeerFailure after the timeout), catch
    # it and step again: on new process groups, from gradients and buffers as before the failed step, so the
    # parameters equal, bit for bit, the local engine trained on the good batches only.
    assert _run(tmp_path, "go-on", victim=None, world=2) == [0, 0]  # no victim: both ranks end by themselves
    assert (tmp_path / "error1").read_text().startswith("IndexError")
    assert "rank 1 raised IndexError" in (tmp_path / "error0").read_text()
    # The second pipeline's failure names its own error (label -5), not the first pipeline's (99).
    assert "-5" in (tmp_path / "second1").read_text()
    second = (tmp_path / "second0").read_text()
    assert second.startswith("PeerFailure") and "rank 1 raised IndexError" in second and "-5" in second, second
    reference = wrap_unprofiled(make("mlp"), data("mlp", 8)[0][:2], stages=2, micro_batches=4, optimizer=sgd,
                                partitioner="uniform", engine="local")
    for seed in (1, 2):
        reference.step(*data("mlp", 8, seed=seed))
    got = {**torch.load(tmp_path / "state0.pt"), **torch.load(tmp_path / "state1.pt")}
    expected = reference.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)

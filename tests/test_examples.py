"""The example scripts run as users run them, `python examples/<name>.py ...`: stopped by a real SIGTERM in a
process of their own, a checkpointed run and its resume (run in this process, as `python` would run the script:
no signal to isolate) give exactly the steps of one uninterrupted run, the losses are finite and TensorBoard
holds them."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _example_runs import CASES, EXAMPLES, run_example, scalars

HERE = Path(__file__).resolve().parent

# 96 samples in mini-batches of 16: 6 steps an epoch.
SMALL = ["--stages", "2", "--train-samples", "96", "--val-samples", "32", "--batch-size", "16",
         "--partitioner", "params", "--log-every", "1"]
SCRIPTS = ["vgg", "resnet", "transformer", "lstm"]

pytestmark = pytest.mark.usefixtures("one_thread")  # the scripts' processes run one thread too: the same bits


def printed(name: str, args: list[str], capsys) -> str:
    """What examples/<name>.py prints when run in this process (cheaper than a process of its own: the
    uninterrupted reference runs and the resumes)."""
    capsys.readouterr()
    run_example(name, args)
    return capsys.readouterr().out


def step_losses(output: str) -> dict[int, float]:
    """The `step N: loss X` lines a script printed, by step."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+): loss (\S+)$", output, re.MULTILINE)}


def latest_step(checkpoints: Path) -> int:
    return int((checkpoints / "latest").read_text().strip().removeprefix("step-"))


def stopped_by_sigterm(name: str, step: int, *args: str, env: dict | None = None) -> str:
    """What `python examples/<name>.py <args>` prints when it gets a real SIGTERM right after step ``step``
    (tests/sigterm_at_step.py sends it from the training loop, so where it lands does not depend on timing).
    It must exit with status 0."""
    done = subprocess.run([sys.executable, str(HERE / "sigterm_at_step.py"), str(EXAMPLES / f"{name}.py"), *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "SIGTERM_STEP": str(step), **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def saved_steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in checkpoints.glob("step-*"))


SIGNAL_AT = 8  # inside the second epoch (6 steps an epoch): a validation and an epoch checkpoint came before it


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_sigterm_saves_and_the_resume_continues_as_documented(name, tmp_path, capsys):
    # SIGTERM with --checkpoint-dir: the script finishes the mini-batch in flight, saves, says so and exits 0;
    # --resume continues. Synchronous schedules (resnet, lstm) resume bit for bit into the uninterrupted run.
    # async-1f1b (vgg, transformer) drains the mini-batches it took first: its resume equals a run that drained
    # at that step (--steps), not the run that never stopped.
    args = [*SMALL, *CASES[name]]
    is_async = "async-1f1b" in args
    whole = step_losses(printed(name, [*args, "--epochs", "2"], capsys))
    assert sorted(whole) == list(range(1, 13)) and all(math.isfinite(v) for v in whole.values())
    checkpoints, logdir = tmp_path / "ckpt", tmp_path / "runs"
    also_every = [] if is_async else ["--save-every", "3"]  # a synchronous run also saves between steps
    output = stopped_by_sigterm(name, SIGNAL_AT, *args, "--epochs", "2", *also_every, "--checkpoint-dir",
                                str(checkpoints), "--logdir", str(logdir))
    first = step_losses(output)
    stop = max(first)
    assert f"stopped by SIGTERM at step {stop}; saved {checkpoints}" in output
    # Synchronous: the step in flight was the last. async-1f1b: the ones the stream had taken, drained.
    assert stop == SIGNAL_AT if not is_async else SIGNAL_AT <= stop < 12
    assert first == {step: whole[step] for step in range(1, stop + 1)}
    assert saved_steps(checkpoints) == [6, stop]  # retention keeps the two newest (sync: of steps 3, 6 and 8)
    assert scalars(logdir, "train/loss") == pytest.approx(list(first.values()), abs=1e-6)
    assert len(scalars(logdir, "val/accuracy")) == 1  # epoch 1; the stopped epoch 2 is not validated
    resumed = printed(name, [*args, "--epochs", "2", "--checkpoint-dir", str(checkpoints), "--resume"], capsys)
    assert f"resumed from {checkpoints} at step {stop}" in resumed
    assert latest_step(checkpoints) == 12 and "(12 steps)" in resumed.splitlines()[-1]
    if not is_async:  # the same data order, weights and optimizer state: bit for bit the rest of the whole run
        assert step_losses(resumed) == {step: whole[step] for step in range(stop + 1, 13)}
        return
    drained = tmp_path / "drained"
    printed(name, [*args, "--steps", str(stop), "--checkpoint-dir", str(drained)], capsys)
    expected = step_losses(printed(name, [*args, "--epochs", "2", "--checkpoint-dir", str(drained), "--resume"],
                                   capsys))
    assert step_losses(resumed) == expected and sorted(expected) == list(range(stop + 1, 13))


@pytest.mark.parametrize("flags", [["--resume"], ["--save-every", "10"]])
def test_flags_that_need_a_checkpoint_directory_say_so(flags, capsys):
    with pytest.raises(SystemExit) as exit:
        run_example("vgg", flags)
    assert exit.value.code == 2 and "--resume and --save-every need --checkpoint-dir" in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_stops_the_huggingface_example_and_the_resume_is_exact(tmp_path, capsys):
    # GPT-2 in bf16 with its learning-rate schedule and clipping (1f1b): stopped by SIGTERM after step 4 (of 6
    # in epoch 1), resumed with --resume, it ends with the bits of the uninterrupted run (weights; the
    # optimizer and schedule state are what make that possible).
    import pipetrain

    args = ["--stages", "2", "--train-samples", "96", "--val-samples", "32", "--batch-size", "16", "--partitioner",
            "params", "--model", "gpt2", "--width", "16", "--depth", "1", "--schedule", "1f1b", "--micro-batches",
            "2", "--epochs", "2", "--no-progress"]
    run_example("huggingface", [*args, "--checkpoint-dir", str(tmp_path / "whole")])
    checkpoints = tmp_path / "ckpt"
    output = stopped_by_sigterm("huggingface", 4, *args, "--checkpoint-dir", str(checkpoints))
    assert f"stopped by SIGTERM at step 4; saved {checkpoints}" in output and saved_steps(checkpoints) == [4]
    resumed = printed("huggingface", [*args, "--checkpoint-dir", str(checkpoints), "--resume"], capsys)
    assert f"resumed from {checkpoints} at step 4" in resumed and latest_step(checkpoints) == 12
    whole, after = pipetrain.export_state_dict(tmp_path / "whole"), pipetrain.export_state_dict(checkpoints)
    assert set(whole) == set(after) and all(torch.equal(whole[k], after[k]) for k in whole)

"""The example scripts run as users run them, `python examples/<name>.py ...` in a process of their own: a
checkpointed run and its resume give exactly the steps of one uninterrupted run, the losses are finite and
TensorBoard holds them."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _example_runs import CASES, EXAMPLES, run_example, scalars

# 96 samples in mini-batches of 16: 6 steps an epoch.
SMALL = ["--stages", "2", "--train-samples", "96", "--val-samples", "32", "--batch-size", "16",
         "--partitioner", "params", "--log-every", "1"]
SCRIPTS = ["vgg", "resnet", "transformer", "lstm"]

pytestmark = pytest.mark.usefixtures("one_thread")  # the scripts' processes run one thread too: the same bits


def run_script(name: str, *args: str) -> str:
    """What `python examples/<name>.py <args>` prints (it must succeed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def printed(name: str, args: list[str], capsys) -> str:
    """What examples/<name>.py prints when run in this process (cheaper than a process of its own: the
    uninterrupted reference runs)."""
    capsys.readouterr()
    run_example(name, args)
    return capsys.readouterr().out


def step_losses(output: str) -> dict[int, float]:
    """The `step N: loss X` lines a script printed, by step."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+): loss (\S+)$", output, re.MULTILINE)}


def latest_step(checkpoints: Path) -> int:
    return int((checkpoints / "latest").read_text().strip().removeprefix("step-"))


# How each script's first run stops, and its checkpoints: async-1f1b saves after an epoch (its stream drains
# there), a synchronous schedule also between two steps (--save-every).
FIRST_RUN = {"vgg": (["--epochs", "1"], [6]), "transformer": (["--epochs", "1"], [6]),
             "resnet": (["--steps", "4", "--save-every", "3"], [3, 4]),
             "lstm": (["--steps", "4", "--save-every", "3"], [3, 4])}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resumed_run_continues_the_uninterrupted_one(name, tmp_path, capsys):
    args = [*SMALL, *CASES[name]]
    whole = step_losses(printed(name, [*args, "--epochs", "2"], capsys))
    assert sorted(whole) == list(range(1, 13)) and all(math.isfinite(v) for v in whole.values())
    checkpoints, logdir = tmp_path / "ckpt", tmp_path / "runs"
    stop, saved = FIRST_RUN[name]
    first = step_losses(run_script(name, *args, *stop, "--checkpoint-dir", str(checkpoints), "--logdir", str(logdir)))
    assert first == {step: whole[step] for step in range(1, saved[-1] + 1)}
    assert sorted(checkpoints.glob("step-*")) == [checkpoints / f"step-{step:08d}" for step in saved]
    assert scalars(logdir, "train/loss") == pytest.approx(list(first.values()), abs=1e-6)
    assert len(scalars(logdir, "val/accuracy")) == 1
    resumed = run_script(name, *args, "--epochs", "2", "--checkpoint-dir", str(checkpoints), "--resume")
    assert f"resumed from {checkpoints} at step {saved[-1]}" in resumed
    # The same data order, weights and optimizer state: bit for bit the rest of the whole run.
    assert step_losses(resumed) == {step: whole[step] for step in range(saved[-1] + 1, 13)}
    assert latest_step(checkpoints) == 12 and "(12 steps)" in resumed.splitlines()[-1]


@pytest.mark.parametrize("flags", [["--resume"], ["--save-every", "10"]])
def test_flags_that_need_a_checkpoint_directory_say_so(flags, capsys):
    with pytest.raises(SystemExit) as exit:
        run_example("vgg", flags)
    assert exit.value.code == 2 and "--resume and --save-every need --checkpoint-dir" in capsys.readouterr().err

"""A run killed mid-training under torchrun --max-restarts resumes from its last checkpoint by itself; one
stopped by SIGTERM saves on every rank and resumes exactly."""
import pytest
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def torchrun(tmp_path, name, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(HERE / "resume_worker.py"), str(tmp_path / f"{name}-ckpt"),
           str(tmp_path / name), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_killed_run_restarts_and_ends_equal_to_an_uninterrupted_one(tmp_path):
    crashed = torchrun(tmp_path, "crashed")
    assert crashed.returncode == 0, crashed.stderr[-3000:]
    clean = torchrun(tmp_path, "clean", "--no-crash")
    assert clean.returncode == 0, clean.stderr[-3000:]
    for rank in range(2):
        a = torch.load(f"{tmp_path / 'crashed'}.rank{rank}", weights_only=False)
        b = torch.load(f"{tmp_path / 'clean'}.rank{rank}", weights_only=False)
        assert a["restarts"] == "1" and b["restarts"] == "0"  # the first run really was restarted
        for key, value in b["state"].items():
            assert torch.equal(a["state"][key], value), key


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_on_every_rank_and_the_resume_is_exact(tmp_path, one_thread):
    """torchrun forwards SIGTERM to both ranks; they agree on a mini-batch, save, exit 0, and the resume
    under a new torchrun ends equal to an uninterrupted run (the local engine, the reference)."""
    from preempt_worker import PAUSE_AT, config
    from test_training import assert_same_parameters, saved_step, sigterm_after_step, worker_env

    from pipetrain.apps.training import run

    root = tmp_path / "ckpt"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              str(HERE / "preempt_worker.py"), str(root)]
    status, output = sigterm_after_step([*launch, str(tmp_path / "stopped"), "1f1b", "distributed"], PAUSE_AT)
    stopped = [torch.load(f"{tmp_path / 'stopped'}.rank{r}") for r in range(2)]  # written after run() returned
    assert all(s["preempted"] for s in stopped), output
    # The signal came during the pause after step 8's report, so the request rode in step 9's report.
    assert saved_step(root) == PAUSE_AT + 1 == len(stopped[0]["losses"]) == len(stopped[1]["losses"])
    resumed = subprocess.run([*launch, str(tmp_path / "resumed"), "1f1b", "distributed", "--resume"],
                             env=worker_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    losses = torch.load(f"{tmp_path / 'resumed'}.rank0")["losses"]
    whole = run(config("1f1b", "local", checkpoint_dir=str(tmp_path / "whole")))
    assert stopped[0]["losses"] + losses == whole.step_losses
    assert_same_parameters(root, tmp_path / "whole")

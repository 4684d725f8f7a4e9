"""A run killed mid-training under torchrun --max-restarts resumes from its last checkpoint by itself."""
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

"""An example script launched by torchrun itself (2 processes), the way users run it: it trains,
rank 0 alone prints the summary, and the per-epoch checkpoint is written."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _example_runs import CASES, COMMON, EXAMPLES


def test_script_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "vgg.py"), *COMMON, *CASES["vgg"],
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = [line for line in done.stdout.splitlines() if "max val accuracy" in line]
    assert len(summary) == 1 and "2 epochs (24 steps)" in summary[0]  # printed by rank 0 only
    assert (tmp_path / "ckpt" / "latest").exists()

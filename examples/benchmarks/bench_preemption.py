"""How long a training run takes to stop on SIGTERM: to its checkpoint, and to its exit.

    .venv/bin/python examples/benchmarks/bench_preemption.py [--ranks 2] [--delay 0.3] [--repeats 3]

Starts ``examples/vgg.py`` (digits, 4 stages x 4 micro-batches, 3 epochs; under ``torchrun`` with
``--ranks`` > 1, one stage per rank) with ``--checkpoint-dir`` in a temporary directory, sends
SIGTERM ``--delay`` seconds after the first epoch's line (so inside the second epoch) to the
process (torchrun itself with --ranks), and prints per repeat: the seconds from the signal to the
"stopped by SIGTERM" line (checkpoint published), to the process's exit, its exit status and the
step ``latest`` names. For comparison it also times a bare ``import torch`` process's exit.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stop_once(cmd: list[str], delay: float) -> tuple[float, float, int]:
    """Run ``cmd``, SIGTERM it ``delay`` s after epoch 1's line: (s to the stop line, s to exit, status)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    sent = stopped = None
    for line in proc.stdout:
        if sent is None and line.startswith("epoch 1:"):
            time.sleep(delay)
            sent = time.perf_counter()
            proc.send_signal(signal.SIGTERM)
        elif sent is not None and "stopped by SIGTERM" in line:
            stopped = time.perf_counter() - sent
    proc.wait()
    if sent is None or stopped is None:
        raise SystemExit(f"the run ended without being stopped (status {proc.returncode}): {' '.join(cmd)}")
    return stopped, time.perf_counter() - sent, proc.returncode


def bare_exit_seconds() -> float:
    """Seconds from a bare ``import torch`` process's last output to its exit (interpreter teardown)."""
    proc = subprocess.Popen([sys.executable, "-c", "import torch; print('ready', flush=True)"],
                            stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    start = time.perf_counter()
    proc.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1, help="1: one process; more: torchrun --nproc-per-node")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds into the second epoch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    stages = 4 if args.ranks == 1 else args.ranks
    launch = ([sys.executable] if args.ranks == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)])
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as root:
            cmd = [*launch, "examples/vgg.py", "--stages", str(stages), "--micro-batches", "4", "--epochs", "3",
                   "--checkpoint-dir", root]
            stopped, exited, status = stop_once(cmd, args.delay)
            step = (Path(root) / "latest").read_text().strip()
        print(f"run {repeat + 1}: checkpoint {stopped:.2f} s after SIGTERM, exit after {exited:.2f} s "
              f"(status {status}), latest = {step}", flush=True)
    print(f"a bare 'import torch' process exits {bare_exit_seconds():.2f} s after its last output")


if __name__ == "__main__":
    main()

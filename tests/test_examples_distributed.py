"""The example scripts on the distributed engine (2 processes, one stage each): they train, loss
goes down, only rank 0 logs."""
from __future__ import annotations

import pytest
from pathlib import Path

import torch.distributed as dist

from _example_runs import CASES, COMMON, decreased, run_example, scalars
from dist_harness import run_world


def train_all(rank: int, world: int, logdir: str) -> dict[str, list[float]]:
    """Every example on this rank; rank 0 reads back each run's per-step train losses."""
    out = {}
    for name, extra in CASES.items():
        run_example(name, [*COMMON, *extra, "--logdir", f"{logdir}/{name}"])
        dist.barrier()
        out[name] = scalars(Path(logdir) / name, "train/loss") if rank == 0 else []
    return out


@pytest.mark.slow
def test_examples_train_on_two_processes(tmp_path):
    logdir = tmp_path / "runs"
    rank0, rank1 = run_world(2, "test_examples_distributed", "train_all", tmp_path / "world", str(logdir))
    for name, losses in rank0.items():
        assert len(losses) == 2 * (192 // 16), name
        assert decreased(losses), (name, losses)
    assert all(v == [] for v in rank1.values())
    # Only rank 0 writes TensorBoard files.
    assert all(len(list((logdir / name).glob("events.*"))) == 2 for name in CASES)


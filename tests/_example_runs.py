"""Shared by the example tests: run an examples/ script in-process and read its TensorBoard losses."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Tiny settings per script: (script, extra args). Each also covers a different schedule.
CASES = {
    "vgg": ["--width", "4", "--schedule", "async-1f1b", "--staleness", "spectrain", "--micro-batches", "1"],
    "resnet": ["--width", "4", "--depth", "8", "--schedule", "1f1b", "--micro-batches", "2"],
    "transformer": ["--width", "16", "--depth", "2", "--schedule", "async-1f1b", "--staleness", "stash",
                    "--micro-batches", "2", "--lr", "0.05"],
    "lstm": ["--width", "8", "--depth", "2", "--schedule", "gpipe", "--micro-batches", "2", "--lr", "0.2"],
    "huggingface": ["--model", "gpt2", "--width", "16", "--depth", "1", "--schedule", "async-1f1b", "--staleness",
                    "stash", "--micro-batches", "2", "--lr", "0.1"],  # bf16 (the script's default) with padding
}
COMMON = ["--stages", "2", "--train-samples", "192", "--val-samples", "48", "--batch-size", "16", "--epochs", "2",
          "--partitioner", "params", "--no-progress"]


def run_example(name: str, extra: list[str]) -> None:
    """Run examples/<name>.py as `python examples/<name>.py <args>` would, in this process (with examples/ on
    sys.path, as python puts a script's folder there: the scripts import their shared _common)."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(EXAMPLES / f"{name}.py"), *extra]
    sys.path.insert(0, str(EXAMPLES))
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path


def scalars(run_dir: Path, tag: str) -> list[float]:
    """Values of one scalar tag in a TensorBoard run directory, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)]


def decreased(losses: list[float]) -> bool:
    """The mean loss of the second half of the steps is below that of the first half (single mini-batches of 16
    are too noisy to compare a few steps)."""
    half = len(losses) // 2
    return sum(losses[half:]) / (len(losses) - half) < sum(losses[:half]) / half

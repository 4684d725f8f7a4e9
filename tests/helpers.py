"""Helpers shared by the test modules and by the ranks they spawn (which cannot take pytest fixtures)."""
from __future__ import annotations

import contextlib
import copy
import runpy
import sys
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

import partitioners
import pipetrain
from runtime_models import data

ROOT = Path(__file__).resolve().parents[1]


def wrap_unprofiled(model: nn.Module, example_inputs, **options) -> pipetrain.Pipeline:
    """``pipetrain.wrap`` with ``profile=False`` unless ``options`` say otherwise.

    Profiling times each node on this machine; with it off the partitioner prices nodes from their
    estimated cost, so a test gets the same split on every run however loaded the machine is."""
    return pipetrain.wrap(model, example_inputs, **{"profile": False, **options})


def batches(name: str, steps: int = 3, size: int = 8, *, last: int | None = None, seed: int = 1,
            draw_per_step: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` mini-batches of ``size`` rows of ``data(name, ...)``.

    By default they are consecutive slices of one draw of ``steps * size`` rows with ``seed``;
    ``last``: the final mini-batch has that many rows instead (the ranks must re-agree boundary shapes).
    ``draw_per_step``: mini-batch i is its own draw of ``size`` rows with seed ``seed + i``."""
    if draw_per_step:
        return [data(name, size, seed=seed + i) for i in range(steps)]
    x, y = data(name, steps * size, seed=seed)
    sizes = [size] * (steps - 1) + [size if last is None else last]
    starts = [sum(sizes[:i]) for i in range(steps)]
    return [(x[s:s + n], y[s:s + n]) for s, n in zip(starts, sizes)]


@contextlib.contextmanager
def capture_once(monkeypatch, captures: dict, key: Any) -> Iterator[None]:
    """Within the block, ``wrap`` captures the model only the first time ``captures`` sees ``key`` (with the
    same profile and autocast arguments) and partitions a copy of that capture afterwards: a copy, so every
    pipeline gets its own tensors. ``key`` must name the same model (class, config and seed) and example
    inputs: torch.export takes most of a small Hugging Face model's time, and its graph does not depend on
    the stage count or the engine it is partitioned for, nor on the checkpoint a meta model is loaded from."""
    capture = partitioners.trace_for_training

    def once(model, example_inputs, profile, autocast=None):
        full = (key, profile, autocast)
        if full not in captures:
            captures[full] = copy.deepcopy(capture(model, example_inputs, profile, autocast))
        return copy.deepcopy(captures[full])

    with monkeypatch.context() as patch:
        patch.setattr(partitioners, "trace_for_training", once)
        yield


def run_script_here(script: Path, *args: str, capsys, monkeypatch) -> str:
    """What `python SCRIPT ARGS` prints from the repository root, run in this process as python would run it (its
    folder on sys.path): for a script whose own process only computes, or starts its ranks by command line (its
    functions are not sent to spawned processes, which cannot import a runpy __main__). A seed or a thread count
    the script sets stays its own."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{script.name}: exit {done.code}"
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out


def optimizer_collectives(pipe: pipetrain.Pipeline) -> list[int]:
    """The collectives each optimizer step of this rank's stages runs, one count per step, filled as they step."""
    from torch.distributed.tensor.debug import CommDebugMode  # ~1 s to import: only where collectives are counted

    counts: list[int] = []
    for rt in pipe.held_stages.values():
        mode: dict = {}

        def enter(optimizer, args, kwargs, mode=mode) -> None:
            mode["now"] = CommDebugMode()
            mode["now"].__enter__()

        def leave(optimizer, args, kwargs, mode=mode) -> None:
            done = mode.pop("now")
            done.__exit__(None, None, None)
            counts.append(done.get_total_counts())
        rt.optimizer.register_step_pre_hook(enter)
        rt.optimizer.register_step_post_hook(leave)
    return counts

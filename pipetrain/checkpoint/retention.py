"""Publishing a step and retention: ``latest`` flips only to a complete step, never below a newer one already
published in the directory (another run's), and retention never removes what ``latest`` names, so neither a
rerun nor a rollback can lose a run silently."""
from __future__ import annotations

import shutil
from pathlib import Path

from pipetrain.checkpoint.durable import atomic_write_text, fsync_dir
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.layout import STEP_NAME, is_complete, step_dir, step_dirs


KEEP = 2  # complete checkpoints kept; older step directories are removed after a successful save


def published_step(root: Path) -> int | None:
    """The step ``latest`` names, or when there is no ``latest`` the newest complete step directory."""
    pointer = root / "latest"
    if pointer.exists():
        match = STEP_NAME.fullmatch(pointer.read_text().strip())
        if match:
            return int(match.group(1))
    complete = [s for s, p in step_dirs(root).items() if is_complete(p)]
    return max(complete, default=None)


def refuse_older_step(root: Path, step: int) -> None:
    """Refuse to save ``step`` under ``root`` when a newer checkpoint is already published there.

    That checkpoint belongs to another run (a rerun without --resume) or to the future of a
    rollback; publishing an older step would hide it behind ``latest`` and retention would delete
    it. Every rank calls this from the same directory listing before anything is written, so all
    ranks raise together and none waits in a barrier for a rank that gave up."""
    newest = published_step(root)
    if newest is not None and newest > step:
        raise CheckpointError(
            f"{root} already holds a checkpoint of step {newest}, newer than the step {step} this pipeline is "
            f"saving: it belongs to another run (or this pipeline was rolled back to an older step). Nothing "
            f"was written. To continue that run, resume from it first (the example scripts' --resume, "
            f"or pipe.resume({str(root)!r})); "
            f"to start over or branch off, save into another directory (--checkpoint-dir), or delete "
            f"{root}/step-* and {root}/latest yourself if that run is not needed.")


def publish(root: Path, step: int) -> None:
    """Point ``latest`` at ``step`` durably."""
    fsync_dir(root)  # the step directory's entry is on disk before ``latest`` names it
    atomic_write_text(step_dir(root, step).name, root / "latest")
    fsync_dir(root)  # the flip itself is durable before anything older is removed


def unpublish(root: Path, previous: str | None) -> None:
    """Point ``latest`` back at ``previous`` (a step directory's name; None: no ``latest``), after a publish
    the other ranks did not agree to."""
    if previous is None:
        (root / "latest").unlink(missing_ok=True)
    else:
        atomic_write_text(previous, root / "latest")
    fsync_dir(root)


def prune(root: Path, step: int) -> None:
    """Drop checkpoints older than ``step``, keeping KEEP complete ones. Never removes the step just published
    nor anything above it: retention must not delete what ``latest`` names, and a newer directory is an
    interrupted save that a later one overwrites."""
    older = sorted((s, p) for s, p in step_dirs(root).items() if s < step)
    keep = {s for s, p in older if is_complete(p)}
    keep = set(sorted(keep)[len(keep) - (KEEP - 1):]) if KEEP > 1 else set()
    for s, p in older:
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)

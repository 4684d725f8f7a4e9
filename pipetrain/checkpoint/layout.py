"""Where a checkpoint lies in its directory ``root``::

    root/step-00000012/stage0.pt ... stageN.pt, manifest.json
    root/latest          # names the newest complete step directory; replaced atomically

A step directory is complete once its manifest is written; ``latest`` names the one to load.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from pipetrain.checkpoint.errors import CheckpointError


STEP_NAME = re.compile(r"step-(\d+)")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def step_dirs(root: Path) -> dict[int, Path]:
    """The step directories under ``root`` by step number (complete or not)."""
    found = {}
    for p in root.glob("step-*"):
        match = STEP_NAME.fullmatch(p.name)
        if match and p.is_dir():
            found[int(match.group(1))] = p
    return found


def is_complete(path: Path) -> bool:
    return (path / "manifest.json").exists()


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none).

    Raises CheckpointError when ``latest`` names a step directory that is gone or has no
    manifest: resuming must not silently start from scratch over a damaged run."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    path = Path(root) / name
    if not STEP_NAME.fullmatch(name) or not is_complete(path):
        raise CheckpointError(
            f"{pointer} names {name!r}, but {path / 'manifest.json'} does not exist: the checkpoint was damaged "
            f"or removed by hand. Nothing was loaded or changed. {alternatives(Path(root), exclude=path)}")
    return path


def alternatives(root: Path, exclude: Path | None = None) -> str:
    """What to do instead of loading a broken checkpoint: the other complete ones under ``root``."""
    others = [p for _, p in sorted(step_dirs(root).items(), reverse=True) if p != exclude and is_complete(p)]
    if others:
        return (f"Load another checkpoint by its step directory, e.g. pipe.load({str(others[0])!r}) or "
                f"pipetrain.export_state_dict({str(others[0])!r}) (complete ones here: "
                f"{', '.join(p.name for p in others)}), or start over in a new directory.")
    return "There is no other complete checkpoint here: start over in a new directory."


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The step directory to load for ``path``: what ``path/latest`` names, or ``path`` itself."""
    source = latest(path) or Path(path)
    if not is_complete(source):
        if list(source.glob("stage*.pt")):
            raise CheckpointError(
                f"{source} has stage files but no manifest.json: its save was interrupted, so it is incomplete. "
                f"Nothing was loaded or changed. {alternatives(source.parent, exclude=source)}")
        raise FileNotFoundError(f"no checkpoint under {path}: expected {path}/latest or a manifest.json")
    return source


def latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.exists() else None

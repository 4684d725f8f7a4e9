"""Checkpoints: one file per stage plus a manifest, written so that a crash never corrupts the last one.

Layout of a checkpoint directory ``root``::

    root/step-00000012/stage0.pt ... stageN.pt, manifest.json
    root/latest          # names the newest complete step directory; replaced atomically

Files are written under a temporary name and renamed; ``latest`` flips only after every
rank finished, so a save interrupted at any point leaves the previous checkpoint loadable.
Optimizer state is stored by parameter name, so a checkpoint loads into another stage
count or engine (re-partitioned) and ``export_state_dict`` gives the unsplit model's dict.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

FORMAT = 1
KEEP = 2  # complete checkpoints kept; older step directories are removed after a successful save


def atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "manifest.json").exists() else None


def publish(root: Path, step: int) -> None:
    """Point ``latest`` at ``step`` and drop checkpoints older than the last KEEP."""
    atomic_write_text(step_dir(root, step).name, root / "latest")
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def optimizer_state_by_name(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict:
    """Optimizer state keyed by parameter name instead of position (survives re-partitioning)."""
    if optimizer is None:
        return {"state": {}, "groups": []}
    state = {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]
             if p in optimizer.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "groups": groups}


def load_optimizer_state(optimizer: torch.optim.Optimizer | None, by_name: dict[str, dict],
                         groups: list[dict], names: dict[int, str]) -> None:
    """Put each parameter's saved state back, by name; hyper-parameters from the saved groups."""
    if optimizer is None:
        return
    for g, saved in zip(optimizer.param_groups, groups):
        g.update({k: v for k, v in saved.items() if k in g})
    for g in optimizer.param_groups:
        for p in g["params"]:
            state = by_name.get(names[id(p)])
            if state is not None:
                optimizer.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                                      for k, v in state.items()}


def read_manifest(path: Path) -> dict:
    manifest = json.loads((path / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is a checkpoint of format {manifest.get('format')}, this pipetrain reads {FORMAT}")
    return manifest


def read_stage_files(path: Path, manifest: dict) -> list[dict]:
    return [torch.load(path / f"stage{v}.pt", weights_only=True, map_location="cpu")
            for v in range(manifest["stages"])]


def export_state_dict(root: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict from the newest checkpoint under ``root`` (original names)."""
    path = latest(root) or Path(root)
    if not (path / "manifest.json").exists():
        raise FileNotFoundError(f"no checkpoint under {root}: expected {root}/latest or a manifest.json")
    manifest = read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    for stage in read_stage_files(path, manifest):
        out.update(stage["module"])
    return out

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
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from partitioners import Plan
from pipetrain.options import PipelineOptions
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.staleness import StalenessPolicy

FORMAT = 1
KEEP = 2  # complete checkpoints kept; older step directories are removed after a successful save


@dataclass
class StageState:
    """What a checkpoint stores of one stage and restores into it."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    policy: StalenessPolicy  # its ``updates`` count is saved and restored
    scaler: DynamicLossScaler | None  # the fp16 loss scaler of the stage's device


@dataclass
class CheckpointRole:
    """This process's part in a save: which files it writes and how it waits for the others."""

    writes_stages: bool    # replicas hold identical stages: only replica 0 writes them
    writes_manifest: bool  # one process publishes the step
    engine: str            # "local" | "distributed", recorded in the manifest
    barrier: Callable[[], None]
    streaming: bool        # an async-1f1b stream is running: micro-batches are in flight


class Checkpointable(Protocol):
    """What ``save_pipeline`` and ``load_pipeline`` need of a pipeline (pipetrain.Pipeline)."""

    plan: Plan
    options: PipelineOptions
    updates: int

    def checkpoint_stages(self) -> dict[int, StageState]:
        """The stages this process holds, by virtual stage index."""

    def checkpoint_role(self) -> CheckpointRole:
        """This process's part in a save."""


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


def save_pipeline(pipe: Checkpointable, path: str | os.PathLike) -> Path:
    """Write ``pipe``'s checkpoint of its current step under ``path`` and publish it."""
    role = pipe.checkpoint_role()
    if role.streaming:
        raise RuntimeError("save() was called while train() streams async-1f1b mini-batches; micro-batches "
                           "are in flight then. Save between train() calls (the pipeline drains when the "
                           "stream ends), e.g. train on an epoch, save, train on the next")
    root = Path(path)
    target = step_dir(root, pipe.updates)
    target.mkdir(parents=True, exist_ok=True)
    if role.writes_stages:
        for v, stage in pipe.checkpoint_stages().items():
            atomic_save(_stage_payload(stage), target / f"stage{v}.pt")
    role.barrier()
    if role.writes_manifest:
        atomic_write_text(json.dumps(_manifest(pipe, role), indent=1), target / "manifest.json")
        publish(root, pipe.updates)
    role.barrier()
    return target


def load_pipeline(pipe: Checkpointable, path: str | os.PathLike) -> None:
    """Load the newest checkpoint under ``path`` into ``pipe``, whatever stage layout saved it."""
    source = latest(path) or Path(path)
    if not (source / "manifest.json").exists():
        raise FileNotFoundError(f"no checkpoint under {path}: expected {path}/latest or a manifest.json")
    manifest = read_manifest(source)
    same_layout = manifest["plan_layout"] == _plan_layout(pipe)
    stages = pipe.checkpoint_stages()
    wanted = sorted(stages) if same_layout else range(manifest["stages"])
    files = {v: torch.load(source / f"stage{v}.pt", weights_only=True, map_location="cpu") for v in wanted}
    module_state = {k: t for f in files.values() for k, t in f["module"].items()}
    optimizer_state = {k: st for f in files.values() for k, st in f["optimizer"]["state"].items()}
    groups = next((f["optimizer"]["groups"] for f in files.values() if f["optimizer"]["groups"]), [])
    for v, stage in stages.items():
        own = stage.module.state_dict()
        problems = [k for k in own if k not in module_state or module_state[k].shape != own[k].shape]
        if problems:
            k = problems[0]
            found = tuple(module_state[k].shape) if k in module_state else "nothing"
            raise ValueError(f"checkpoint {source} does not fit this model: {k} has shape {tuple(own[k].shape)} "
                             f"here but {found} in the checkpoint ({len(problems)} mismatching entries); "
                             "load a checkpoint of the same model")
        stage.module.load_state_dict({k: module_state[k] for k in own})
        load_optimizer_state(stage.optimizer, optimizer_state, groups, _param_names(stage.module))
        stage.policy.updates = files[v]["updates"] if same_layout else manifest["step"]
    scaler_state = next(iter(files.values()))["scaler"]
    for stage in stages.values():
        if stage.scaler is not None and scaler_state:
            stage.scaler.load_state_dict(scaler_state)
    if same_layout and stages:
        torch.set_rng_state(files[min(stages)]["rng"])
    pipe.updates = manifest["step"]


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def _stage_payload(stage: StageState) -> dict:
    return {"module": stage.module.state_dict(),
            "optimizer": optimizer_state_by_name(stage.optimizer, _param_names(stage.module)),
            "updates": stage.policy.updates, "scaler": stage.scaler.state_dict() if stage.scaler is not None else {},
            "rng": torch.get_rng_state()}


def _plan_layout(pipe: Checkpointable) -> list:
    """What decides which parameters a stage file holds."""
    plan = json.loads(pipe.plan.to_json())
    return [plan["order"], plan["cuts"]]


def _manifest(pipe: Checkpointable, role: CheckpointRole) -> dict:
    o = pipe.options
    return {"format": FORMAT, "step": pipe.updates, "stages": pipe.plan.num_stages,
            "devices": o.stages, "data_parallel": o.data_parallel, "plan_layout": _plan_layout(pipe),
            "plan": pipe.plan.to_json(), "schedule": o.schedule, "staleness": o.staleness,
            "micro_batches": o.micro_batches, "precision": o.precision,
            "engine": role.engine,
            "versions": {"pipetrain": version("pipetrain"), "torch": torch.__version__}}

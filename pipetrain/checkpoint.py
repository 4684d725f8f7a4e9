"""Checkpoints: one file per stage plus a manifest, written so that a crash never corrupts the last one.

Layout of a checkpoint directory ``root``::

    root/step-00000012/stage0.pt ... stageN.pt, manifest.json
    root/latest          # names the newest complete step directory; replaced atomically

Files are written under a temporary name, fsynced and renamed, and the directories are fsynced
before and after ``latest`` flips; ``latest`` flips only after every rank finished, so a save
interrupted at any point (even by a power cut) leaves the previous checkpoint loadable. The
manifest records each stage file's size and sha256, so a truncated, corrupted or mixed-up file is
refused with an error that names it instead of being loaded. Retention never removes the
checkpoint ``latest`` names, and a save refuses to go below a newer checkpoint already published
in the directory (another run's), so neither a rerun nor a rollback can lose a run silently.
Optimizer state is stored by parameter name, so a checkpoint loads into another stage
count or engine (re-partitioned) and ``export_state_dict`` gives the unsplit model's dict.

No process ever holds the whole model: the manifest lists the names each stage file holds, so a load
opens only the files its stages need, and memory-maps them (a tensor is paged in when it is copied into
the stage). It also records the model's canonical names and Hugging Face config, from which
``pipetrain export --hf`` writes a ``from_pretrained`` directory one stage file at a time.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from partitioners import Plan
from pipetrain.options import PipelineOptions
from pipetrain.pretrained import CONFIG, MAX_SHARD_BYTES, ShardWriter, write_index
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.staleness import StalenessPolicy

if TYPE_CHECKING:
    from pipetrain.pretrained import PretrainedLayout

FORMAT = 1
KEEP = 2  # complete checkpoints kept; older step directories are removed after a successful save
STEP_NAME = re.compile(r"step-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; the message names the file and the fix."""


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
    # ZeRO: each replica holds the optimizer state of the tensors it owns; this merges the replicas' shares
    # (by name) onto replica 0, collectively over the stage's replicas, so the file holds the whole state and
    # loads at any zero level or replica count. None without ZeRO.
    merge_optimizer: Callable[[dict], dict | None] | None = None


@dataclass
class PipelineView:
    """What ``save_pipeline`` and ``load_pipeline`` read of a pipeline (``Pipeline`` builds it from its parts)."""

    plan: Plan
    options: PipelineOptions
    updates: int                   # optimizer steps taken: the step a save is filed under
    stages: dict[int, StageState]  # the stages this process holds, by virtual stage index
    role: CheckpointRole
    pretrained: PretrainedLayout   # canonical names and config, recorded for `pipetrain export --hf`


def load_module_state(stages: dict[int, torch.nn.Module], state: dict[str, torch.Tensor], strict: bool,
                      partial: bool) -> None:
    """Load original-model names into the stage modules that hold them; ``partial``: this process holds a
    share of the model (keys of other stages are expected)."""
    used = set()
    for v, module in stages.items():
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        if missing and strict:
            raise KeyError(f"state dict lacks {missing[:5]}{'...' if len(missing) > 5 else ''} "
                           f"needed by stage {v}; is it from the same model?")
        module.load_state_dict({k: state[k] for k in own if k in state}, strict=strict)
        used.update(own)
    extra = [k for k in state if k not in used]
    if extra and strict and not partial:
        raise KeyError(f"state dict has keys no stage holds: {extra[:5]}; is it from the same model?")


def atomic_save(obj: Any, path: Path) -> str:
    """``torch.save`` ``obj`` to ``path`` atomically and durably; returns "<sha256> <bytes>" of the file."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getbuffer()
    _write_durably(data, path)
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}"


def atomic_write_text(text: str, path: Path) -> None:
    """Write ``text`` to ``path`` atomically and durably."""
    _write_durably(text.encode(), path)


def _write_durably(data: bytes | memoryview, path: Path) -> None:
    # fsync before the rename: otherwise a power cut can leave the new name pointing at an empty file.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _complete(path: Path) -> bool:
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
    if not STEP_NAME.fullmatch(name) or not _complete(path):
        raise CheckpointError(
            f"{pointer} names {name!r}, but {path / 'manifest.json'} does not exist: the checkpoint was damaged "
            f"or removed by hand. Nothing was loaded or changed. {_alternatives(Path(root), exclude=path)}")
    return path


def _alternatives(root: Path, exclude: Path | None = None) -> str:
    """What to do instead of loading a broken checkpoint: the other complete ones under ``root``."""
    others = [p for _, p in sorted(step_dirs(root).items(), reverse=True) if p != exclude and _complete(p)]
    if others:
        return (f"Load another checkpoint by its step directory, e.g. pipe.load({str(others[0])!r}) or "
                f"pipetrain.export_state_dict({str(others[0])!r}) (complete ones here: "
                f"{', '.join(p.name for p in others)}), or start over in a new directory.")
    return "There is no other complete checkpoint here: start over in a new directory."


def published_step(root: Path) -> int | None:
    """The step ``latest`` names, or when there is no ``latest`` the newest complete step directory."""
    pointer = root / "latest"
    if pointer.exists():
        match = STEP_NAME.fullmatch(pointer.read_text().strip())
        if match:
            return int(match.group(1))
    complete = [s for s, p in step_dirs(root).items() if _complete(p)]
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
            f"was written. To continue that run, resume from it first (--resume auto, or pipe.load({str(root)!r})); "
            f"to start over or branch off, save into another directory (--checkpoint-dir), or delete "
            f"{root}/step-* and {root}/latest yourself if that run is not needed.")


def publish(root: Path, step: int) -> None:
    """Point ``latest`` at ``step`` and drop older checkpoints, keeping KEEP complete ones.

    Never removes the step just published nor anything above it: retention must not delete what
    ``latest`` names, and a newer directory is an interrupted save that a later one overwrites."""
    fsync_dir(root)  # the step directory's entry is on disk before ``latest`` names it
    atomic_write_text(step_dir(root, step).name, root / "latest")
    fsync_dir(root)  # the flip itself is durable before anything older is removed
    older = sorted((s, p) for s, p in step_dirs(root).items() if s < step)
    keep = {s for s, p in older if _complete(p)}
    keep = set(sorted(keep)[len(keep) - (KEEP - 1):]) if KEEP > 1 else set()
    for s, p in older:
        if s not in keep:
            shutil.rmtree(p, ignore_errors=True)


def optimizer_state_by_name(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict:
    """Optimizer state keyed by parameter name instead of position (survives re-partitioning)."""
    if optimizer is None:
        return {"state": {}, "groups": []}
    state = {names[id(p)]: optimizer.state[p] for g in optimizer.param_groups for p in g["params"]
             if p in optimizer.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "groups": groups}


def merge_optimizer_shares(shares: list[dict]) -> dict:
    """One stage's optimizer state by name from the replicas' ZeRO shares (each holds the names it owns)."""
    state = {name: value for share in shares for name, value in share["state"].items()}
    groups = next((share["groups"] for share in shares if share["groups"]), [])
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
                optimizer.state[p] = {k: _owned(v, p.device) for k, v in state.items()}


def _owned(value: Any, device: torch.device) -> Any:
    """A saved optimizer value in memory of its own, not in the memory-mapped stage file (retention deletes
    it later): per-parameter tensors on the parameter's device, scalars (Adam's step) on the CPU."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, copy=True) if value.dim() > 0 else value.clone()


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The step directory to load for ``path``: what ``path/latest`` names, or ``path`` itself."""
    source = latest(path) or Path(path)
    if not _complete(source):
        if list(source.glob("stage*.pt")):
            raise CheckpointError(
                f"{source} has stage files but no manifest.json: its save was interrupted, so it is incomplete. "
                f"Nothing was loaded or changed. {_alternatives(source.parent, exclude=source)}")
        raise FileNotFoundError(f"no checkpoint under {path}: expected {path}/latest or a manifest.json")
    return source


def read_manifest(path: Path) -> dict:
    """The manifest of step directory ``path``, checked for the fields a load needs."""
    file = path / "manifest.json"
    try:
        manifest = json.loads(file.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        missing = [k for k in ("format", "step", "stages", "plan_layout", "files") if k not in manifest]
        if missing:
            raise ValueError(f"lacks {missing}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} is not a pipetrain manifest ({exc}): it is truncated, corrupted or not "
                              f"one. Nothing was loaded or changed. {_alternatives(path.parent, exclude=path)}"
                              ) from exc
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"{path} is a checkpoint of format {manifest['format']}, this pipetrain reads {FORMAT}")
    return manifest


def read_stage_file(path: Path, v: int, manifest: dict) -> dict:
    """Stage ``v``'s file of step directory ``path``, verified against the manifest's size and sha256.

    The file is hashed in chunks and then memory-mapped, so its tensors are paged in only where they are
    used: reading a stage never holds a copy of it in memory."""
    file = path / f"stage{v}.pt"
    fix = f"Nothing was loaded or changed. {_alternatives(path.parent, exclude=path)}"
    digest, size = manifest["files"][file.name].split()
    try:
        with open(file, "rb") as f:
            found = os.fstat(f.fileno()).st_size
            # A file of the wrong size cannot match: no need to read it through.
            matches = found == int(size) and hashlib.file_digest(f, "sha256").hexdigest() == digest
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing, though {path / 'manifest.json'} lists {manifest['stages']} "
                              f"stage files. {fix}") from None
    if not matches:
        raise CheckpointError(
            f"{file} does not match {path / 'manifest.json'} ({found} bytes, the manifest recorded {size}; "
            f"sha256 differs): the file is truncated or corrupted, or the manifest and the file come from "
            f"different saves. {fix}")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a damaged zip; one clear error instead
        raise CheckpointError(f"{file} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]}): it is "
                              f"truncated or corrupted. {fix}") from exc


def read_stage_files(path: Path, manifest: dict) -> list[dict]:
    return [read_stage_file(path, v, manifest) for v in range(manifest["stages"])]


def export_state_dict(root: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict from the newest checkpoint under ``root`` (original names)."""
    path = checkpoint_dir(root)
    manifest = read_manifest(path)
    out: dict[str, torch.Tensor] = {}
    for stage in read_stage_files(path, manifest):
        out.update(stage["module"])
    return out


@dataclass(frozen=True)
class PretrainedExport:
    """What ``export_pretrained`` wrote."""

    directory: Path
    shards: list[str]  # the safetensors files, in order
    has_config: bool   # False: the checkpoint records no Hugging Face config, no config.json was written


def export_pretrained(root: str | os.PathLike, out: str | os.PathLike,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> PretrainedExport:
    """Write the newest checkpoint under ``root`` (or that step directory) as the Hugging Face directory ``out``.

    Stage files are read one at a time, memory-mapped, and each tensor is written once under its canonical
    name, so this process holds at most the tensors of one stage file and one shard being filled."""
    source = checkpoint_dir(root)
    manifest = read_manifest(source)
    canonical = manifest.get("canonical", {})  # older checkpoints: every name is written as it is
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    shards = ShardWriter(directory, max_shard_bytes)
    for v in range(manifest["stages"]):
        # Nothing of a stage file outlives this statement (the writer copies what it keeps): its mapping is
        # gone before the next file opens.
        shards.add(_unwritten(read_stage_file(source, v, manifest)["module"], canonical, shards.shard_of))
    total = shards.close()
    weight_map = shards.finish(0, total)
    write_index(directory, [(weight_map, shards.size)], total)
    config = manifest.get("hf_config")
    if config is not None:
        (directory / CONFIG).write_text(config)
    return PretrainedExport(directory, sorted(set(weight_map.values())), config is not None)


def _unwritten(state: dict[str, torch.Tensor], canonical: dict[str, str],
               written: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``state``'s tensors under their canonical names, each once, less the names already ``written``."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if canonical.get(name, name) not in written:
            out.setdefault(canonical.get(name, name), t)
    return out


def save_pipeline(pipe: PipelineView, path: str | os.PathLike) -> Path:
    """Write ``pipe``'s checkpoint of its current step under ``path`` and publish it."""
    role = pipe.role
    if role.streaming:
        raise RuntimeError("save() was called while train() streams async-1f1b mini-batches; micro-batches "
                           "are in flight then. Save between train() calls (the pipeline drains when the "
                           "stream ends), e.g. train on an epoch, save, train on the next")
    root = Path(path)
    if root.exists():
        refuse_older_step(root, pipe.updates)  # before any write, on every rank alike
    target = step_dir(root, pipe.updates)
    new_root = not root.exists()
    target.mkdir(parents=True, exist_ok=True)
    if new_root:
        fsync_dir(root.parent)
    merged = {}
    if role.merge_optimizer is not None:  # every replica takes part, in stage order
        for v, stage in sorted(pipe.stages.items()):
            merged[v] = role.merge_optimizer(optimizer_state_by_name(stage.optimizer, _param_names(stage.module)))
    if role.writes_stages:
        for v, stage in pipe.stages.items():
            payload = _stage_payload(stage)
            if v in merged:
                payload["optimizer"] = merged[v]
            entry = {"file": atomic_save(payload, target / f"stage{v}.pt"), "keys": list(payload["module"])}
            atomic_write_text(json.dumps(entry), target / f"stage{v}.entry")  # rank 0 puts it into the manifest
        fsync_dir(target)
    role.barrier()
    if role.writes_manifest:
        entries = {f"stage{v}.pt": json.loads((target / f"stage{v}.entry").read_text())
                   for v in range(pipe.plan.num_stages)}
        atomic_write_text(json.dumps(_manifest(pipe, role, entries), indent=1), target / "manifest.json")
        fsync_dir(target)
        publish(root, pipe.updates)
    role.barrier()
    return target


def load_pipeline(pipe: PipelineView, path: str | os.PathLike) -> int:
    """Load the newest checkpoint under ``path`` into ``pipe``, whatever stage layout saved it; returns
    the step it was saved at.

    Only the stage files holding this process's names are opened (`files_to_read`), memory-mapped, and
    only those names are copied in. Every file used is read and checked before anything in ``pipe``
    changes, so a failed load leaves the pipeline as it was (and never writes to the checkpoint)."""
    source = checkpoint_dir(path)
    manifest = read_manifest(source)
    same_layout = manifest["plan_layout"] == _plan_layout(pipe)
    stages = pipe.stages
    needed = {k for stage in stages.values() for k in stage.module.state_dict()}
    files = {v: read_stage_file(source, v, manifest) for v in files_to_read(manifest, stages, needed, same_layout)}
    # In file order, a later file's copy of a name wins: tied copies are equal, so any one would do.
    module_state = {k: t for f in files.values() for k, t in f["module"].items() if k in needed}
    optimizer_state = {k: st for f in files.values() for k, st in f["optimizer"]["state"].items() if k in needed}
    groups = next((f["optimizer"]["groups"] for f in files.values() if f["optimizer"]["groups"]), [])
    for v, stage in stages.items():
        own = stage.module.state_dict()
        problems = [k for k in own if k not in module_state or module_state[k].shape != own[k].shape]
        if problems:
            k = problems[0]
            found = tuple(module_state[k].shape) if k in module_state else "nothing"
            raise CheckpointError(
                f"checkpoint {source} does not fit this model: {k} has shape {tuple(own[k].shape)} here but "
                f"{found} in the checkpoint ({len(problems)} mismatching entries); load a checkpoint of the "
                "same model")
    for v, stage in stages.items():
        own = stage.module.state_dict()
        stage.module.load_state_dict({k: module_state[k] for k in own})
        load_optimizer_state(stage.optimizer, optimizer_state, groups, _param_names(stage.module))
        stage.policy.updates = files[v]["updates"] if same_layout else manifest["step"]
    scaler_state = next(iter(files.values()))["scaler"]
    for stage in stages.values():
        if stage.scaler is not None and scaler_state:
            stage.scaler.load_state_dict(scaler_state)
    if same_layout and stages:
        torch.set_rng_state(files[min(stages)]["rng"])
    return manifest["step"]


def files_to_read(manifest: dict, stages: dict[int, StageState], needed: set[str], same_layout: bool) -> list[int]:
    """The stage files a load of ``stages`` (holding the names ``needed``) opens: under the saved layout their
    own files; otherwise, per needed name, the last file the manifest lists it in. Every file when the
    manifest has no key lists (older checkpoints) or lacks a needed name (its files are then checked, so
    the error names the real cause: a mixed-up file, or another model)."""
    if same_layout:
        return sorted(stages)
    listed = manifest.get("keys", {})
    holder = {k: v for v in range(manifest["stages"]) for k in listed.get(f"stage{v}.pt", [])}
    if not needed <= holder.keys():
        return list(range(manifest["stages"]))
    # The loss scaler's state is in every file: one is read even for stages without parameters.
    return sorted({holder[k] for k in needed}) or [0]


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def _stage_payload(stage: StageState) -> dict:
    return {"module": stage.module.state_dict(),
            "optimizer": optimizer_state_by_name(stage.optimizer, _param_names(stage.module)),
            "updates": stage.policy.updates, "scaler": stage.scaler.state_dict() if stage.scaler is not None else {},
            "rng": torch.get_rng_state()}


def _plan_layout(pipe: PipelineView) -> list:
    """What decides which parameters a stage file holds."""
    plan = json.loads(pipe.plan.to_json())
    return [plan["order"], plan["cuts"]]


def _manifest(pipe: PipelineView, role: CheckpointRole, entries: dict[str, dict]) -> dict:
    o = pipe.options
    config = pipe.pretrained.config_json()
    return {"format": FORMAT, "step": pipe.updates, "stages": pipe.plan.num_stages,
            "files": {name: e["file"] for name, e in entries.items()},
            "keys": {name: e["keys"] for name, e in entries.items()},
            "canonical": pipe.pretrained.canonical, **({"hf_config": config} if config is not None else {}),
            "devices": o.stages, "data_parallel": o.data_parallel, "plan_layout": _plan_layout(pipe),
            "plan": pipe.plan.to_json(), "schedule": o.schedule, "staleness": o.staleness,
            "micro_batches": o.micro_batches, "precision": o.precision,
            "engine": role.engine,
            "versions": {"pipetrain": version("pipetrain"), "torch": torch.__version__}}

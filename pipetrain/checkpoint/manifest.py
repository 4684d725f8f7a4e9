"""The manifest of a step directory and the integrity of its files: the manifest records each stage file's size
and sha256 (and, from format 2, the sha256 of its own fields), so a truncated, corrupted, edited or mixed-up
file is refused with an error that names it instead of being loaded. It also lists the names each stage file
holds (a load opens only the files it needs) and the model's canonical names and Hugging Face config."""
from __future__ import annotations

import hashlib
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch

from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.layout import STEP_NAME, alternatives
from pipetrain.checkpoint.view import CheckpointRole, PipelineView


FORMAT = 2  # 2: the manifest carries the sha256 of its own fields (1, without it, still loads)


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
                              f"one. Nothing was loaded or changed. {alternatives(path.parent, exclude=path)}"
                              ) from exc
    if manifest["format"] not in (1, FORMAT):
        raise CheckpointError(f"{path} is a checkpoint of format {manifest['format']}, this pipetrain reads 1 and {FORMAT}")
    edited = None
    if manifest["format"] >= 2 and manifest.get("digest") != manifest_digest(manifest):
        edited = "its fields do not match the sha256 it recorded of them"
    elif STEP_NAME.fullmatch(path.name) and int(STEP_NAME.fullmatch(path.name).group(1)) != manifest["step"]:
        edited = f"it says step {manifest['step']}, its directory {path.name}"
    elif len(manifest["files"]) != manifest["stages"]:
        edited = f"it says {manifest['stages']} stages but lists {len(manifest['files'])} stage files"
    if edited:
        raise CheckpointError(f"{file} was edited or corrupted ({edited}). Nothing was loaded or changed. "
                              f"{alternatives(path.parent, exclude=path)}")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's fields but its digest (keys sorted): any edit of them changes it."""
    fields = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def read_stage_file(path: Path, v: int, manifest: dict) -> dict:
    """Stage ``v``'s file of step directory ``path``, verified against the manifest's size and sha256.

    The file is hashed in chunks and then memory-mapped, so its tensors are paged in only where they are
    used: reading a stage never holds a copy of it in memory."""
    file = path / f"stage{v}.pt"
    fix = f"Nothing was loaded or changed. {alternatives(path.parent, exclude=path)}"
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


def plan_layout(pipe: PipelineView) -> list:
    """What decides which parameters a stage file holds."""
    plan = json.loads(pipe.plan.to_json())
    return [plan["order"], plan["cuts"]]


def manifest_of(pipe: PipelineView, role: CheckpointRole, entries: dict[str, dict]) -> dict:
    """The manifest of ``pipe``'s step: the stage files' ``entries`` (sha256 and size, names held), what the run
    was (plan, options, versions) and the digest of all of it. Its "devices" key is the pipeline positions."""
    o = pipe.options
    config = pipe.pretrained.config_json()
    manifest = {"format": FORMAT, "step": pipe.updates, "stages": pipe.plan.num_stages,
            "files": {name: e["file"] for name, e in entries.items()},
            "keys": {name: e["keys"] for name, e in entries.items()},
            "canonical": pipe.pretrained.canonical, **({"hf_config": config} if config is not None else {}),
            "devices": o.stages, "data_parallel": o.data_parallel, "plan_layout": plan_layout(pipe),
            "plan": pipe.plan.to_json(), "schedule": o.schedule, "staleness": o.staleness,
            "micro_batches": o.micro_batches, "precision": o.precision,
            "engine": role.engine,
            "versions": {"pipetrain": version("pipetrain"), "torch": torch.__version__}}
    manifest["digest"] = manifest_digest(manifest)
    return manifest

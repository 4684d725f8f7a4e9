"""Exports of a checkpoint without a pipeline: the unsplit model's state dict, and the Hugging Face directory
``pipetrain export --hf`` writes one stage file at a time (no process ever holds the whole model)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.checkpoint.layout import checkpoint_dir
from pipetrain.checkpoint.manifest import read_manifest, read_stage_file, read_stage_files
from pipetrain.pretrained import CONFIG, MAX_SHARD_BYTES, ShardWriter, write_index


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

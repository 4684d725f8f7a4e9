"""The way back to the Hugging Face ecosystem: a pipeline written as a ``from_pretrained`` directory.

Every process writes the tensors of the stages it holds, so no process ever holds the whole model: a
tensor goes once into the files, under the name the model's own state dict gives first among its aliases
(GPT-2's ``transformer.wte.weight``, not its tied ``lm_head.weight``; T5's ``shared.weight``), written by
the lowest stage that holds it. The shards are numbered across the ranks (``model-00001-of-0000N``), the
index maps each name to its shard, and the model's ``config.json`` is written beside them when it has one.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class PretrainedLayout:
    """What writing the model's files needs of the original model, read once at ``wrap`` (names, not tensors)."""

    canonical: dict[str, str]  # every state-dict name (aliases included) -> the name written
    config: Any                # the model's ``config`` (Hugging Face), or None

    @classmethod
    def of(cls, model: nn.Module) -> PretrainedLayout:
        order = {k: i for i, k in enumerate(model.state_dict(keep_vars=True))}
        groups: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if name in order:
                groups.setdefault(id(t), []).append(name)
        canonical = {n: min(names, key=order.__getitem__) for names in groups.values() for n in names}
        return cls(canonical, getattr(model, "config", None))


def own_tensors(stages: dict[int, nn.Module], layout: PretrainedLayout,
                tied: list[list[tuple[int, str]]]) -> dict[str, torch.Tensor]:
    """The tensors this process writes: each under its canonical name, by the lowest stage that holds a copy
    (tied parameters on several stages are copies kept equal)."""
    writer = {layout.canonical.get(name, name): min(stage for stage, _ in group) for group in tied
              for _, name in group}
    out = {}
    for v, module in sorted(stages.items()):
        for name, t in module.state_dict().items():
            if layout.canonical.get(name, name) == name and writer.get(name, v) == v:
                out[name] = t
    return out


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names in order, cut into groups of at most ``max_bytes`` (a larger tensor has a group of its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups if groups[-1] else []


def save_pretrained(path: str | os.PathLike, tensors: dict[str, torch.Tensor], layout: PretrainedLayout,
                    group: Any = None, max_shard_bytes: int = 5 * 10 ** 9) -> Path:
    """Write ``tensors`` (this process's share, ``own_tensors``) into the Hugging Face directory ``path``;
    under torchrun every rank calls it with its ``group`` (all ranks; ranks of other replicas pass nothing)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    mine = _shards(tensors, max_shard_bytes)
    counts = [len(mine)]
    if group is not None:
        counts = [None] * dist.get_world_size(group)
        dist.all_gather_object(counts, len(mine), group=group)
    rank = dist.get_rank(group) if group is not None else 0
    total, first = sum(counts), sum(counts[:rank])
    weight_map: dict[str, str] = {}
    size = 0
    for j, names in enumerate(mine):
        file = SINGLE if total == 1 else f"model-{first + j + 1:05d}-of-{total:05d}.safetensors"
        # Copies on the CPU, one shard at a time: safetensors refuses tensors sharing storage (views).
        shard = {n: tensors[n].detach().to("cpu", copy=True).contiguous() for n in names}
        save_file(shard, str(root / file), metadata={"format": "pt"})
        size += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(names, file))
    maps = [(weight_map, size)]
    if group is not None:
        maps = [None] * dist.get_world_size(group)
        dist.all_gather_object(maps, (weight_map, size), group=group)
    if rank == 0:
        if total > 1:
            index = {"metadata": {"total_size": sum(s for _, s in maps)},
                     "weight_map": dict(sorted((k, v) for m, _ in maps for k, v in m.items()))}
            (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if hasattr(layout.config, "save_pretrained"):
            layout.config.save_pretrained(root)
    if group is not None:
        dist.barrier(group=group)
    return root

"""The way back to the Hugging Face ecosystem: a pipeline written as a ``from_pretrained`` directory.

Two writers share the directory's layout (``ShardWriter``, ``write_index``): ``save_pretrained``, where every
process writes the tensors of the stages it holds, and ``checkpoint.export_pretrained``, which writes a
checkpoint one stage file at a time; so no process ever holds the whole model. A tensor goes once into the
files, under the name the model's own state dict gives first among its aliases (GPT-2's
``transformer.wte.weight``, not its tied ``lm_head.weight``; T5's ``shared.weight``). The shards are
numbered across the writers (``model-00001-of-0000N``), the index maps each name to its shard, and the
model's ``config.json`` is written beside them when it has one.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from pipetrain.adapters import AdapterLayout
from pipetrain.runtime.local_shards import whole_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name
MAX_SHARD_BYTES = 5 * 10 ** 9  # as Hugging Face's save_pretrained


@dataclass(frozen=True)
class PretrainedLayout:
    """What writing the model's files needs of the original model, read once at ``wrap`` (names, not tensors)."""

    canonical: dict[str, str]  # every state-dict name (aliases included) -> the name written
    config: Any                # the model's ``config`` (Hugging Face), or None
    model_class: type | None = None        # what ``from_pretrained`` loads the files into (with a config)
    adapters: AdapterLayout | None = None  # a PEFT model's adapters

    @classmethod
    def of(cls, model: nn.Module) -> PretrainedLayout:
        order = {k: i for i, k in enumerate(model.state_dict(keep_vars=True))}
        groups: dict[int, list[str]] = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if name in order:
                groups.setdefault(id(t), []).append(name)
        canonical = {n: min(names, key=order.__getitem__) for names in groups.values() for n in names}
        config = getattr(model, "config", None)
        adapters = AdapterLayout.of(model)
        model_class = (adapters.base_class if adapters else type(model)) if hasattr(config, "to_json_string") else None
        return cls(canonical, config, model_class, adapters)

    def config_json(self) -> str | None:
        """The text of the ``config.json`` the config's ``save_pretrained`` writes; None without a Hugging Face
        config."""
        return self.config.to_json_string() if hasattr(self.config, "to_json_string") else None

    def expected_names(self) -> set[str] | None:
        """The names ``model_class.from_pretrained`` reads (of a model built from the config on the meta device,
        each tensor under its first alias, as written); None when the model is not a Hugging Face one."""
        if self.model_class is None:
            return None
        with torch.device("meta"):
            reference = self.model_class(copy.deepcopy(self.config))
        return set(PretrainedLayout.of(reference).canonical.values())


def check_loadable(written: set[str], layout: PretrainedLayout) -> None:
    """Refuse to write a directory that ``from_pretrained`` would load with missing or unexpected weights (it
    would initialise the missing ones at random without an error)."""
    expected = layout.expected_names()
    if expected is None or written == expected:
        return
    missing, unexpected = sorted(expected - written), sorted(written - expected)
    fix = ("this is a PEFT model: save its adapters (save_pretrained(path)) or merge them into the base model "
           "(save_pretrained(path, merge_adapters=True))" if layout.adapters is not None else
           "the model's parameters do not match its class: save with pipe.save (pipetrain's checkpoint) or "
           "export_state_dict instead")
    raise ValueError(f"save_pretrained would write a directory {layout.model_class.__name__}.from_pretrained loads "
                     f"with {len(missing)} missing weight(s) ({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''}) "
                     f"and {len(unexpected)} unexpected one(s) ({', '.join(unexpected[:3])}"
                     f"{'...' if len(unexpected) > 3 else ''}): nothing was written; fix: {fix}")


def own_tensors(stages: dict[int, nn.Module], layout: PretrainedLayout,
                tied: list[list[tuple[int, str]]]) -> dict[str, torch.Tensor]:
    """The tensors this process writes: each under its canonical name, by the lowest stage that holds a copy
    (tied parameters on several stages are copies kept equal); sharded ones whole (a collective over their mesh:
    every rank holding a shard calls this)."""
    writer = {layout.canonical.get(name, name): min(stage for stage, _ in group) for group in tied
              for _, name in group}
    out = {}
    for v, module in sorted(stages.items()):
        for name, t in whole_state(module).items():
            if layout.canonical.get(name, name) == name and writer.get(name, v) == v:
                out[name] = t
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shard_name(number: int, total: int) -> str:
    """The file name of shard ``number`` (from 1) of ``total``, as ``from_pretrained`` looks for it."""
    return SINGLE if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"


class ShardWriter:
    """One writer's safetensors shards in a Hugging Face directory: tensors are added in order, a shard is written
    when the next tensor would take it above ``max_shard_bytes`` (a larger tensor gets one of its own), and the
    shards are named once every writer's count is known (`finish`)."""

    def __init__(self, root: Path, max_shard_bytes: int, writer: int = 0):
        self.root = root
        self.max_shard_bytes = max_shard_bytes
        self.writer = writer                 # tells the provisional names of concurrent writers apart
        self.files: list[Path] = []          # written shards under provisional names, in order
        self.shard_of: dict[str, int] = {}   # name added -> position of its shard in ``files``
        self.size = 0                        # bytes of the tensors added
        self._filling: dict[str, torch.Tensor] = {}
        self._filling_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Add ``tensors`` (names not added before); they are copied, so the caller may drop them at once."""
        for name, t in tensors.items():
            if self._filling and self._filling_bytes + _nbytes(t) > self.max_shard_bytes:
                self._write_filling()
            # A copy on the CPU: it outlives the caller's memory-mapped file, and safetensors refuses tensors
            # sharing storage (views).
            self._filling[name] = t.detach().to("cpu", copy=True).contiguous()
            self._filling_bytes += _nbytes(t)
            self.size += _nbytes(t)
            self.shard_of[name] = len(self.files)

    def close(self) -> int:
        """Write the last shard; returns how many this writer wrote."""
        if self._filling:
            self._write_filling()
        return len(self.files)

    def finish(self, first: int, total: int) -> dict[str, str]:
        """Give the shards their names, numbered after the ``first`` shards of earlier writers among ``total``;
        returns this writer's name -> file."""
        names = [_shard_name(first + j + 1, total) for j in range(len(self.files))]
        for file, name in zip(self.files, names):
            os.replace(file, self.root / name)
        return {n: names[j] for n, j in self.shard_of.items()}

    def _write_filling(self) -> None:
        file = self.root / f".model-{self.writer}-{len(self.files)}.safetensors.partial"
        save_file(self._filling, str(file), metadata={"format": "pt"})
        self.files.append(file)
        self._filling, self._filling_bytes = {}, 0


def write_index(root: Path, maps: list[tuple[dict[str, str], int]], total: int) -> None:
    """The index of ``total`` shards from every writer's (name -> file, bytes); one file needs none."""
    if total > 1:
        index = {"metadata": {"total_size": sum(size for _, size in maps)},
                 "weight_map": dict(sorted((k, v) for m, _ in maps for k, v in m.items()))}
        (root / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def save_adapters(path: str | os.PathLike, adapters: dict[str, torch.Tensor], layout: AdapterLayout,
                  group: Any = None) -> Path:
    """Write a PEFT model's adapter as peft's ``PeftModel.from_pretrained`` reads it: ``adapter_config.json`` and
    ``adapter_model.safetensors``. ``adapters`` is this process's share (names as peft writes them); adapters are
    small, so the first rank gathers every share and writes the file."""
    root = Path(path)
    shares = [adapters]
    if group is not None:
        shares = [None] * dist.get_world_size(group)
        dist.all_gather_object(shares, {k: t.detach().cpu() for k, t in adapters.items()}, group=group)
    if group is None or dist.get_rank(group) == 0:
        root.mkdir(parents=True, exist_ok=True)
        tensors = {k: t.detach().to("cpu", copy=True).contiguous() for share in shares for k, t in share.items()}
        save_file(tensors, str(root / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        layout.config.save_pretrained(str(root))
    if group is not None:
        dist.barrier(group=group)
    return root


def save_pretrained(path: str | os.PathLike, tensors: dict[str, torch.Tensor], layout: PretrainedLayout,
                    group: Any = None, max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write ``tensors`` (this process's share, ``own_tensors``) into the Hugging Face directory ``path``;
    under torchrun every rank calls it with its ``group`` (all ranks; ranks of other replicas pass nothing)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank(group) if group is not None else 0
    shards = ShardWriter(root, max_shard_bytes, rank)
    shards.add(tensors)
    count = shards.close()
    counts = [count]
    if group is not None:
        counts = [None] * dist.get_world_size(group)
        dist.all_gather_object(counts, count, group=group)
    mine = (shards.finish(sum(counts[:rank]), sum(counts)), shards.size)
    maps = [mine]
    if group is not None:
        maps = [None] * dist.get_world_size(group)
        dist.all_gather_object(maps, mine, group=group)
    if rank == 0:
        write_index(root, maps, sum(counts))
        if hasattr(layout.config, "save_pretrained"):
            layout.config.save_pretrained(root)
    if group is not None:
        dist.barrier(group=group)
    return root


def write_pretrained(path: str | os.PathLike, stages: dict[int, nn.Module], layout: PretrainedLayout,
                     tied: list[list[tuple[int, str]]], group: Any = None, writes: bool = True,
                     max_shard_size: int = MAX_SHARD_BYTES, merge_adapters: bool = False) -> Path:
    """``Pipeline.save_pretrained``: this process's ``stages`` written into the Hugging Face directory ``path``
    (with ``writes`` false, as for the ranks of replicas other than the first, it only takes part in the
    collectives of ``group``): a PEFT model's adapter, or the model (with the LoRA factors merged into its
    weights when ``merge_adapters``). Refuses before writing what ``from_pretrained`` would load wrongly."""
    tensors = own_tensors(stages, layout, tied)  # on every rank: sharded tensors are gathered collectively
    if not writes:
        tensors = {}
    adapters = layout.adapters
    if adapters is not None and not merge_adapters:
        return save_adapters(path, adapters.adapter_tensors(tensors), adapters, group)
    if merge_adapters and adapters is None:
        raise ValueError("merge_adapters=True merges a PEFT model's LoRA adapters into its base model; this "
                         "model has none: call save_pretrained(path)")
    if adapters is not None:
        tensors = adapters.merged(tensors, _gathered_everywhere(adapters.factors(tensors), group))
    written = set(_gathered_everywhere({name: None for name in tensors}, group))
    check_loadable(written, layout)  # every rank checks every name: all refuse alike
    return save_pretrained(path, tensors, layout, group, max_shard_size)


def _gathered_everywhere(mine: dict, group: Any) -> dict:
    """Every rank's dict merged, on every rank (CPU copies of tensors; ``mine`` alone in one process)."""
    if group is None:
        return mine
    shares = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                    for k, v in mine.items()}, group=group)
    return {k: v for share in shares for k, v in share.items()}

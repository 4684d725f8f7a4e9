"""Weight sources: a checkpoint on disk, read by tensor name, one tensor at a time.

``open_weights(path)`` recognises the forms trained weights are kept in (a Hugging Face directory of
safetensors or ``pytorch_model.bin`` files, sharded under an index or not; a single safetensors file; a
``torch.save``'d state dict; a pipetrain checkpoint) and gives a ``WeightSource``: every tensor's name, shape
and dtype from the files' headers, and any one tensor on demand. Every rank runs ``match_names`` on the
whole model's names before anything is read, so all ranks agree on one error; then ``copy_into`` fills
only that rank's stage tensors. Nothing here runs code from a file (safetensors, or
``torch.load(weights_only=True)``), and files are memory-mapped, so host memory holds one tensor at a
time, never a whole shard.
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Callable, Protocol

import torch
from safetensors import SafetensorError, safe_open

from pipetrain.checkpoint import checkpoint_dir, read_manifest, read_stage_file
from pipetrain.weights.errors import WeightsError

TensorInfo = tuple[torch.Size, torch.dtype]

SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_FILE, TORCH_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
ACCEPTED = ("weights= takes a Hugging Face checkpoint directory (model.safetensors, or "
            "model.safetensors.index.json with its shards, or pytorch_model.bin[.index.json]), a .safetensors "
            "file, a torch.save'd state dict (.bin, .pt, .pth), or a pipetrain checkpoint directory (pipe.save).")
SHOWN = 10  # names listed per kind of problem in an error; the rest are counted

# The dtype tags of the safetensors format (its specification lists them), as torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64, "BOOL": torch.bool,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
}
# How torch names the class a weights-only load refused to unpickle.
REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


class FileReader(Protocol):
    """One open file of a source: its tensors' shapes and dtypes, and one tensor by name."""

    def shapes(self) -> dict[str, TensorInfo]: ...

    def tensor(self, name: str) -> torch.Tensor: ...


class SafetensorsFile:
    """A safetensors file, memory-mapped: the header gives names, shapes and dtypes without the data."""

    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            self.handle = safe_open(file, framework="pt")
        except SafetensorError as exc:
            raise WeightsError(f"{file} is not a readable safetensors file ({exc}): it is truncated, corrupted or "
                               f"of another format. Save or download it again.") from exc

    def shapes(self) -> dict[str, TensorInfo]:
        out = {}
        for name in self.handle.keys():
            part = self.handle.get_slice(name)
            tag = part.get_dtype()
            if tag not in SAFETENSORS_DTYPES:
                raise WeightsError(f"{name} in {self.file} has dtype {tag}, which torch has no dtype for; save the "
                                   f"checkpoint with a torch dtype (e.g. convert it to bfloat16 or float32).")
            out[name] = (torch.Size(part.get_shape()), SAFETENSORS_DTYPES[tag])
        return out

    def tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)


class StateDictFile:
    """A state dict loaded from a file (torch.save'd, or a pipetrain stage file); memory-mapped where the
    format allows, so its tensors' data is paged in only when read."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shapes(self) -> dict[str, TensorInfo]:
        return {name: (t.shape, t.dtype) for name, t in self.tensors.items()}

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class WeightSource:
    """A checkpoint's tensors by name: ``names()`` from headers, ``read(name)`` one tensor.

    The checkpoint is a list of files, each opened by its form's reader; one file is open at a time, and
    an index (Hugging Face's ``weight_map``) says which file holds which name where there is one."""

    def __init__(self, description: str, files: list[Path], open_file: Callable[[Path], FileReader],
                 index: dict[str, Path] | None = None) -> None:
        self._description = description
        self._files = files
        self._open_file = open_file
        self._index = index
        self._names: dict[str, TensorInfo] | None = None
        self._file_of: dict[str, Path] = {}
        self._open: tuple[Path, FileReader] | None = None

    def names(self) -> dict[str, TensorInfo]:
        """Every tensor of the checkpoint with its shape and dtype (headers and metadata only, no data)."""
        return dict(self._listed())

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` on the CPU, in the file's dtype; only its data is read."""
        return self._reader(self.file_of(name)).tensor(name)

    def file_of(self, name: str) -> Path:
        """The file that holds ``name`` (reading in file order opens each file once)."""
        if name not in self._listed():
            raise WeightsError(f"{self.describe()} has no tensor named {name!r}; take the names to read from "
                               f"match_names, which checks them against the checkpoint.")
        return self._file_of[name]

    def describe(self) -> str:
        """What and where the checkpoint is, for messages."""
        return self._description

    def close(self) -> None:
        """Let the open file go: the pages of a memory-mapped file that reads touched stay resident until then."""
        self._open = None

    def _listed(self) -> dict[str, TensorInfo]:
        if self._names is None:
            names: dict[str, TensorInfo] = {}
            for file in self._files:
                for name, info in self._reader(file).shapes().items():
                    # A name in several files (a pipetrain stage file holds its copy of a tied tensor) is read
                    # from the first; under an index, from the file the index names.
                    if name not in names and (self._index is None or self._index.get(name) == file):
                        names[name] = info
                        self._file_of[name] = file
            self._check_index(names)
            self._names = names
        return self._names

    def _reader(self, file: Path) -> FileReader:
        if self._open is None or self._open[0] != file:
            self._open = None  # let the previous file go before the next is opened
            self._open = (file, self._open_file(file))
        return self._open[1]

    def _check_index(self, names: dict[str, TensorInfo]) -> None:
        absent = [name for name in self._index or {} if name not in names]
        if absent:
            raise WeightsError(
                f"the index of {self.describe()} lists {len(absent)} tensors that its shards do not hold: "
                f"{_listing(f'{n} (in {self._index[n].name})' for n in absent)}. The index and the shards come "
                f"from different saves; save or download the checkpoint again, all of its files together.")


def open_weights(path: str | Path) -> WeightSource:
    """The weights at ``path``: a Hugging Face checkpoint directory, a .safetensors file, a torch.save'd state
    dict or a pipetrain checkpoint directory. Every file's header is checked now; a damaged pipetrain
    checkpoint raises pipetrain's CheckpointError, which names the file."""
    path = Path(path)
    if path.is_dir():
        source = _open_directory(path)
    elif path.is_file() and path.suffix == ".safetensors":
        source = WeightSource(f"safetensors file {path}", [path], SafetensorsFile)
    elif path.is_file():
        source = WeightSource(f"torch.save file {path}", [path], _load_state_dict)
    else:
        raise WeightsError(f"{path} does not exist. {ACCEPTED}")
    source.names()  # every header read and checked before the caller plans anything
    return source


def _open_directory(path: Path) -> WeightSource:
    # Hugging Face's forms, safetensors first: one file, or shards an index lists.
    for single, index_file, reader, kind in ((SAFETENSORS_FILE, SAFETENSORS_INDEX, SafetensorsFile, "safetensors"),
                                             (TORCH_FILE, TORCH_INDEX, _load_state_dict, TORCH_FILE)):
        if (path / single).is_file():
            return WeightSource(f"Hugging Face checkpoint {path} ({single})", [path / single], reader)
        if (path / index_file).is_file():
            index = _read_index(path / index_file)
            files = sorted(set(index.values()))
            return WeightSource(f"Hugging Face checkpoint {path} ({len(files)} {kind} shards)", files, reader, index)
    if any((path / name).exists() for name in ("latest", "manifest.json")) or any(path.glob("stage*.pt")):
        return _pipetrain_checkpoint(path)
    entries = sorted(p.name for p in path.iterdir())
    holds = f"it holds {_listing(entries)}" if entries else "it is empty"
    raise WeightsError(f"{path} is a directory without a checkpoint ({holds}). {ACCEPTED}")


def _read_index(file: Path) -> dict[str, Path]:
    """Hugging Face's index ``file``: each tensor name -> its shard, every shard inside the index's directory."""
    try:
        weight_map = json.loads(file.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("its weight_map is not an object of tensor name -> file name")
    except (ValueError, KeyError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WeightsError(f"{file} is not a Hugging Face index ({type(exc).__name__}: {exc}): expected JSON with "
                           f"a \"weight_map\" of tensor name -> shard file. Save or download the index again."
                           ) from exc
    shards = {}
    for shard in sorted(set(weight_map.values())):
        if not _inside(file.parent, shard):
            raise WeightsError(
                f"{file} names the shard {shard!r}, which is outside {file.parent}, so nothing was read: an index "
                f"may name only files in its own directory. The index is damaged or points elsewhere; put the "
                f"shards beside it and name them relative to it (e.g. \"model-00001-of-00002.safetensors\").")
        if not (file.parent / shard).is_file():
            users = [name for name, f in weight_map.items() if f == shard]
            raise WeightsError(
                f"the shard {file.parent / shard} is missing: {file} names it for {len(users)} tensors "
                f"({_listing(users)}). The download or copy is incomplete; fetch {shard} again, or save the "
                f"checkpoint again.")
        shards[shard] = file.parent / shard
    return {name: shards[shard] for name, shard in weight_map.items()}


def _inside(directory: Path, shard: str) -> bool:
    """Whether ``shard`` names a file in ``directory`` or below, symlinks resolved: an index names its shards
    relative to itself, and anything else could read any file on the machine."""
    root = directory.resolve()
    return (not Path(shard).is_absolute() and ".." not in Path(shard).parts
            and (root / shard).resolve().is_relative_to(root))


def _load_state_dict(file: Path) -> StateDictFile:
    """A torch.save'd flat state dict, memory-mapped (only the legacy non-zip format cannot be)."""
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # torch raises many types for files it cannot read; one clear error instead
        refused = REFUSED_GLOBAL.search(str(exc))
        if refused:
            raise WeightsError(
                f"{file} holds Python objects, not only tensors (a pickled {refused[1]}); pipetrain loads weights "
                f"with torch.load(weights_only=True) and never runs code from a file. Save the weights alone: "
                f"torch.save(model.state_dict(), path).") from exc
        reason = "".join(str(exc).strip().splitlines()[:1])
        raise WeightsError(f"{file} is not a checkpoint pipetrain reads: torch.load cannot read it "
                           f"({type(exc).__name__}: {reason}). {ACCEPTED}") from exc
    return StateDictFile(_flat_state_dict(loaded, file))


def _flat_state_dict(loaded: object, file: Path) -> dict[str, torch.Tensor]:
    if isinstance(loaded, dict):
        others = [k for k, v in loaded.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
        if not others:
            return loaded
        what = (f"a dict whose entries {_listing(repr(k) for k in others)} are not tensors "
                f"({_listing(type(loaded[k]).__name__ for k in others)})")
        nested = [k for k in others if isinstance(loaded[k], dict) and loaded[k]
                  and all(isinstance(t, torch.Tensor) for t in loaded[k].values())]
        hint = (f" Its entry {nested[0]!r} looks like the state dict: torch.save(checkpoint[{nested[0]!r}], path)."
                if nested else "")
    else:
        what, hint = f"a {type(loaded).__name__}", ""
    raise WeightsError(f"{file} holds {what}, not a state dict: expected a flat dict of tensor name -> tensor, "
                       f"as torch.save(model.state_dict(), path) writes.{hint}")


def _pipetrain_checkpoint(path: Path) -> WeightSource:
    step = checkpoint_dir(path)
    manifest = read_manifest(step)
    stage_of = {step / f"stage{v}.pt": v for v in range(manifest["stages"])}
    # Stage files are read whole and checked against the manifest's hash: opened one at a time, and the
    # reads are ordered by file, so each is opened once for the names and once for the tensors.
    return WeightSource(f"pipetrain checkpoint {step} ({len(stage_of)} stage files)", list(stage_of),
                        lambda file: StateDictFile(read_stage_file(step, stage_of[file], manifest)["module"]))


def match_names(source_names: dict[str, TensorInfo], expected: dict[str, TensorInfo], aliases: list[list[str]],
                recomputed: set[str], *, source: str = "the checkpoint") -> dict[str, str]:
    """For each name of ``expected``, the checkpoint key it is read from: the first name of its ``aliases``
    group that the checkpoint has (a tied tensor is usually saved under one name). Names in ``recomputed``
    (non-persistent buffers) are ignored when the checkpoint has them. Raises one WeightsError listing every
    group the checkpoint lacks, every key that is no name of the model and every shape mismatch; dtypes may
    differ (the copy converts). ``source`` names the checkpoint in the message."""
    grouped = {name for group in aliases for name in group}
    groups = [*aliases, *([name] for name in expected if name not in grouped)]
    keys: dict[str, str] = {}
    missing, mismatched = [], []
    for group in groups:
        present = [name for name in group if name in source_names]
        if not present:
            missing.append(" = ".join(group))  # tied names are one tensor: any one of them would do
            continue
        keys.update((name, present[0]) for name in group)
        shape = expected[group[0]][0]
        mismatched += [f"{name}: {tuple(shape)} in the model, {tuple(source_names[name][0])} in the checkpoint"
                       for name in present if source_names[name][0] != shape]
    unexpected = [name for name in source_names if name not in expected and name not in recomputed]
    if missing or unexpected or mismatched:
        problems = [f"{len(missing)} tensors of the model missing: {_listing(missing)}" if missing else "",
                    f"{len(unexpected)} unexpected keys, no name of the model: {_listing(unexpected)}"
                    if unexpected else "",
                    f"{len(mismatched)} shape mismatches: {_listing(mismatched)}" if mismatched else ""]
        raise WeightsError(
            f"{source} does not fit the model, so nothing was loaded:\n"
            + "".join(f"- {p}\n" for p in problems if p)
            + "The checkpoint is of another model or another config: save it from the model you pass to wrap, "
              "or build the model with from_pretrained(path) and wrap it.")
    return keys


def copy_into(source: WeightSource, targets: dict[str, torch.Tensor], keys: dict[str, str]) -> int:
    """Fill every tensor of ``targets`` with the checkpoint tensor ``keys[name]`` (as ``match_names`` gives),
    converted to the target's dtype and device; names that are one tensor are filled once. Returns the bytes
    read. One checkpoint tensor is in host memory at a time."""
    distinct: dict[int, str] = {}
    for name, target in targets.items():
        distinct.setdefault(id(target), name)
    # File by file: each file is opened once (opening a pipetrain stage file reads and hashes it whole).
    order = sorted(distinct.values(), key=lambda name: str(source.file_of(keys[name])))
    total = 0
    with torch.no_grad():
        for name in order:
            tensor = source.read(keys[name])
            target = targets[name]
            if tensor.shape != target.shape:  # copy_ would broadcast a smaller tensor silently
                raise WeightsError(
                    f"{keys[name]} in {source.describe()} has shape {tuple(tensor.shape)}, but {name} here has "
                    f"{tuple(target.shape)}; check the names with match_names first, which lists every mismatch.")
            target.copy_(tensor)
            total += tensor.numel() * tensor.element_size()
            del tensor  # before the next read: one tensor at a time
    return total


def _listing(items) -> str:
    """At most SHOWN items, comma-separated, and how many more there are."""
    items = list(items)
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more

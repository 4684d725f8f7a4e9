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
import warnings
import dataclasses
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import torch

from partitioners import Plan
from pipetrain.options import PipelineOptions
from pipetrain.pretrained import CONFIG, MAX_SHARD_BYTES, ShardWriter, write_index
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.staleness import StalenessPolicy

if TYPE_CHECKING:
    from pipetrain.pretrained import PretrainedLayout

FORMAT = 2  # 2: the manifest carries the sha256 of its own fields (1, without it, still loads)
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
    schedulers: list = dataclasses.field(default_factory=list)  # learning-rate schedulers (lr_scheduler=)


Agree = Callable[[str, Any, Callable[[list], Any]], Any]


def agree_alone(phase: str, value: Any, rule: Callable[[list], Any]) -> Any:
    """One process: the decision is the rule applied to its own value."""
    return rule([value])


@dataclass
class CheckpointRole:
    """This process's part in a save or load: which files it writes and how it agrees with the others."""

    writes_stages: bool    # replicas hold identical stages: only replica 0 writes them
    writes_manifest: bool  # one process publishes the step
    engine: str            # "local" | "distributed", recorded in the manifest
    # Every rank's value to a rule applied once, the decision returned on every rank (comm.consensus); a
    # rank that never answers is a PeerFailure on every rank, naming it and the phase.
    agree: Agree
    streaming: bool        # an async-1f1b stream is running: micro-batches are in flight
    rank: int              # named in the error every rank raises when this one fails
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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)  # a full disk keeps no half-written file
        if isinstance(error, OSError) and error.filename is None:  # a failed write names no file: name it
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise


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
    return {"state": state, "groups": groups, "class": optimizer_class(optimizer)}


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def merge_optimizer_shares(shares: list[dict]) -> dict:
    """One stage's optimizer state by name from the replicas' ZeRO shares (each holds the names it owns)."""
    state = {name: value for share in shares for name, value in share["state"].items()}
    groups = next((share["groups"] for share in shares if share["groups"]), [])
    classes = [share["class"] for share in shares if "class" in share]  # a replica owning nothing has none
    return {"state": state, "groups": groups, **({"class": classes[0]} if classes else {})}


def load_optimizer_state(optimizer: torch.optim.Optimizer | None, by_name: dict[str, dict],
                         groups: list[dict], names: dict[int, str]) -> None:
    """Put each parameter's saved state back, by name; hyper-parameters (every group key) from the saved groups."""
    if optimizer is None:
        return
    for g, saved in zip(optimizer.param_groups, groups):
        g.update(saved)  # every key, as Optimizer.load_state_dict (a scheduler's initial_lr among them)
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
                              f"{_alternatives(path.parent, exclude=path)}")
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
    """Write ``pipe``'s checkpoint of its current step under ``path`` and publish it, all or nothing.

    Every rank writes its files, then all agree that every write worked before ``latest`` moves; then the
    first rank writes the manifest and flips ``latest``, and all agree on that too (it flips ``latest`` back
    if a rank gave up waiting meanwhile). A failure anywhere raises the same CheckpointError on every rank,
    naming the rank, the file and the cause; the previous checkpoint stays the latest, and the pipeline
    is untouched: the next step and a retried save work."""
    role = pipe.role
    if role.streaming:
        raise RuntimeError("save() was called while train() streams async-1f1b mini-batches; micro-batches "
                           "are in flight then. Save between train() calls (the pipeline drains when the "
                           "stream ends), e.g. train on an epoch, save, train on the next")
    root, step = Path(path), pipe.updates
    target = step_dir(root, step)
    merged = {}
    if role.merge_optimizer is not None:  # every replica takes part, in stage order
        for v, stage in sorted(pipe.stages.items()):
            merged[v] = role.merge_optimizer(optimizer_state_by_name(stage.optimizer, _param_names(stage.module)))
    what = f"save of step {step} under {root}"
    previous = _latest_name(root)
    kept = (f"Nothing was published: {root / 'latest'} still names {previous}." if previous else
            f"Nothing was published ({root} has no earlier checkpoint).")
    kept += " The pipeline is unchanged: fix the cause and save again, or keep training."
    posted, own = _attempt(lambda: _write_stages(pipe, root, target, merged), role.rank)
    written = role.agree(what, posted, _entries_or_failures)
    if written["failures"]:
        _raise_failed(what, written["failures"], own, role, kept)
    posted, own = _attempt(lambda: _publish(pipe, root, target, written["entries"]), role.rank) \
        if role.writes_manifest else (None, None)
    try:
        failures = role.agree(f"publishing step {step} under {root}", posted, _failures)
    except BaseException:
        if role.writes_manifest and own is None:
            unpublish(root, previous)  # a rank gave up waiting: it takes this save for failed, so do all
        raise
    if failures:
        _raise_failed(what, failures, own, role, kept)
    if role.writes_manifest:
        prune(root, step)
    return target


def _write_stages(pipe: PipelineView, root: Path, target: Path, merged: dict[int, dict]) -> dict[str, dict]:
    """This process's stage files of the step (none but on replica 0); their manifest entries by file name."""
    if root.exists():
        refuse_older_step(root, pipe.updates)  # before any write, on every rank alike
    new_root = not root.exists()
    target.mkdir(parents=True, exist_ok=True)
    if new_root:
        fsync_dir(root.parent)
    entries = {}
    if pipe.role.writes_stages:
        for v, stage in pipe.stages.items():
            payload = _stage_payload(stage)
            if v in merged:
                payload["optimizer"] = merged[v]
            entries[f"stage{v}.pt"] = {"file": atomic_save(payload, target / f"stage{v}.pt"),
                                       "keys": list(payload["module"])}
        fsync_dir(target)
    return entries


def _publish(pipe: PipelineView, root: Path, target: Path, entries: dict[str, dict]) -> None:
    entries = {f"stage{v}.pt": entries[f"stage{v}.pt"] for v in range(pipe.plan.num_stages)}
    atomic_write_text(json.dumps(_manifest(pipe, pipe.role, entries), indent=1), target / "manifest.json")
    fsync_dir(target)
    publish(root, pipe.updates)


def _attempt(action: Callable[[], Any], rank: int) -> tuple[dict, Exception | None]:
    """What this rank posts of ``action`` (its result, or its error as text) and the error itself."""
    try:
        return {"result": action(), "error": None}, None
    except Exception as error:  # noqa: BLE001  (every rank learns of it and raises the same error)
        return {"result": None, "error": f"{type(error).__name__}: {error}", "rank": rank}, error


def _failures(outcomes: list[dict | None]) -> list[tuple[int, str]]:
    return [(o["rank"], o["error"]) for o in outcomes if o is not None and o["error"] is not None]


def _entries_or_failures(outcomes: list[dict]) -> dict:
    entries = {name: e for o in outcomes if o["result"] for name, e in o["result"].items()}
    return {"entries": entries, "failures": _failures(outcomes)}


def _raise_failed(what: str, failures: list[tuple[int, str]], own: Exception | None, role: CheckpointRole,
                  consequence: str) -> NoReturn:
    """Raise the error every rank raises for a failed save or load; in one process the error itself."""
    if role.engine == "local" and own is not None:
        raise own
    where = "\n".join(f"  rank {r}: {error}" for r, error in failures)
    raise CheckpointError(f"{what} failed on {len(failures)} rank{'s' if len(failures) > 1 else ''}:\n{where}\n"
                          f"{consequence}") from own


def _latest_name(root: Path) -> str | None:
    pointer = root / "latest"
    return pointer.read_text().strip() if pointer.exists() else None


def load_pipeline(pipe: PipelineView, path: str | os.PathLike) -> int:
    """Load the newest checkpoint under ``path`` into ``pipe``, whatever stage layout saved it; returns
    the step it was saved at.

    Only the stage files holding this process's names are opened (`files_to_read`), memory-mapped, and
    only those names are copied in. Every rank reads and checks all it will use, then the ranks agree that
    every one can load the same checkpoint before any of them changes its state: a refusal anywhere is the
    same error on every rank and leaves every pipeline as it was (a load never writes to the checkpoint)."""
    role = pipe.role
    what = f"load of {path}"
    posted, own = _attempt(lambda: _check_load(pipe, path), role.rank)
    found = role.agree(what, {**posted, "result": posted["result"] and posted["result"].agreed}, _one_checkpoint)
    if found["failures"]:
        _raise_failed(what, found["failures"], own, role,
                      "No rank loaded anything: every pipeline is as it was before load().")
    posted["result"].apply()
    return posted["result"].step


def found_everywhere(pipe: PipelineView, path: str | os.PathLike) -> bool:
    """Whether every rank finds a checkpoint under ``path`` (False: none does); a rank that finds one where
    another does not (a directory not shared by every machine) or finds a damaged one raises on every rank."""
    role = pipe.role
    posted, own = _attempt(lambda: (latest(path) is not None, str(path)), role.rank)
    found = role.agree(f"resume from {path}", posted, _one_answer)
    if found["failures"]:
        _raise_failed("resume", found["failures"], own, role,
                      "No rank loaded anything: give every rank the same checkpoint directory (one every machine "
                      "can read), or start over in a new directory.")
    return found["found"]


def _one_answer(outcomes: list[dict]) -> dict:
    failures = _failures(outcomes)
    answers = [o["result"] for o in outcomes]
    if not failures and len({found for found, _ in answers}) > 1:
        failures = [(r, f"finds {'a checkpoint' if found else 'none'} under {where}")
                    for r, (found, where) in enumerate(answers)]
    return {"failures": failures, "found": not failures and answers[0][0]}


@dataclass
class _CheckedLoad:
    """A checkpoint read and checked for this process's stages, not yet applied."""

    step: int
    agreed: tuple[str, str]    # (step directory, manifest sha256): every rank must load the same one
    apply: Callable[[], None]  # copies it into the stages


def _check_load(pipe: PipelineView, path: str | os.PathLike) -> _CheckedLoad:
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
    saved_class = next((f["optimizer"]["class"] for f in files.values() if "class" in f["optimizer"]), None)
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
        _check_optimizer(stage.optimizer, saved_class, groups, source)
    # Every scheduler of every stage is in the same state (one step per applied update each): any file's will do.
    scheduler_state = next((f["scheduler"] for f in files.values() if f.get("scheduler") is not None), None)
    if scheduler_state is None and any(stage.schedulers for stage in stages.values()):
        raise CheckpointError(
            f"checkpoint {source} holds no learning-rate scheduler state, but this pipeline has an lr_scheduler: a "
            f"schedule restarted at step 0 would not continue the run. Fix: resume without lr_scheduler (the "
            f"checkpoint's learning rates stay), or start a new schedule from the weights only: "
            f"pipetrain.wrap(..., weights={str(source)!r})")

    def apply() -> None:
        for v, stage in stages.items():
            own = stage.module.state_dict()
            stage.module.load_state_dict({k: module_state[k] for k in own})
            load_optimizer_state(stage.optimizer, optimizer_state, groups, _param_names(stage.module))
            stage.policy.updates = files[v]["updates"] if same_layout else manifest["step"]
        scaler_state = next(iter(files.values()))["scaler"]
        for stage in stages.values():
            if stage.scaler is not None and scaler_state:
                stage.scaler.load_state_dict(scaler_state)
        for stage in stages.values():
            for scheduler in stage.schedulers:
                scheduler.load_state_dict(scheduler_state)
        if same_layout and stages:
            torch.set_rng_state(files[min(stages)]["rng"])

    return _CheckedLoad(manifest["step"], (source.name, manifest_digest(manifest)), apply)


def _check_optimizer(optimizer: torch.optim.Optimizer | None, saved_class: str | None, groups: list[dict],
                     source: Path) -> None:
    """Refuse a checkpoint whose optimizer state this optimizer cannot take. Hyper-parameters follow the
    checkpoint (an exact resume, as torch's Optimizer.load_state_dict): a factory's other value is named."""
    if optimizer is None or not groups:
        return
    mine = optimizer_class(optimizer)
    if saved_class is not None and saved_class != mine:
        raise CheckpointError(
            f"checkpoint {source} holds the state of a {saved_class} optimizer, but this pipeline's optimizer "
            f"factory makes a {mine}: its state cannot be resumed by another optimizer class. Fix: resume with "
            f"the optimizer the run used, or keep only the weights and start a fresh optimizer: "
            f"pipetrain.wrap(..., weights={str(source)!r})")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {source} has {len(groups)} optimizer parameter groups, this pipeline's optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups as the run that saved it, "
            f"or start from its weights only: pipetrain.wrap(..., weights={str(source)!r})")
    # A scheduler moves lr from initial_lr (the factory's): compare that, not the lr it has reached.
    start = lambda g: {**g, "lr": g.get("initial_lr", g.get("lr"))}  # noqa: E731
    changed = sorted({f"{k} {start(g)[k]!r} -> {start(saved)[k]!r}" for g, saved in zip(optimizer.param_groups, groups)
                      for k in saved if k in g and k not in ("params", "initial_lr")
                      and _differs(start(g)[k], start(saved)[k])})
    if changed:
        warnings.warn(f"resuming from {source}: the checkpoint's optimizer hyper-parameters replace the factory's "
                      f"({', '.join(changed)}), so the run goes on exactly as it was saved. To change one after "
                      "resuming, set it in held_stages[v].optimizer.param_groups after load()", stacklevel=4)


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b


def _one_checkpoint(outcomes: list[dict]) -> dict:
    """Every rank read the same checkpoint and can load it, or the reasons why not."""
    failures = _failures(outcomes)
    loaded = {o["result"] for o in outcomes if o["result"] is not None}
    if not failures and len(loaded) > 1:
        failures = [(r, f"would load {o['result'][0]} (manifest sha256 {o['result'][1][:12]}), not what every "
                        "rank would (was `latest` flipped by another run meanwhile?)") for r, o in enumerate(outcomes)]
    return {"failures": failures}


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
            "scheduler": stage.schedulers[0].state_dict() if stage.schedulers else None,
            "rng": torch.get_rng_state()}


def _plan_layout(pipe: PipelineView) -> list:
    """What decides which parameters a stage file holds."""
    plan = json.loads(pipe.plan.to_json())
    return [plan["order"], plan["cuts"]]


def _manifest(pipe: PipelineView, role: CheckpointRole, entries: dict[str, dict]) -> dict:
    o = pipe.options
    config = pipe.pretrained.config_json()
    manifest = {"format": FORMAT, "step": pipe.updates, "stages": pipe.plan.num_stages,
            "files": {name: e["file"] for name, e in entries.items()},
            "keys": {name: e["keys"] for name, e in entries.items()},
            "canonical": pipe.pretrained.canonical, **({"hf_config": config} if config is not None else {}),
            "devices": o.stages, "data_parallel": o.data_parallel, "plan_layout": _plan_layout(pipe),
            "plan": pipe.plan.to_json(), "schedule": o.schedule, "staleness": o.staleness,
            "micro_batches": o.micro_batches, "precision": o.precision,
            "engine": role.engine,
            "versions": {"pipetrain": version("pipetrain"), "torch": torch.__version__}}
    manifest["digest"] = manifest_digest(manifest)
    return manifest

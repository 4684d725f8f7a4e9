"""Loading a checkpoint into a pipeline, whatever stage layout saved it: only the stage files holding this
process's names are opened (memory-mapped), everything is checked, and the ranks agree that every one can
load the same checkpoint before any of them changes its state."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from pipetrain.checkpoint.agreement import attempt, failures_of, raise_failed
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.checkpoint.layout import checkpoint_dir, latest
from pipetrain.checkpoint.manifest import manifest_digest, plan_layout, read_manifest, read_stage_file
from pipetrain.checkpoint.optimizer_state import check_optimizer, load_optimizer_state, param_names
from pipetrain.checkpoint.view import PipelineView, StageState
from pipetrain.runtime.local_shards import reshard, shard_like


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
        reshard(module)
        module.load_state_dict({k: shard_like(state[k], own[k]) for k in own if k in state}, strict=strict)
        used.update(own)
    extra = [k for k in state if k not in used]
    if extra and strict and not partial:
        raise KeyError(f"state dict has keys no stage holds: {extra[:5]}; is it from the same model?")


def load_pipeline(pipe: PipelineView, path: str | os.PathLike) -> int:
    """Load the newest checkpoint under ``path`` into ``pipe``, whatever stage layout saved it; returns
    the step it was saved at.

    Only the stage files holding this process's names are opened (`files_to_read`), memory-mapped, and
    only those names are copied in. Every rank reads and checks all it will use, then the ranks agree that
    every one can load the same checkpoint before any of them changes its state: a refusal anywhere is the
    same error on every rank and leaves every pipeline as it was (a load never writes to the checkpoint)."""
    role = pipe.role
    what = f"load of {path}"
    posted, own = attempt(lambda: _check_load(pipe, path), role.rank)
    found = role.agree(what, {**posted, "result": posted["result"] and posted["result"].agreed}, _one_checkpoint)
    if found["failures"]:
        raise_failed(what, found["failures"], own, role,
                     "No rank loaded anything: every pipeline is as it was before load().")
    posted["result"].apply()
    return posted["result"].step


def found_everywhere(pipe: PipelineView, path: str | os.PathLike) -> bool:
    """Whether every rank finds a checkpoint under ``path`` (False: none does); a rank that finds one where
    another does not (a directory not shared by every machine) or finds a damaged one raises on every rank."""
    role = pipe.role
    posted, own = attempt(lambda: (latest(path) is not None, str(path)), role.rank)
    found = role.agree(f"resume from {path}", posted, _one_answer)
    if found["failures"]:
        raise_failed("resume", found["failures"], own, role,
                     "No rank loaded anything: give every rank the same checkpoint directory (one every machine "
                     "can read), or start over in a new directory.")
    return found["found"]


def _one_answer(outcomes: list[dict]) -> dict:
    failures = failures_of(outcomes)
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


def sharded_like(optimizer_state: dict[str, dict], module: torch.nn.Module) -> dict[str, dict]:
    """Saved optimizer state by name, each per-parameter tensor cut as its parameter is (zero=3: this rank's
    shard), for the parameters of ``module``."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {name: {k: shard_like(t, params[name]) if isinstance(t, torch.Tensor) and name in params
                   and t.shape == params[name].shape else t for k, t in state.items()}
            for name, state in optimizer_state.items()}


def _check_load(pipe: PipelineView, path: str | os.PathLike) -> _CheckedLoad:
    source = checkpoint_dir(path)
    manifest = read_manifest(source)
    same_layout = manifest["plan_layout"] == plan_layout(pipe)
    stages = pipe.stages
    needed = {k for stage in stages.values() for k in stage.module.state_dict()}
    files = {v: read_stage_file(source, v, manifest) for v in files_to_read(manifest, stages, needed, same_layout)}
    # In file order, a later file's copy of a name wins: tied copies are equal, so any one would do.
    module_state = {k: t for f in files.values() for k, t in f["module"].items() if k in needed}
    optimizer_state = {k: st for f in files.values() for k, st in f["optimizer"]["state"].items() if k in needed}
    groups = next((f["optimizer"]["groups"] for f in files.values() if f["optimizer"]["groups"]), [])
    # A stage's own groups where it has a file: hyper-parameters may differ per stage (stage_momentum).
    groups_of = {v: files[v]["optimizer"]["groups"] if same_layout and v in files and files[v]["optimizer"]["groups"]
                 else groups for v in stages}
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
        check_optimizer(stage.optimizer, saved_class, groups_of[v], source)
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
            reshard(stage.module)
            stage.module.load_state_dict({k: shard_like(module_state[k], own[k]) for k in own})
            load_optimizer_state(stage.optimizer, sharded_like(optimizer_state, stage.module), groups_of[v],
                                 param_names(stage.module))
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


def _one_checkpoint(outcomes: list[dict]) -> dict:
    """Every rank read the same checkpoint and can load it, or the reasons why not."""
    failures = failures_of(outcomes)
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

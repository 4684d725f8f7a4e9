"""Saving a pipeline's step, all or nothing: every rank writes its stage files durably, all agree that every
write worked, then one publishes the manifest and flips ``latest``; an interrupted save leaves the previous
checkpoint the latest."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from pipetrain.checkpoint.agreement import attempt, failures_of, raise_failed
from pipetrain.checkpoint.durable import atomic_save, atomic_write_text, fsync_dir
from pipetrain.checkpoint.layout import latest_name, step_dir
from pipetrain.checkpoint.manifest import manifest_of
from pipetrain.checkpoint.optimizer_state import optimizer_state_by_name, param_names
from pipetrain.checkpoint.retention import prune, publish, refuse_older_step, unpublish
from pipetrain.checkpoint.view import PipelineView, StageState
from pipetrain.runtime.local_shards import whole_state


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
    merged, modules = {}, {}
    if role.merge_optimizer is not None:  # every replica takes part, in stage order
        for v, stage in sorted(pipe.stages.items()):
            merged[v] = role.merge_optimizer(optimizer_state_by_name(stage.optimizer, param_names(stage.module)))
            modules[v] = whole_state(stage.module)  # zero=3: gathered from every replica's shard
    what = f"save of step {step} under {root}"
    previous = latest_name(root)
    kept = (f"Nothing was published: {root / 'latest'} still names {previous}." if previous else
            f"Nothing was published ({root} has no earlier checkpoint).")
    kept += " The pipeline is unchanged: fix the cause and save again, or keep training."
    posted, own = attempt(lambda: _write_stages(pipe, root, target, merged, modules), role.rank)
    written = role.agree(what, posted, _entries_or_failures)
    if written["failures"]:
        raise_failed(what, written["failures"], own, role, kept)
    posted, own = attempt(lambda: _publish(pipe, root, target, written["entries"]), role.rank) \
        if role.writes_manifest else (None, None)
    try:
        failures = role.agree(f"publishing step {step} under {root}", posted, failures_of)
    except BaseException:
        if role.writes_manifest and own is None:
            unpublish(root, previous)  # a rank gave up waiting: it takes this save for failed, so do all
        raise
    if failures:
        raise_failed(what, failures, own, role, kept)
    if role.writes_manifest:
        prune(root, step)
    return target


def _write_stages(pipe: PipelineView, root: Path, target: Path, merged: dict[int, dict],
                  modules: dict[int, dict]) -> dict[str, dict]:
    """This process's stage files of the step (none but on replica 0); their manifest entries by file name.
    ``merged`` and ``modules``: the ZeRO stages' optimizer and module states gathered whole."""
    if root.exists():
        refuse_older_step(root, pipe.updates)  # before any write, on every rank alike
    new_root = not root.exists()
    target.mkdir(parents=True, exist_ok=True)
    if new_root:
        fsync_dir(root.parent)
    entries = {}
    if pipe.role.writes_stages:
        for v, stage in pipe.stages.items():
            payload = _stage_payload(stage, modules.get(v))
            if v in merged:
                payload["optimizer"] = merged[v]
            entries[f"stage{v}.pt"] = {"file": atomic_save(payload, target / f"stage{v}.pt"),
                                       "keys": list(payload["module"])}
        fsync_dir(target)
    return entries


def _publish(pipe: PipelineView, root: Path, target: Path, entries: dict[str, dict]) -> None:
    entries = {f"stage{v}.pt": entries[f"stage{v}.pt"] for v in range(pipe.plan.num_stages)}
    atomic_write_text(json.dumps(manifest_of(pipe, pipe.role, entries), indent=1), target / "manifest.json")
    fsync_dir(target)
    publish(root, pipe.updates)


def _entries_or_failures(outcomes: list[dict]) -> dict:
    entries = {name: e for o in outcomes if o["result"] for name, e in o["result"].items()}
    return {"entries": entries, "failures": failures_of(outcomes)}


def _stage_payload(stage: StageState, module_state: dict | None = None) -> dict:
    return {"module": stage.module.state_dict() if module_state is None else module_state,
            "optimizer": optimizer_state_by_name(stage.optimizer, param_names(stage.module)),
            "updates": stage.policy.updates, "scaler": stage.scaler.state_dict() if stage.scaler is not None else {},
            "scheduler": stage.schedulers[0].state_dict() if stage.schedulers else None,
            "rng": torch.get_rng_state()}

"""The Pipeline object ``wrap`` returns: the face over an assembled pipeline and its runner."""
from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch import nn

import partitioners
from pipetrain import checkpoint as ckpt
from pipetrain.assembly import Parts, assemble
from pipetrain.checkpoint.parts_view import pipeline_view
from pipetrain.comm import group_lifetime
from pipetrain.comm.world import World
from pipetrain.options import PipelineOptions
from pipetrain.pretrained import write_pretrained
from pipetrain.runner import Runner
from pipetrain.runtime.local_shards import whole_state
from pipetrain.runtime.metrics import StepResult
from pipetrain.runtime.stage import StageRuntime


class _Ended(NamedTuple):
    """What a closed pipeline still answers."""

    options: PipelineOptions
    plan: partitioners.Plan
    updates: int
    skipped_steps: int
    last_result: StepResult | None


class Pipeline:
    """A model split into pipeline stages, trained by a schedule on the local or distributed engine."""

    def __init__(self, model: nn.Module, example_inputs: Any, options: PipelineOptions):
        parts = assemble(model, example_inputs, options)
        self._live: tuple[Parts, Runner] | None = (parts, Runner(parts))
        self._ended: _Ended | None = None  # what a closed pipeline still answers
        if parts.engine.distributed:
            group_lifetime.close_at_exit(self)

    @property
    def _parts(self) -> Parts:
        return self._open()[0]

    @property
    def _runner(self) -> Runner:
        return self._open()[1]

    def _open(self) -> tuple[Parts, Runner]:
        if self._live is None:
            raise RuntimeError("this pipeline was closed (Pipeline.close()); wrap the model again to go on")
        return self._live

    @property
    def options(self) -> PipelineOptions:
        return self._ended.options if self._ended else self._parts.options

    @property
    def plan(self) -> partitioners.Plan:
        """The partition plan; ``print(pipe.plan)`` shows a per-stage table."""
        return self._ended.plan if self._ended else self._parts.plan

    @property
    def updates(self) -> int:
        """Mini-batches trained so far (restored by ``load``)."""
        return self._ended.updates if self._ended else self._runner.updates

    @property
    def skipped_steps(self) -> int:
        """Mini-batches whose update was skipped on every stage (non-finite values, fp16 overflow)."""
        return self._ended.skipped_steps if self._ended else self._runner.skipped_steps

    @property
    def last_result(self) -> StepResult | None:
        return self._ended.last_result if self._ended else self._runner.last_result

    # ----- training and prediction ----------------------------------------------------------
    def step(self, x: Any, y: Any = None) -> float:
        """Train one mini-batch and return its mean loss (on every rank). ``y`` may be None when the
        model computes its own loss from its inputs (e.g. Hugging Face ``labels``, loss_fn=model_loss).
        ``x`` is a tensor, a tuple of forward()'s arguments or any Mapping of keyword arguments (a dict, a
        collator's ``BatchEncoding``)."""
        if self.options.schedule == "async-1f1b":
            return next(iter(self.train([(x, y)]))).loss
        return self._runner.step(plain_inputs(x), y).loss

    def train(self, batches: Iterable) -> Iterator[StepResult]:
        """Train on a stream of mini-batches, yielding one result per mini-batch. Each is an (inputs, targets)
        pair, or a Mapping of keyword inputs alone when the model computes its own loss from them (a
        collator's batch with ``labels``, loss_fn=pipetrain.model_loss): what a DataLoader yields either way.

        Synchronous schedules flush after every mini-batch; async-1f1b keeps the pipeline full
        for the whole stream and drains only when it ends. Under torchrun every rank iterates
        the same stream (in hybrid mode each replica keeps its own shard of every mini-batch).
        """
        yield from self._runner.train(_as_pair(batch) for batch in batches)

    def on_step(self, callback: Callable[[StepResult], None]) -> None:
        """Call ``callback(result)`` on every rank after each trained mini-batch (step or train), once its
        result is complete and logged: the place for a progress bar, custom logging or early stopping."""
        self._runner.callbacks.append(callback)

    def predict(self, x: Any) -> Any:
        """Forward only in eval mode: what the unsplit model returns for the whole batch ``x``, on every rank,
        on the device of ``x``. Micro-batches are pipelined and their outputs concatenated when every output
        tensor is per sample; an output holding a value reduced over the batch (the loss of a model given
        ``labels``: a token mean with ignored labels is no weighted mean of micro-batch losses) is computed
        on the whole batch in one pass, which gives exactly the unsplit value."""
        return self._runner.predict(plain_inputs(x))

    def request_stop(self) -> None:
        """Ask every rank to stop at the same step: from the next step report on, each rank's
        StepResult has ``stop_requested`` set (under torchrun it rides in the report the ranks already
        exchange, so it costs no collective of its own). Only sets a flag, so a signal handler may call
        it; stopping is the caller's (pipetrain's training loop saves and returns on SIGTERM)."""
        self._runner.stop_requested = True

    # ----- state and checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the original model's names (this rank's share when distributed; whole
        tensors under zero=3, gathered from the stage's replicas, so every rank calls it)."""
        stages = self._parts.stages
        return {name: t for v in sorted(stages) for name, t in whole_state(stages[v].module).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load original-model names into the stages that hold them."""
        modules = {v: rt.module for v, rt in self._parts.stages.items()}
        ckpt.load_module_state(modules, state, strict, partial=self._parts.engine.distributed)

    def save(self, path: str | os.PathLike) -> Path:
        """Checkpoint the current step under the directory ``path``; every rank calls it.
        Returns the step directory."""
        return ckpt.save_pipeline(self._checkpoint_view(), path)

    def load(self, path: str | os.PathLike) -> None:
        """Resume from the newest checkpoint under ``path`` (or a step directory), re-partitioning
        parameters and optimizer state when it was saved with another stage count or engine."""
        self._runner.loaded(ckpt.load_pipeline(self._checkpoint_view(), path))

    def resume(self, path: str | os.PathLike) -> bool:
        """Load the newest checkpoint under ``path`` if there is one (the scripts' ``--resume``); True if it did. Every
        rank takes the same decision: if some see a checkpoint there and others do not, all raise."""
        if not ckpt.found_everywhere(self._checkpoint_view(), path):
            return False
        self.load(path)
        return True

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int = 5 * 10 ** 9,
                        merge_adapters: bool = False) -> Path:
        """Write the model as a Hugging Face directory (safetensors shards of at most ``max_shard_size`` bytes,
        their index, the model's config.json) that ``from_pretrained`` loads; every rank calls it and writes
        only the tensors of its stages. It refuses (before writing) a directory ``from_pretrained`` would load
        with missing or unexpected weights. A PEFT model writes its adapter (``adapter_config.json``,
        ``adapter_model.safetensors``: what ``PeftModel.from_pretrained`` reads), or with ``merge_adapters``
        the base model with the LoRA factors merged into its weights."""
        parts, world = self._parts, self._parts.engine.world
        return write_pretrained(path, {v: rt.module for v, rt in parts.stages.items()}, parts.pretrained,
                                parts.plan.tied_groups(), world.control if world is not None else None,
                                writes=world is None or (world.replica, world.lane) == (0, 0),
                                max_shard_size=max_shard_size,
                                merge_adapters=merge_adapters)

    def _checkpoint_view(self) -> ckpt.PipelineView:
        """What a checkpoint saves and restores of this pipeline, now."""
        return pipeline_view(self._parts, self._runner.updates, streaming=self._runner.in_stream)

    def close(self) -> None:
        """End the pipeline: close its TensorBoard log and, under torchrun, destroy the process groups it made
        (every rank calls it), so that their threads end before the process does. Pipelines still open are
        closed when the process exits. Afterwards the pipeline still answers ``options``, ``plan``, ``updates``,
        ``skipped_steps`` and ``last_result``, and raises on every other use; closing it again does nothing."""
        if self._live is None:
            return
        parts, runner = self._live
        self._ended = _Ended(parts.options, parts.plan, runner.updates, runner.skipped_steps, runner.last_result)
        self._live = None
        group_lifetime.forget(self)
        groups = parts.engine.world.group_refs() if parts.engine.distributed else []
        runner.close()
        parts.connections.close()
        parts.engine.close()
        del parts, runner
        if any(group() is not None for group in groups):
            # A group's last holder sits in a reference cycle: free it (join its threads) now. A full collection
            # takes ~0.5 s in a process holding a model's captured graphs, so the pipeline's own objects keep none.
            gc.collect()

    # ----- what this process holds ------------------------------------------------------------
    @property
    def held_stages(self) -> dict[int, StageRuntime]:
        """The virtual stages this process runs, by index (every one locally, its rank's under torchrun):
        each has ``module``, ``optimizer``, ``policy`` (staleness) and its in-flight counters."""
        return dict(self._parts.stages)

    @property
    def world(self) -> World | None:
        """Under torchrun this rank's place (rank, position, replica and its process groups); None locally."""
        return self._parts.engine.world

    @property
    def gradient_reducer(self) -> Any:
        """Hybrid mode: this rank's GradientReducer (its buckets and algorithm choices, ``gradient_bytes`` held
        after the last reduction; with ``zero`` 1 or 2 a ShardedReducer, also ``stepped()`` and ``sent_bytes``);
        None otherwise (also under zero=3, where FSDP2 reduces)."""
        reducers = [r.reducer for r in self._parts.connections.reducers.values()]
        return reducers[0] if reducers else None

    @property
    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (every device agrees on it); None in other precisions."""
        scalers = [s.scaler for s in self._parts.steppers.values() if s.scaler is not None]
        return scalers[0].scale_value if scalers else None


def plain_inputs(x: Any) -> Any:
    """A Mapping of keyword inputs that is not a dict (a ``BatchEncoding``, a ``UserDict``) as a dict."""
    return dict(x) if isinstance(x, Mapping) and not isinstance(x, dict) else x


def _as_pair(batch: Any) -> tuple[Any, Any]:
    """One mini-batch of train(): an (inputs, targets) pair, or keyword inputs alone (targets inside)."""
    if isinstance(batch, Mapping):
        return plain_inputs(batch), None
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return plain_inputs(batch[0]), batch[1]
    raise TypeError(f"train() takes mini-batches as (inputs, targets) pairs, or as a Mapping of keyword inputs "
                    f"alone when the model computes its own loss from them (labels inside; loss_fn="
                    f"pipetrain.model_loss); got a {type(batch).__name__}"
                    + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else "")
                    + "; fix: make the loader yield (x, y), or a dict with the labels")

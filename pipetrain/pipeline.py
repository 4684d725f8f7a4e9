"""The Pipeline object ``wrap`` returns: the face over an assembled pipeline and its runner."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import partitioners
from pipetrain import checkpoint as ckpt
from pipetrain.assembly import assemble
from pipetrain.comm.peers import peers_answer
from pipetrain.comm.world import World
from pipetrain.options import PipelineOptions
from pipetrain.pretrained import own_tensors, save_pretrained
from pipetrain.runner import Runner
from pipetrain.runtime.metrics import StepResult
from pipetrain.runtime.stage import StageRuntime


class Pipeline:
    """A model split into pipeline stages, trained by a schedule on the local or distributed engine."""

    def __init__(self, model: nn.Module, example_inputs: Any, options: PipelineOptions):
        self._parts = assemble(model, example_inputs, options)
        self._runner = Runner(self._parts)

    @property
    def options(self) -> PipelineOptions:
        return self._parts.options

    @property
    def plan(self) -> partitioners.Plan:
        """The partition plan; ``print(pipe.plan)`` shows a per-stage table."""
        return self._parts.plan

    @property
    def updates(self) -> int:
        """Mini-batches trained so far (restored by ``load``)."""
        return self._runner.updates

    @property
    def skipped_steps(self) -> int:
        """Mini-batches whose update was skipped on every stage (non-finite values, fp16 overflow)."""
        return self._runner.skipped_steps

    @property
    def last_result(self) -> StepResult | None:
        return self._runner.last_result

    # ----- training and prediction ----------------------------------------------------------
    def step(self, x: Any, y: Any = None) -> float:
        """Train one mini-batch and return its mean loss (on every rank). ``y`` may be None when the
        model computes its own loss from its inputs (e.g. Hugging Face ``labels``, loss_fn=model_loss)."""
        if self.options.schedule == "async-1f1b":
            return next(iter(self.train([(x, y)]))).loss
        return self._runner.step(x, y).loss

    def train(self, batches: Iterable) -> Iterator[StepResult]:
        """Train on a stream of (inputs, targets) mini-batches, yielding one result per mini-batch.

        Synchronous schedules flush after every mini-batch; async-1f1b keeps the pipeline full
        for the whole stream and drains only when it ends. Under torchrun every rank iterates
        the same stream (in hybrid mode each replica keeps its own shard of every mini-batch).
        """
        if self.options.schedule == "async-1f1b":
            yield from self._runner.stream(batches)
            return
        for x, y in batches:
            yield self._runner.step(x, y)

    def predict(self, x: Any) -> Any:
        """Forward only in eval mode: what the unsplit model returns for the whole batch ``x``, on every rank,
        on the device of ``x``. Micro-batches are pipelined and their outputs concatenated when every output
        tensor is per sample; an output holding a value reduced over the batch (the loss of a model given
        ``labels``: a token mean with ignored labels is no weighted mean of micro-batch losses) is computed
        on the whole batch in one pass, which gives exactly the unsplit value."""
        return self._runner.predict(x)

    def request_stop(self) -> None:
        """Ask every rank to stop at the same step: from the next step report on, each rank's
        StepResult has ``stop_requested`` set (under torchrun it rides in the report the ranks already
        exchange, so it costs no collective of its own). Only sets a flag, so a signal handler may call
        it; stopping is the caller's (pipetrain's training loop saves and returns on SIGTERM)."""
        self._runner.stop_requested = True

    # ----- state and checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under the original model's names (this rank's share when distributed)."""
        out: dict[str, torch.Tensor] = {}
        for v in sorted(self._parts.stages):
            out.update(self._parts.stages[v].module.state_dict())
        return out

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
        self._runner.updates = ckpt.load_pipeline(self._checkpoint_view(), path)
        for reducer in self._parts.links.reducers.values():
            reducer.share_updates()  # ZeRO with a predicting policy: v of the loaded state, from each owner

    def resume(self, path: str | os.PathLike) -> bool:
        """Load the newest checkpoint under ``path`` if there is one (``--resume auto``); True if it did."""
        if ckpt.latest(path) is None:
            return False
        self.load(path)
        return True

    def save_pretrained(self, path: str | os.PathLike, max_shard_size: int = 5 * 10 ** 9) -> Path:
        """Write the model as a Hugging Face directory (safetensors shards of at most ``max_shard_size`` bytes,
        their index, the model's config.json) that ``from_pretrained`` loads; every rank calls it and writes
        only the tensors of its stages."""
        parts = self._parts
        world = parts.engine.world
        writes = world is None or world.replica == 0
        tensors = own_tensors({v: rt.module for v, rt in parts.stages.items()}, parts.pretrained,
                              parts.plan.tied_groups()) if writes else {}
        return save_pretrained(path, tensors, parts.pretrained, world.control if world is not None else None,
                               max_shard_size)

    def _checkpoint_view(self) -> ckpt.PipelineView:
        """What a checkpoint saves and restores of this pipeline, now."""
        parts = self._parts
        stages = {v: ckpt.StageState(rt.module, rt.optimizer, rt.policy,
                                     parts.steppers[parts.topology.position_of(v)].scaler)
                  for v, rt in sorted(parts.stages.items())}
        world = parts.engine.world
        streaming = self._runner.in_stream
        if world is None:
            role = ckpt.CheckpointRole(True, True, "local", ckpt.agree_alone, streaming, 0)
        else:
            merge = _merge_over(world.data_parallel_group) if parts.options.zero else None
            role = ckpt.CheckpointRole(world.replica == 0, world.rank == 0, "distributed",
                                       parts.engine.consensus.decide, streaming, world.rank, merge)
        return ckpt.PipelineView(parts.plan, parts.options, self._runner.updates, stages, role, parts.pretrained)

    def close(self) -> None:
        """Close the TensorBoard log."""
        self._runner.close()

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
        after the last reduction; with ``zero`` a ShardedReducer, also ``owned`` and ``sent_bytes``); None otherwise."""
        reducers = [r.reducer for r in self._parts.links.reducers.values()]
        return reducers[0] if reducers else None

    @property
    def loss_scale(self) -> float | None:
        """fp16: the current loss scale (every device agrees on it); None in other precisions."""
        scalers = [s.scaler for s in self._parts.steppers.values() if s.scaler is not None]
        return scalers[0].scale_value if scalers else None


def _merge_over(group: dist.ProcessGroup) -> Callable[[dict], dict | None]:
    """ZeRO checkpoints: gathers the replicas' optimizer shares onto replica 0 (group rank 0), merged."""
    def merge(share: dict) -> dict | None:
        shares = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
        with peers_answer("save: the replicas' ZeRO optimizer shares gathered onto replica 0 (every rank saves)"):
            dist.gather_object(share, shares, group=group, group_dst=0)
        return ckpt.merge_optimizer_shares(shares) if shares is not None else None
    return merge

"""What a save or load reads of a pipeline (``PipelineView``) and this process's part in it (``CheckpointRole``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from partitioners import Plan
from pipetrain.options import PipelineOptions
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.staleness import StalenessPolicy

if TYPE_CHECKING:
    from pipetrain.pretrained import PretrainedLayout


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

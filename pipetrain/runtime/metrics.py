"""What one mini-batch of training reports, and writing it to TensorBoard."""
from __future__ import annotations

from dataclasses import Field, dataclass, field, fields
from typing import Any

# What crosses the wire, by purpose: stage-to-stage activations and their gradients, gradient
# sums of parameters tied across stages, and the data-parallel gradient reduction (payload bytes).
COMM_KINDS = ("activations", "activation_grads", "tied_grads", "data_parallel")


class CommCounter:
    """Cumulative payload bytes by kind and stage; results report differences of snapshots."""

    def __init__(self, stages: int):
        self.bytes = {kind: [0] * stages for kind in COMM_KINDS}

    def add(self, kind: str, stage: int, nbytes: int) -> None:
        self.bytes[kind][stage] += nbytes

    def snapshot(self) -> dict[str, list[int]]:
        return {kind: list(v) for kind, v in self.bytes.items()}

    def since(self, snapshot: dict[str, list[int]]) -> dict[str, list[int]]:
        return {kind: [a - b for a, b in zip(v, snapshot[kind])] for kind, v in self.bytes.items()}


def _per_stage(kind: type, doc: str) -> Any:
    """A per-stage list of StepResult: ``kind`` is how it crosses processes (summed over ranks as float64,
    then averaged over replicas and cast back)."""
    return field(default_factory=list, metadata={"per_stage": kind, "doc": doc})


@dataclass
class StageReport:
    """One virtual stage's numbers for one mini-batch, as the stage itself measured them (its field names
    are those of StepResult's per-stage lists)."""

    version_lag: float
    weight_version_bytes: int
    activation_bytes: int
    prediction_distance: float
    prediction_error: Any  # a float, or a 0-dim tensor still on the stage's device (read once per report)
    peak_memory: int


@dataclass
class StepResult:
    """One trained mini-batch. Per-stage lists are indexed by virtual stage."""

    step: int
    loss: float
    samples: int
    seconds: float
    busy_fraction: list[float] = _per_stage(float, "share of the step's seconds the stage computed")
    version_lag: list[float] = _per_stage(float, "mean optimizer steps between forward and backward")
    weight_version_bytes: list[int] = _per_stage(int, "bytes in stashed / predicted weight copies")
    activation_bytes: list[int] = _per_stage(int, "peak bytes autograd held for in-flight micro-batches")
    # async-1f1b: mean updates ahead the forwards predicted the weights (spectrain, nesterov; 0 otherwise) and
    # the distance, in updates (lr * |v|), between a sampled forward's weights and those its gradient is applied to.
    prediction_distance: list[float] = _per_stage(float, "updates ahead the forwards predicted the weights")
    prediction_error: list[float] = _per_stage(float, "distance of a sampled forward's weights from the backward's")
    # On CUDA the device allocator's peak (torch.cuda.max_memory_allocated, since the process started or
    # torch.cuda.reset_peak_memory_stats); elsewhere the peak over this step of the stage's tensors (weights,
    # gradients, optimizer state, weight versions, held activations: pipetrain.runtime.tensor_bytes).
    peak_memory: list[int] = _per_stage(int, "measured peak bytes (mean over replicas)")
    comm_bytes: dict[str, list[int]] = field(default_factory=dict)  # payload bytes per COMM_KINDS entry, per stage
    skipped: bool = False  # no update was applied for this mini-batch (non-finite values or fp16 overflow), on any stage
    skipped_total: int = 0  # mini-batches skipped so far by this pipeline, this one included
    stop_requested: bool = False  # some rank called Pipeline.request_stop() before this step's report (agreed)
    # The global gradient norm of this update (norm_type; over every stage, tied copies once, after fp16 unscaling,
    # before clipping). NaN where it is not measured: an async-1f1b stream under torchrun without max_grad_norm,
    # whose skip-or-step agreement runs in the background.
    grad_norm: float = float("nan")

    @property
    def bytes_sent(self) -> list[int]:
        """Bytes each stage sent this step, all kinds together."""
        return [sum(kind[k] for kind in self.comm_bytes.values()) for k in range(len(self.busy_fraction))]

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")


class TensorBoardLog:
    """Scalars of every step under ``logdir`` (one run directory per pipeline)."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)

    def write(self, result: StepResult) -> None:
        w, s = self.writer, result.step
        w.add_scalar("train/loss", result.loss, s)
        w.add_scalar("train/samples_per_second", result.samples_per_second, s)
        w.add_scalar("train/skipped_steps", result.skipped_total, s)
        if result.grad_norm == result.grad_norm:  # NaN: not measured
            w.add_scalar("train/grad_norm", result.grad_norm, s)
        for k in range(len(result.busy_fraction)):
            w.add_scalar(f"stage{k}/busy_fraction", result.busy_fraction[k], s)
            w.add_scalar(f"stage{k}/version_lag", result.version_lag[k], s)
            w.add_scalar(f"stage{k}/prediction_distance", result.prediction_distance[k], s)
            if result.prediction_error[k] == result.prediction_error[k]:  # NaN: not measured this mini-batch
                w.add_scalar(f"stage{k}/prediction_error", result.prediction_error[k], s)
            w.add_scalar(f"stage{k}/weight_version_bytes", result.weight_version_bytes[k], s)
            w.add_scalar(f"stage{k}/activation_bytes", result.activation_bytes[k], s)
            if result.peak_memory:
                w.add_scalar(f"stage{k}/peak_memory_bytes", result.peak_memory[k], s)
            for kind, per_stage in result.comm_bytes.items():
                w.add_scalar(f"stage{k}/bytes_{kind}", per_stage[k], s)

    def close(self) -> None:
        self.writer.close()


def per_stage_fields() -> list[Field]:
    """StepResult's per-stage lists, in the order reports pack them."""
    return [f for f in fields(StepResult) if "per_stage" in f.metadata]

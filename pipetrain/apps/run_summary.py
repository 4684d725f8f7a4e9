"""What a training run of the apps measured: per-step losses, per-epoch records, per-stage means, traffic."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import pipetrain
from pipetrain.apps.run_config import RunConfig


@dataclass
class EpochRecord:
    """One epoch: mean train loss, validation loss/accuracy, throughput and traffic."""

    epoch: int
    step: int  # optimizer updates so far
    train_loss: float
    val_loss: float
    val_accuracy: float
    samples_per_second: float
    bytes_per_step: float
    train_seconds: float = math.nan  # the epoch's training: its steps' seconds summed (validation left out)


class PerStageMeans:
    """Per-stage means over a run's steps of the StepResult lists below; NaN entries (a mini-batch
    where nothing was measured) are left out of their stage's mean."""

    FIELDS = ("version_lag", "weight_version_bytes", "prediction_distance", "prediction_error")

    def __init__(self):
        self.sums: dict[str, list[float]] = {}
        self.counts: dict[str, list[int]] = {}

    def add(self, result: pipetrain.StepResult) -> None:
        for name in self.FIELDS:
            values = getattr(result, name)
            sums = self.sums.setdefault(name, [0.0] * len(values))
            counts = self.counts.setdefault(name, [0] * len(values))
            for k, value in enumerate(values):
                if value == value:
                    sums[k] += value
                    counts[k] += 1

    def mean(self, name: str) -> list[float]:
        return [s / n if n else math.nan for s, n in zip(self.sums.get(name, []), self.counts.get(name, []))]


@dataclass
class RunSummary:
    """Everything one run reports: per-step losses, per-epoch records, wall time."""

    config: RunConfig
    epochs: list[EpochRecord] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    version_lag: list[float] = field(default_factory=list)  # per stage, mean over steps
    weight_version_bytes: list[float] = field(default_factory=list)  # per stage, mean over steps
    prediction_distance: list[float] = field(default_factory=list)  # per stage, mean over steps
    prediction_error: list[float] = field(default_factory=list)  # per stage, mean over the measured steps
    # What the cost model needs to predict the run's speed elsewhere (pipetrain.apps.throughput): per step
    # and stage, seconds of compute (every F and B, as the runner times them); per stage, bytes of activations
    # sent to later stages, summed over the steps; and the bytes of each trainable parameter, last registered
    # first (about the order a backward finishes their gradients).
    step_busy_seconds: list[list[float]] = field(default_factory=list)
    stage_activation_bytes: list[float] = field(default_factory=list)
    gradient_bytes: list[int] = field(default_factory=list)
    samples: int = 0
    train_seconds: float = 0.0
    # This process's optimizer steps (pipetrain.apps.optimizer_clock): seconds inside them, and how many.
    optimizer_seconds: float = 0.0
    optimizer_steps: int = 0
    bytes_sent: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    preempted: bool = False  # stopped early by SIGTERM after saving a checkpoint; resume="auto" continues
    diverged: str = ""  # the NonFiniteError that ended the run (compare records it instead of stopping)

    @property
    def min_train_loss(self) -> float:
        return min((e.train_loss for e in self.epochs), default=math.nan)

    @property
    def min_val_loss(self) -> float:
        return min((e.val_loss for e in self.epochs), default=math.nan)

    @property
    def max_val_accuracy(self) -> float:
        return max((e.val_accuracy for e in self.epochs), default=math.nan)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else math.nan

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    def line(self) -> str:
        """The one-line summary the scripts end with."""
        c = self.config
        name = f"{c.label}: " if c.label else ""
        if self.diverged:
            return f"{name}{c.model} on {c.dataset}, {c.describe()}: diverged ({self.diverged.split(';')[0]})"
        return (f"{name}{c.model} on {c.dataset}, {c.describe()}, {len(self.epochs)} epochs ({self.steps} steps): "
                f"min train loss {self.min_train_loss:.4f}, min val loss {self.min_val_loss:.4f}, "
                f"max val accuracy {100 * self.max_val_accuracy:.2f}%, {self.samples_per_second:.0f} samples/s, "
                f"{human_bytes(self.bytes_per_step)}/step sent, {self.wall_seconds:.1f} s")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


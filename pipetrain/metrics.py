"""What one mini-batch of training reports, and writing it to TensorBoard."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StepResult:
    """One trained mini-batch. Per-stage lists are indexed by virtual stage."""

    step: int
    loss: float
    samples: int
    seconds: float
    busy_fraction: list[float] = field(default_factory=list)
    version_lag: list[float] = field(default_factory=list)         # mean optimizer steps between forward and backward
    weight_version_bytes: list[int] = field(default_factory=list)  # bytes in stashed / predicted weight copies
    activation_bytes: list[int] = field(default_factory=list)      # peak bytes autograd held for in-flight micro-batches
    bytes_sent: list[int] = field(default_factory=list)            # activation + gradient bytes sent this step
    peak_allocated: list[int] | None = None                        # device allocator peak, where the device reports it

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["samples_per_second"] = self.samples_per_second
        return out


class TensorBoardLog:
    """Scalars of every step under ``logdir`` (one run directory per pipeline)."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir)

    def write(self, result: StepResult) -> None:
        w, s = self.writer, result.step
        w.add_scalar("train/loss", result.loss, s)
        w.add_scalar("train/samples_per_second", result.samples_per_second, s)
        for k in range(len(result.busy_fraction)):
            w.add_scalar(f"stage{k}/busy_fraction", result.busy_fraction[k], s)
            w.add_scalar(f"stage{k}/version_lag", result.version_lag[k], s)
            w.add_scalar(f"stage{k}/weight_version_bytes", result.weight_version_bytes[k], s)
            w.add_scalar(f"stage{k}/activation_bytes", result.activation_bytes[k], s)
            w.add_scalar(f"stage{k}/bytes_sent", result.bytes_sent[k], s)

    def close(self) -> None:
        self.writer.close()

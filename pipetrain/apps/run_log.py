"""The training loop's own TensorBoard scalars: validation per epoch, and the loss curves again on a
samples axis so that runs at different batch sizes line up.

The pipeline's log (``logdir=``) steps every scalar by optimizer update. Two runs that see the same data
at different batch sizes (compare's ``+bs=N``) then differ in updates per epoch: a run of 8-sample updates
lies 8x to the right of a 64-sample run in the per-update charts. TensorBoard's x-axis is a scalar's step
(or wall time), so a second axis needs second tags. They share one prefix, ``by_samples/``, whose step is
the training samples consumed so far: TensorBoard groups charts by a tag's first path component, so every
samples-axis chart sits in one section, apart from the per-update ones (a suffix would mix the two axes in
one section), and each of its charts overlays every run of the log directory. The per-update tags stay as
they were (scripts and tests read them).
"""
from __future__ import annotations

import pipetrain
from pipetrain.apps.run_summary import EpochRecord

SAMPLES_AXIS = "by_samples/"  # prefix of the tags stepped by training samples consumed
OVERLAY_HINT = (f"to compare runs, overlay the {SAMPLES_AXIS} charts: their x is the training samples seen, so runs at "
                "different batch sizes line up (the train/, val/ and stage charts are per optimizer update)")


class RunLog:
    """Writes the loop's scalars into a run directory next to the pipeline's (a file of its own).

    Samples seen = updates x ``batch_size``: the loop trains full mini-batches only (a partial last one is
    dropped), so this holds after a resume too, where a running count would restart at 0."""

    def __init__(self, logdir: str, batch_size: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir, filename_suffix=".val")
        self.batch_size = batch_size

    def samples_seen(self, updates: int) -> int:
        """Training samples consumed by the first ``updates`` mini-batches."""
        return updates * self.batch_size

    def step(self, result: pipetrain.StepResult) -> None:
        """One mini-batch's loss on the samples axis (the pipeline's log has it per update)."""
        self.writer.add_scalar(f"{SAMPLES_AXIS}train/loss", result.loss, self.samples_seen(result.step))

    def epoch(self, record: EpochRecord) -> None:
        """An epoch's validation and mean train loss, per update and on the samples axis."""
        values = {"val/loss": record.val_loss, "val/accuracy": record.val_accuracy,
                  "train/epoch_loss": record.train_loss}
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, record.step)
            self.writer.add_scalar(SAMPLES_AXIS + tag, value, self.samples_seen(record.step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

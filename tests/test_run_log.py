"""The samples axis: runs at different batch sizes line up in TensorBoard's by_samples/ charts and in the
comparison's PNG, while the per-update tags keep their steps."""
from __future__ import annotations

import pytest

from pipetrain.apps.run_log import SAMPLES_AXIS
from pipetrain.cli import main

TRAIN, EPOCHS, BATCH = 64, 2, 16
TINY = ["--model", "vgg", "--width", "4", "--stages", "2", "--micro-batches", "2", "--train-samples", str(TRAIN),
        "--val-samples", "24", "--batch-size", str(BATCH), "--epochs", str(EPOCHS), "--partitioner", "params",
        "--no-progress"]
SMALL = "nesterov+sm+m=1+bs=8"  # the recommended m = 1 method: 8 samples per update, twice sync's updates here

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def _steps_and_values(run_dir, tag: str) -> tuple[list[int], list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    events = sorted(acc.Scalars(tag), key=lambda e: e.step)
    return [e.step for e in events], [e.value for e in events]


def test_runs_at_different_batch_sizes_end_at_the_same_samples(tmp_path, capsys):
    assert main(["compare", *TINY, "--logdir", str(tmp_path), "--methods", f"1f1b,{SMALL}"]) == 0
    for method, batch in (("1f1b", BATCH), (SMALL, 8)):
        updates = EPOCHS * TRAIN // batch  # 8 for sync, 16 for the 8-sample method
        steps, losses = _steps_and_values(tmp_path / method, "train/loss")  # per update, as before
        assert steps == list(range(1, updates + 1))
        by_samples, same_losses = _steps_and_values(tmp_path / method, SAMPLES_AXIS + "train/loss")
        assert by_samples == [batch * u for u in steps] and by_samples[-1] == EPOCHS * TRAIN
        assert same_losses == losses
        for tag in ("val/loss", "val/accuracy", "train/epoch_loss"):
            steps, values = _steps_and_values(tmp_path / method, tag)
            assert steps == [updates // EPOCHS * (e + 1) for e in range(EPOCHS)], (method, tag)
            assert _steps_and_values(tmp_path / method, SAMPLES_AXIS + tag) == ([TRAIN, EPOCHS * TRAIN], values)
    assert f"overlay the {SAMPLES_AXIS} charts" in capsys.readouterr().out  # the printed hint names the tags


def test_the_png_puts_every_method_on_the_samples_axis():
    from pipetrain.apps.compare import compare_figure
    from pipetrain.apps.run_config import RunConfig
    from pipetrain.apps.run_summary import EpochRecord, RunSummary
    from pipetrain.apps.throughput import local_cluster

    summaries = {}
    for method, batch in (("1f1b", 64), (SMALL, 8)):
        updates = TRAIN * 8 // batch  # one epoch of 512 samples
        s = RunSummary(RunConfig(model="vgg", dataset="digits", batch_size=batch, lr=0.05), step_losses=[1.0] * updates)
        s.epochs = [EpochRecord(1, updates, 1.0, 0.9, 0.5, 10.0, 0)]
        summaries[method] = s
    fig = compare_figure(summaries, {m: 1.0 for m in summaries}, local_cluster(2))
    curves = [ax for ax in fig.axes if ax.get_xlabel() == "training samples seen"]
    assert len(curves) == 3  # train loss, val loss, val accuracy
    for ax in curves:
        assert [line.get_xdata()[-1] for line in ax.get_lines()] == [TRAIN * 8, TRAIN * 8], ax.get_title()

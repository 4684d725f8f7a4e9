"""`pipetrain compare`: one TensorBoard run per method with the expected tags, a PNG, the table;
and how each method is configured."""
from __future__ import annotations

import pytest

from _example_runs import scalars
from pipetrain.cli import main
import json

from pipetrain.apps.compare import METHODS, MethodResult, format_table, method_config
from pipetrain.apps.training import RunConfig

TINY = ["--model", "vgg", "--width", "4", "--stages", "2", "--micro-batches", "2", "--train-samples", "64",
        "--val-samples", "24", "--batch-size", "16", "--epochs", "2", "--partitioner", "params", "--no-progress"]

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def test_compare_writes_runs_png_and_table(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["compare", *TINY, "--logdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for method in METHODS:
        acc = EventAccumulator(str(tmp_path / method), size_guidance={"scalars": 0})
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        stages = 1 if method == "data-parallel" else 2
        expected = {"train/loss", "train/samples_per_second", "val/loss", "val/accuracy"}
        expected |= {f"stage{k}/{name}" for k in range(stages)
                     for name in ("version_lag", "weight_version_bytes", "prediction_distance")}
        assert expected <= tags, (method, expected - tags)
        assert len(scalars(tmp_path / method, "train/loss")) == 2 * 64 // 16
        assert len(scalars(tmp_path / method, "val/accuracy")) == 2
        assert f"| {method} |" in out
    # Weight stashing keeps older versions and SpecTrain a predicted copy; vanilla keeps none.
    assert max(scalars(tmp_path / "stash", "stage0/weight_version_bytes")) > 0
    # SpecTrain keeps one predicted copy where it predicts (stage 0 of 2); the last stage of 2 predicts nothing.
    assert max(scalars(tmp_path / "spectrain", "stage0/weight_version_bytes")) > 0
    assert max(scalars(tmp_path / "spectrain", "stage1/weight_version_bytes")) == 0
    assert max(scalars(tmp_path / "vanilla", "stage0/weight_version_bytes")) == 0
    # Stage 0 of 2 runs its forward one micro-batch ahead: with 2 micro-batches per mini-batch, one
    # of them straddles an update once the stream is full (mean lag 0.5); the last stage never lags.
    assert max(scalars(tmp_path / "stash", "stage0/version_lag")) == 0.5
    assert max(scalars(tmp_path / "stash", "stage1/version_lag")) == 0
    # SpecTrain at stage 0 of 2 predicts each micro-batch's real lag (0 or 1 update, mean 0.5 when the
    # stream is full); nothing else predicts.
    assert max(scalars(tmp_path / "spectrain", "stage0/prediction_distance")) == 0.5
    assert max(scalars(tmp_path / "2bw", "stage0/prediction_distance")) == 0
    png = tmp_path / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # Every run records its per-stage compute and bytes and the speed predicted from them, named as such.
    for method, record in json.loads((tmp_path / "results.json").read_text()).items():
        run = record["runs"][0]
        stages = 1 if method == "data-parallel" else 2
        assert len(run["stage_seconds_per_step"]) == stages and min(run["stage_seconds_per_step"]) > 0
        assert (sum(run["stage_activation_bytes"]) > 0) == (stages > 1)
        assert run["predicted_samples_per_second"] > 0 and run["predicted_for"].startswith("2 of this machine's cores")
        assert run["measured_samples_per_second"] > 0 and run["measured_on"].startswith("local engine")
    assert "predicted samples/s: on 2 of this machine's cores" in out and "| local-engine samples/s |" in out
    assert f"tensorboard --logdir {tmp_path}" in out
    # A second comparison into the same directory would mix curves in TensorBoard.
    with pytest.raises(SystemExit, match="already holds runs"):
        main(["compare", *TINY, "--logdir", str(tmp_path), "--methods", "1f1b"])


def test_method_configs():
    base = RunConfig(stages=4, micro_batches=8, lr=0.1)
    dp = method_config(base, "data-parallel", world=4)
    assert (dp.stages, dp.micro_batches, dp.data_parallel, dp.schedule) == (1, 1, 4, "1f1b")
    assert method_config(base, "data-parallel").data_parallel == 1
    sync = method_config(base, "1f1b")
    assert (sync.stages, sync.micro_batches, sync.schedule, sync.staleness) == (4, 8, "1f1b", "none")
    for method in ("vanilla", "stash", "2bw", "spectrain", "nesterov"):
        c = method_config(base, method)
        assert (c.stages, c.micro_batches, c.schedule, c.staleness, c.lr) == (4, 8, "async-1f1b", method, 0.1)
        assert method_config(base, method, async_micro_batches=1).micro_batches == 1  # the papers' setting
    with pytest.raises(ValueError, match="unknown method"):
        method_config(base, "gpipe")
    ahead = method_config(base, "spectrain@2.5")
    assert (ahead.staleness, ahead.lookahead, ahead.label) == ("spectrain", 2.5, "spectrain@2.5")
    assert method_config(base, "stash").lookahead == 1.0
    with pytest.raises(ValueError, match="only spectrain and nesterov take a lookahead"):
        method_config(base, "stash@2")


def test_method_suffixes_turn_on_the_delay_corrections():
    base = RunConfig(stages=4, micro_batches=8, lr=0.1)
    plain = method_config(base, "nesterov")
    assert (plain.spike_compensation, plain.dc_lambda, plain.stage_lr_warmup, plain.stage_momentum,
            plain.error_feedback) == (False, 0.0, 0, False, False)
    every = method_config(base, "nesterov@2+sc+dc=0.5+pm=300+sm+ef")
    assert (every.staleness, every.lookahead, every.spike_compensation, every.dc_lambda, every.stage_lr_warmup,
            every.stage_momentum, every.error_feedback) == ("nesterov", 2.0, True, 0.5, 300, True, True)
    defaults = method_config(base, "stash+dc+pm")
    assert (defaults.dc_lambda, defaults.stage_lr_warmup) == (2.0, 500)  # DC-ASGD-a's paper; PIPEMARE_WARMUP
    assert method_config(base, "spectrain+fo+sc").spectrain_variant == "forward-only"
    assert "stage momentum" in method_config(base, "stash+sm").describe()
    assert "error feedback" in method_config(base, "2bw+ef").describe()
    for bad, message in (("stash+fo", "unknown suffix"), ("stash+sm=2", "unknown suffix"), ("1f1b+sm", "has none"),
                         ("2bw+ef=1", "unknown suffix"),
                         ("nesterov+xx", "unknown suffix")):
        with pytest.raises(ValueError, match=message):
            method_config(base, bad)


def test_a_method_at_its_own_batch_size_trains_at_the_linearly_scaled_rate(tmp_path, capsys):
    base = RunConfig(stages=4, micro_batches=8, lr=0.1, batch_size=64)
    small = method_config(base, "nesterov+sm+bs=8", async_micro_batches=1)
    assert (small.batch_size, small.micro_batches, small.stage_momentum) == (8, 1, True)
    assert method_config(base, "data-parallel+bs=8").batch_size == 8  # the synchronous control takes it too
    own = method_config(base, "nesterov+sm+m=1+bs=8")  # its own micro-batches, whatever --async-micro-batches says
    assert (own.batch_size, own.micro_batches) == (8, 1)
    assert method_config(base, "nesterov+m=2", async_micro_batches=1).micro_batches == 2
    assert method_config(base, "1f1b+m=4").micro_batches == 4
    for bad in ("1f1b+sm+bs=8", "nesterov+bs=0", "nesterov+bs", "data-parallel+m=2", "nesterov+m=0"):
        with pytest.raises(ValueError):
            method_config(base, bad)
    # Through compare: each run's own rate is the grid's times 8 / 16, the table keys it by the grid's rate.
    # Epochs to target against the control at the same batch, by --baseline.
    assert main(["compare", *TINY, "--epochs", "1", "--logdir", str(tmp_path), "--methods",
                 "1f1b,nesterov+bs=8,data-parallel+bs=8", "--baseline", "data-parallel+bs=8",
                 "--async-micro-batches", "1", "--lr-grid", "0.02,0.04"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "results.json").read_text())
    for method, batch, factor in (("1f1b", 16, 1.0), ("nesterov+bs=8", 8, 0.5), ("data-parallel+bs=8", 8, 0.5)):
        for r in record[method]["runs"]:
            assert (r["config"]["batch_size"], r["config"]["lr"]) == (batch, pytest.approx(r["lr"] * factor))
    assert "micro-batches, batch 8 |" in out and "linear scaling" in out
    assert "x data-parallel+bs=8's epochs" in out
    with pytest.raises(SystemExit, match="must be one of --methods and synchronous"):
        main(["compare", *TINY, "--logdir", str(tmp_path / "bad"), "--methods", "1f1b,nesterov",
              "--baseline", "nesterov"])


def test_a_grid_reports_each_method_at_its_best_rate_over_seeds(tmp_path, capsys):
    argv = ["compare", *TINY, "--epochs", "1", "--logdir", str(tmp_path), "--methods", "1f1b,nesterov@0.5",
            "--lr-grid", "0.002,0.2", "--seeds", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "results.json").read_text())
    for method in ("1f1b", "nesterov@0.5"):
        runs = record[method]["runs"]
        assert sorted((r["lr"], r["seed"]) for r in runs) == [(0.002, 0), (0.002, 1), (0.2, 0), (0.2, 1)]
        for r in runs:
            assert (tmp_path / method / f"lr{r['lr']:g}-seed{r['seed']}").is_dir()
        mean = {lr: sum(r["max_val_accuracy"] for r in runs if r["lr"] == lr) / 2 for lr in (0.002, 0.2)}
        assert record[method]["best_lr"] == max(mean, key=mean.get)
        assert f"| {method} |" in out
    # Two seeds of the same method and rate differ (otherwise the spread would mean nothing).
    seed_runs = [r for r in record["1f1b"]["runs"] if r["lr"] == 0.2]
    assert seed_runs[0]["epochs"][0]["train_loss"] != seed_runs[1]["epochs"][0]["train_loss"]
    assert "±" in out and "mean ± sample standard deviation over 2 seeds" in out


def test_a_diverging_rate_is_recorded_and_the_grid_goes_on(tmp_path, capsys):
    assert main(["compare", *TINY, "--epochs", "1", "--logdir", str(tmp_path), "--methods", "stash",
                 "--lr-grid", "1e12,0.05"]) == 0
    out = capsys.readouterr().out
    runs = {r["lr"]: r for r in json.loads((tmp_path / "results.json").read_text())["stash"]["runs"]}
    assert "NaN or infinite" in runs[1e12]["diverged"] and not runs[0.05]["diverged"]
    assert json.loads((tmp_path / "results.json").read_text())["stash"]["best_lr"] == 0.05
    assert "diverged (the loss is NaN or infinite" in out


def test_unknown_method_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown method"):
        main(["compare", *TINY, "--logdir", str(tmp_path), "--methods", "1f1b,pipedream"])


def test_a_method_with_bad_options_stops_compare_before_any_training(tmp_path, monkeypatch):
    import pipetrain.apps.compare as compare_module

    trained = []
    monkeypatch.setattr(compare_module, "run", lambda config: trained.append(config.label))
    # fp16 is fine for data-parallel and 1f1b but not for async-1f1b (its loss scaling needs agreed skips).
    with pytest.raises(SystemExit, match="fp16 loss scaling needs every stage to agree"):
        main(["compare", *TINY, "--logdir", str(tmp_path), "--precision", "fp16",
              "--methods", "data-parallel,1f1b,vanilla"])
    assert trained == []


def test_table_has_one_row_per_method():
    from pipetrain.apps.training import EpochRecord, RunSummary

    s = RunSummary(RunConfig(model="vgg", dataset="digits", micro_batches=4), steps=2, samples=100,
                   train_seconds=2.0, bytes_sent=3000)
    s.epochs = [EpochRecord(1, 1, 0.9, 0.8, 0.5, 50.0, 0), EpochRecord(2, 2, 0.7, 0.85, 0.6, 50.0, 0)]
    table = format_table({"stash": MethodResult({(0.05, 0): s})})
    row = table.splitlines()[2]
    assert row.startswith("| stash | 1f1b 4 stages x 4 micro-batches | 0.7000 | 0.8000 | 60.00% | 50 | 1.5 KB |")


def test_a_seed_that_diverged_before_its_first_epoch_still_gives_a_table():
    # One seed of the best rate diverged at once (no epoch: NaN losses), the other trained: the table
    # counts the diverged seed's accuracy as 0 and has no loss mean or spread (NaN) instead of failing.
    from pipetrain.apps.training import EpochRecord, RunSummary

    good = RunSummary(RunConfig(model="vgg", dataset="digits"), steps=2, samples=100, train_seconds=2.0)
    good.epochs = [EpochRecord(1, 1, 0.9, 0.8, 0.5, 50.0, 0)]
    bad = RunSummary(RunConfig(model="vgg", dataset="digits"), steps=1, samples=50, train_seconds=1.0)
    bad.diverged = "NonFiniteError: the loss is NaN"
    row = format_table({"stash": MethodResult({(0.3, 0): good, (0.3, 1): bad})}).splitlines()[2]
    assert "| nan ± nan | nan ± nan | 25.00% ± 35.36% |" in row, row  # acc: mean of 50 and 0, sd 50/sqrt(2)


def test_the_png_shows_predicted_speed_for_the_named_cluster_readably(tmp_path):
    from pipetrain.apps.compare import compare_figure, plot
    from pipetrain.apps.throughput import local_cluster
    from pipetrain.apps.training import EpochRecord, RunSummary

    summaries, predicted = {}, {}
    for i, method in enumerate(METHODS):
        stages = 1 if method == "data-parallel" else 4
        s = RunSummary(RunConfig(model="vgg", dataset="digits", stages=stages, batch_size=64, lr=0.05),
                       step_losses=[2.0, 1.0, 0.5])
        s.epochs = [EpochRecord(1, 3, 1.0, 0.9, 0.5, 10.0, 0)]
        summaries[method], predicted[method] = s, 1000.0 + 250 * i
    predicted["2bw"] = float("nan")  # a run that measured nothing
    cluster = local_cluster(4)
    fig = compare_figure(summaries, predicted, cluster)
    fig.canvas.draw()
    speed_ax = next(ax for ax in fig.axes if "predicted" in ax.get_title())
    assert cluster.name in " ".join(speed_ax.get_title().split())  # wrapped, but whole
    labels = [t.get_text() for t in speed_ax.get_yticklabels()]
    assert labels == list(METHODS)
    printed = [t.get_text() for t in speed_ax.texts]
    assert "1,000" in printed and "not measured" in printed and f"{1000 + 250 * 6:,}" in printed
    # Readable: every panel (with its title, labels and printed values) and the figure title lie inside
    # the figure and overlap no other panel, and no two texts of the throughput panel overlap.
    renderer = fig.canvas.get_renderer()
    inside = fig.bbox.padded(1)
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes]
    for box in [*panels, fig._suptitle.get_window_extent(renderer)]:
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1, box
    for i, box in enumerate(panels):
        assert not any(box.overlaps(other) for other in panels[i + 1:]), i
    panel = [speed_ax.title, *speed_ax.get_yticklabels(), *speed_ax.texts, speed_ax.xaxis.label]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in panel if t.get_text()]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    png = plot(summaries, predicted, cluster, tmp_path / "compare.png", dpi=80)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

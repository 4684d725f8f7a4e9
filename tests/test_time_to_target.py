"""Epochs and predicted time to target (pipetrain.apps.time_to_target) on hand-made runs, and in the table
`pipetrain compare` prints."""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import statistics

import pytest

from pipetrain.apps.compare import (MethodResult, SpeedPrediction, add_arguments_compare, format_table, predict_speed,
                                    run_compare)
from pipetrain.apps.run_config import RunConfig
from pipetrain.apps.run_summary import EpochRecord, RunSummary
from pipetrain.apps.throughput import local_cluster
from pipetrain.apps.time_to_target import (Ratio, Reach, baseline_of, epochs_to_target, mean_curve,
                                           measured_seconds_to_target, samples_per_epoch, seconds_to_target,
                                           spread_text, target, to_target)

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def summary(*accuracies: float, samples_per_epoch: int = 64) -> RunSummary:
    """A run whose validation accuracy at epoch i is accuracies[i - 1]; no accuracies: diverged at once."""
    s = RunSummary(RunConfig(model="lstm", dataset="mnist1d", stages=2, micro_batches=2), steps=4 * len(accuracies),
                   samples=samples_per_epoch * len(accuracies), train_seconds=1.0)
    s.epochs = [EpochRecord(i + 1, 4 * (i + 1), 1.0, 1.0, a, 50.0, 0) for i, a in enumerate(accuracies)]
    s.diverged = "" if accuracies else "NonFiniteError: the loss is NaN"
    return s


def test_the_baseline_is_1f1b_else_data_parallel_else_none():
    assert baseline_of(["vanilla", "data-parallel", "1f1b"]) == "1f1b"
    assert baseline_of(["data-parallel", "stash"]) == "data-parallel"
    assert baseline_of(["stash", "nesterov"]) is None


def test_reaching_at_epoch_3_against_the_baselines_2_is_a_ratio_of_1_5():
    # Baseline peaks at 0.8 (target 0.79), reached at epoch 2; the method first reaches it at epoch 3.
    t = to_target({"1f1b": {0: summary(0.5, 0.8, 0.8)}, "stash": {0: summary(0.3, 0.6, 0.85)}})
    assert t.baseline == "1f1b" and t.goal == pytest.approx(0.79)
    assert t.methods["1f1b"].reach == Reach(2, 3) and t.methods["1f1b"].ratio == Ratio(1.0, "=")
    assert t.methods["stash"].reach == Reach(3, 3) and t.methods["stash"].ratio == Ratio(1.5, "=")
    assert str(t.methods["stash"].ratio) == "1.50" and t.methods["stash"].seeds == {0: Ratio(1.5, "=")}


def test_a_method_that_never_reaches_the_target_is_shown_as_such_with_a_lower_bound():
    t = to_target({"1f1b": {0: summary(0.5, 0.8, 0.8)}, "vanilla": {0: summary(0.1, 0.2, 0.78)}})
    never = t.methods["vanilla"]
    assert never.reach == Reach(None, 3) and str(never.reach) == "never (3 epochs)"
    assert never.ratio == Ratio(1.5, ">") and str(never.ratio) == ">1.50"  # 3 epochs were not enough: > 3 / 2
    assert math.isnan(seconds_to_target(never.reach, 64, 100.0))


def test_seeds_reaching_at_different_epochs_give_per_seed_ratios_and_the_mean_curves_ratio():
    baseline = {0: summary(0.5, 0.8, 0.8), 1: summary(0.8, 0.8, 0.8)}  # mean 0.65, 0.8, 0.8: target 0.79 at 2
    method = {0: summary(0.5, 0.6, 0.8), 1: summary(0.5, 0.8, 0.8)}  # mean 0.5, 0.7, 0.8: at 3
    assert mean_curve(method.values(), 3) == pytest.approx([0.5, 0.7, 0.8])
    t = to_target({"1f1b": baseline, "nesterov": method})
    m = t.methods["nesterov"]
    assert m.reach == Reach(3, 3) and m.ratio == Ratio(1.5, "=")
    assert m.seeds == {0: Ratio(3 / 2, "="), 1: Ratio(2 / 1, "=")}  # seed 0: 3 over 2; seed 1: 2 over 1
    assert spread_text(m.seeds.values()) == "1.50–2.00"
    assert spread_text([Ratio(1.0, "="), Ratio(3.0, ">"), Ratio(math.nan, "?")]) == "1.00–>3.00, ?"


def test_nan_accuracies_and_diverged_seeds_count_as_zero_not_as_holes():
    baseline = {0: summary(0.6, 0.8), 1: summary(0.6, 0.8)}  # target 0.79 at epoch 2
    # Seed 0's NaN at epoch 2 counts as 0 (not skipped: the mean would be 0.9 then); seed 1 diverged at once.
    t = to_target({"1f1b": baseline, "spectrain": {0: summary(0.9, math.nan), 1: summary()}})
    m = t.methods["spectrain"]
    assert m.reach == Reach(None, 2)  # mean curve 0.45, 0
    assert m.seeds == {0: Ratio(0.5, "="), 1: Ratio(1.0, ">")}  # seed 1: never within the 2 epochs the others ran
    assert m.samples_per_epoch == 64  # from the seed that finished epochs
    # A diverged baseline leaves nothing to aim at, and the table says why instead of failing.
    dead = {"1f1b": MethodResult({(0.1, 0): summary()}), "stash": MethodResult({(0.1, 0): summary(0.5)})}
    assert to_target({m: r.best_by_seed for m, r in dead.items()}) is None
    table = format_table(dead)
    assert "epochs to target" not in table.splitlines()[0] and "no epochs to target: every seed of the baseline diverged" in table


def test_a_target_met_exactly_counts_as_reached():
    # 0.1 - 0.01 is 0.09000000000000001 in floating point: an accuracy of exactly 9% (45 of 500) meets it.
    assert target([summary(0.05, 0.1)], 2) == 0.1 - 0.01 > 0.09
    assert epochs_to_target([0.05, 0.09], 0.1 - 0.01) == Reach(2, 2)
    assert epochs_to_target([0.05, 0.0899], 0.09) == Reach(None, 2)


def test_time_to_target_is_epochs_times_samples_per_epoch_over_samples_per_second():
    assert samples_per_epoch([summary(0.1, 0.2, samples_per_epoch=1000), summary(0.3, samples_per_epoch=500)]) == 750
    assert seconds_to_target(Reach(3, 5), 1000.0, 500.0) == 6.0


def test_the_table_adds_the_columns_and_says_what_the_target_and_the_prediction_are():
    results = {"data-parallel": MethodResult({(0.1, 0): summary(0.5, 0.8, 0.8), (0.1, 1): summary(0.8, 0.8, 0.8)}),
               "vanilla": MethodResult({(0.1, 0): summary(0.5, 0.6, 0.8), (0.1, 1): summary(0.1, 0.1, 0.1)})}
    speed = SpeedPrediction(local_cluster(2), {"data-parallel": {(0.1, 0): 32.0, (0.1, 1): 32.0},
                                               "vanilla": {(0.1, 0): 64.0, (0.1, 1): math.nan}})
    lines = format_table(results, speed).splitlines()
    assert lines[0].endswith("| predicted samples/s | epochs to target | x data-parallel's epochs (seeds) "
                             "| predicted time to target |")
    # data-parallel: mean curve 0.65, 0.8, 0.8 reaches 0.79 at epoch 2: 2 x 64 samples / 32 samples/s = 4 s.
    assert lines[2].endswith("| 32 | 2 | 1.00 (1.00–1.00) | 4 s |"), lines[2]
    # vanilla: mean 0.3, 0.35, 0.45 never does; seed 0 at 3 (baseline's seed 0 at 2), seed 1 never (> 3 / 1).
    assert lines[3].endswith("| 64 | never (3 epochs) | >1.50 (1.50–>3.00) | never |"), lines[3]
    text = "\n".join(lines)
    assert "target: data-parallel's peak mean val accuracy 80.00% - 1 = 79.00%" in text
    assert "predicted time to target" in text and "not a measurement" in text
    assert "no epochs to target: no synchronous baseline (1f1b or data-parallel)" in format_table(
        {"stash": results["vanilla"]})


@pytest.mark.slow
def test_a_real_comparison_prints_epochs_and_time_to_target_computed_from_its_runs(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments_compare(parser)
    args = parser.parse_args(["--model", "lstm", "--width", "8", "--stages", "2", "--micro-batches", "2",
                              "--epochs", "2", "--train-samples", "64", "--val-samples", "32", "--batch-size", "16",
                              "--lr", "0.3", "--methods", "1f1b,stash", "--seeds", "0,1", "--target-gap", "2",
                              "--no-progress", "--logdir", str(tmp_path)])
    results, _ = run_compare(args)
    out = capsys.readouterr().out
    # Recomputed here from the runs, independently of the module: the target is 1f1b's peak mean accuracy - 2.
    curves = {m: [[e.val_accuracy for e in r.best_by_seed[seed].epochs] for seed in (0, 1)] for m, r in results.items()}
    mean = {m: [statistics.fmean(pair) for pair in zip(*c)] for m, c in curves.items()}
    goal = max(mean["1f1b"]) - 0.02

    def first(curve):
        return next((i + 1 for i, a in enumerate(curve) if a >= goal - 1e-9), None)

    rows = {line.split(" | ")[0][2:]: line.strip("|").split(" | ") for line in out.splitlines() if line.startswith("| ")}
    assert rows["method"][-3:] == ["epochs to target", "x 1f1b's epochs (seeds)", "predicted time to target "]
    for m in results:
        reached, per_seed = first(mean[m]), [first(c) for c in curves[m]]
        sync_seeds = [first(c) for c in curves["1f1b"]]
        epochs_cell, ratio_cell, time_cell = (cell.strip() for cell in rows[m][-3:])
        assert epochs_cell == (str(reached) if reached else "never (2 epochs)"), (m, epochs_cell)
        ratio = (reached or 2) / first(mean["1f1b"])
        assert re.fullmatch(rf"{'' if reached else '>'}{ratio:.2f} \(.*\)", ratio_cell), (m, ratio_cell)
        bounds = sorted((a or 2) / b for a, b in zip(per_seed, sync_seeds) if b)
        assert f"{bounds[0]:.2f}" in ratio_cell and f"{bounds[-1]:.2f}" in ratio_cell, (m, ratio_cell)
        seconds = reached * 64 / predict_speed(results).of_best(m, results[m]) if reached else None  # 64 per epoch
        assert time_cell == (f"{seconds:.3g} s" if seconds else "never"), (m, time_cell)  # well under 100 s
    assert "target: 1f1b's peak mean val accuracy" in out and "- 2 = " in out


def timed(accuracies: list[float], epoch_seconds: list[float], optimizer: tuple[float, int] = (0.0, 0)) -> RunSummary:
    """summary() whose epochs took ``epoch_seconds`` of training and whose optimizer steps took ``optimizer``
    (seconds, steps)."""
    s = summary(*accuracies)
    s.epochs = [dataclasses.replace(e, train_seconds=t) for e, t in zip(s.epochs, epoch_seconds)]
    s.train_seconds = sum(epoch_seconds)
    s.optimizer_seconds, s.optimizer_steps = optimizer
    return s


def test_measured_time_to_target_sums_each_seeds_epochs_to_the_mean_curves_epoch():
    runs = [timed([0.5, 0.8, 0.9], [2.0, 3.0, 4.0]), timed([0.7, 0.8, 0.9], [1.0, 1.0, 1.0])]
    # Mean curve 0.6, 0.8, 0.9: a goal of 0.75 is reached at epoch 2; the seeds took 5 s and 2 s to it.
    assert measured_seconds_to_target(epochs_to_target(mean_curve(runs, 3), 0.75), runs) == pytest.approx(3.5)
    assert math.isnan(measured_seconds_to_target(Reach(None, 3), runs))
    assert math.isnan(measured_seconds_to_target(Reach(3, 3), [timed([0.5, 0.8], [1.0, 1.0])]))  # no epoch 3


def test_under_torchrun_the_table_gives_measured_time_to_target_and_the_optimizers_share(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    sync = MethodResult({(0.1, 0): timed([0.6, 0.8, 0.8], [10.0, 10.0, 10.0], optimizer=(1.5, 12))})
    recipe = MethodResult({(0.1, 0): timed([0.7, 0.8, 0.8], [12.0, 12.0, 12.0], optimizer=(7.2, 96))})
    table = format_table({"1f1b": sync, "nesterov": recipe})
    head, _, sync_row, recipe_row = table.splitlines()[:4]
    columns = [c.strip() for c in head.strip("|").split("|")]
    cells = {row.split("|")[1].strip(): [c.strip() for c in row.strip("|").split("|")] for row in (sync_row, recipe_row)}
    at = columns.index("measured time to target")
    assert cells["1f1b"][at] == "20 s" and cells["nesterov"][at] == "24 s"  # target 0.79: epoch 2 for both
    at = columns.index("optimizer step (share)")
    assert cells["1f1b"][at] == "0.125 s (5%)" and cells["nesterov"][at] == "0.075 s (20%)"
    monkeypatch.delenv("WORLD_SIZE")
    assert "measured time to target" not in format_table({"1f1b": sync, "nesterov": recipe})

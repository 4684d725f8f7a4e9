"""Epochs and predicted time to a target accuracy: how much longer a method must train than the sync baseline.

Best accuracy alone hides what asynchrony trades: a method that ends within a point of synchronous
training but needs twice its epochs loses the time it saved by dropping the flush. So `pipetrain
compare` measures, per method, the epochs its validation accuracy needs to reach a target, the
synchronous baseline's best mean accuracy minus a margin (1 point). Curves are per epoch; an epoch
a run did not reach (it diverged) or a NaN accuracy counts as 0, the worst score, as compare's
choice of the best learning rate counts it. The baseline's mean curve reaches the target by
construction (its peak is the best mean accuracy), so the ratio of mean curves is always defined.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from pipetrain.apps.run_summary import RunSummary

BASELINES = ("1f1b", "data-parallel")  # the synchronous baselines, in order of preference
MARGIN = 0.01  # the target lies 1 point of accuracy below the baseline's best
TOLERANCE = 1e-9  # far below one validation sample's share of accuracy


def baseline_of(methods: Iterable[str]) -> str | None:
    """The synchronous method the others are measured against: 1f1b if compared (the same pipeline with a
    flush), else data-parallel; None when neither is."""
    present = set(methods)
    return next((b for b in BASELINES if b in present), None)


def accuracy_curve(summary: RunSummary, epochs: int) -> list[float]:
    """The run's validation accuracy at epochs 1..``epochs``; a NaN or a missing epoch counts as 0."""
    by_epoch = {e.epoch: e.val_accuracy for e in summary.epochs}
    return [_finite(by_epoch.get(epoch, 0.0)) for epoch in range(1, epochs + 1)]


def mean_curve(runs: Iterable[RunSummary], epochs: int) -> list[float]:
    """Per epoch, the mean over ``runs`` (one per seed) of accuracy_curve."""
    curves = [accuracy_curve(s, epochs) for s in runs]
    return [statistics.fmean(values) for values in zip(*curves)] if curves else [0.0] * epochs


def target(baseline: Iterable[RunSummary], epochs: int, margin: float = MARGIN) -> float | None:
    """The baseline's best mean validation accuracy (the peak of its mean curve) minus ``margin``; None when
    the baseline has no epoch at all (every seed diverged at once), so there is nothing to aim at."""
    runs = list(baseline)
    if not any(s.epochs for s in runs):
        return None
    return max(mean_curve(runs, epochs)) - margin


@dataclass(frozen=True)
class Reach:
    """When a curve first reaches the target: ``epoch`` (1-based), or None if not within its ``epochs``."""

    epoch: int | None
    epochs: int

    def __str__(self) -> str:
        return str(self.epoch) if self.epoch is not None else f"never ({self.epochs} epochs)"


def epochs_to_target(curve: Sequence[float], goal: float) -> Reach:
    """The first epoch whose accuracy is at least ``goal`` (met exactly counts)."""
    # goal is best - margin in floating point: an accuracy equal to it in decimals may lie an ulp below.
    epoch = next((i + 1 for i, accuracy in enumerate(curve) if accuracy >= goal - TOLERANCE), None)
    return Reach(epoch, len(curve))


@dataclass(frozen=True)
class Ratio:
    """A method's epochs to target over the baseline's. ``bound`` says what is known: "=" the value; ">" at
    least it (the method never reached the target: its epochs run stand in); "<" at most it (the baseline
    never did); "?" nothing (neither did, value NaN)."""

    value: float
    bound: str

    def __str__(self) -> str:
        if self.bound == "?":
            return "?"
        return f"{'' if self.bound == '=' else self.bound}{self.value:.2f}"


def ratio(method: Reach, baseline: Reach) -> Ratio:
    """``method``'s epochs to target over ``baseline``'s, a bound where one of them never got there."""
    if method.epoch is not None and baseline.epoch is not None:
        return Ratio(method.epoch / baseline.epoch, "=")
    if baseline.epoch is not None:
        return Ratio(method.epochs / baseline.epoch, ">")
    if method.epoch is not None and baseline.epochs:
        return Ratio(method.epoch / baseline.epochs, "<")
    return Ratio(math.nan, "?")


def seed_ratios(method: Mapping[int, RunSummary], baseline: Mapping[int, RunSummary], goal: float,
                epochs: int) -> dict[int, Ratio]:
    """Per seed both ran, the method's run's epochs to ``goal`` over the baseline's run of the same seed
    (same data order and initial weights, so the pairing removes the seed's own luck)."""
    return {seed: ratio(epochs_to_target(accuracy_curve(method[seed], epochs), goal),
                        epochs_to_target(accuracy_curve(baseline[seed], epochs), goal))
            for seed in sorted(method.keys() & baseline.keys())}


def spread_text(ratios: Iterable[Ratio]) -> str:
    """The per-seed ratios' min–max ("1.00–2.00", bounds marked as in Ratio, "?" appended if a seed has none)."""
    ratios = list(ratios)
    known = sorted((r for r in ratios if r.bound != "?"), key=lambda r: r.value)
    texts = [] if not known else [str(known[0])] if len(known) == 1 else [f"{known[0]}–{known[-1]}"]
    if any(r.bound == "?" for r in ratios):
        texts.append("?")
    return ", ".join(texts)


def samples_per_epoch(runs: Iterable[RunSummary]) -> float:
    """The samples one epoch trains (all replicas together): the mean over the runs that finished an epoch."""
    values = [s.samples / len(s.epochs) for s in runs if s.epochs]
    return statistics.fmean(values) if values else math.nan


def seconds_to_target(reach: Reach, epoch_samples: float, samples_per_second: float) -> float:
    """Epochs to target x samples per epoch / samples per second; NaN if the target was never reached."""
    if reach.epoch is None:
        return math.nan
    return reach.epoch * epoch_samples / samples_per_second


def measured_seconds_to_target(reach: Reach, runs: Iterable[RunSummary]) -> float:
    """The training seconds the runs (one per seed) took to the target: each run's epochs up to ``reach``'s
    (validation left out) summed, the mean over the runs; NaN if the target was never reached or a run lacks
    those epochs."""
    if reach.epoch is None:
        return math.nan
    totals = [sum(e.train_seconds for e in s.epochs[:reach.epoch]) for s in runs]
    if not totals or any(len(s.epochs) < reach.epoch for s in runs):
        return math.nan
    return statistics.fmean(totals)


@dataclass(frozen=True)
class ToTarget:
    """One method against the target: its mean curve's epochs to it, that over the baseline's, the same per
    seed, and the samples an epoch trains (to turn epochs into time)."""

    reach: Reach
    ratio: Ratio
    seeds: dict[int, Ratio]
    samples_per_epoch: float
    measured_seconds: float  # measured_seconds_to_target: meaningful where the run's seconds are, under torchrun


@dataclass(frozen=True)
class Targets:
    """Every method measured against ``goal``, the ``baseline``'s best mean accuracy minus ``margin``."""

    baseline: str
    goal: float
    margin: float
    methods: dict[str, ToTarget]


def to_target(best: Mapping[str, Mapping[int, RunSummary]], margin: float = MARGIN,
              baseline: str | None = None) -> Targets | None:
    """Each method's runs at its best learning rate, by seed, measured against ``baseline`` (default:
    baseline_of); None without a baseline or when its every seed diverged at once. Curves span the longest run,
    so a method that diverged early is "never" within the epochs the others trained."""
    if baseline is not None and baseline not in best:
        raise ValueError(f"the baseline {baseline!r} is not among the methods compared ({', '.join(best)})")
    name = baseline or baseline_of(best)
    epochs = max((len(s.epochs) for runs in best.values() for s in runs.values()), default=0)
    goal = None if name is None else target(best[name].values(), epochs, margin)
    if goal is None:
        return None
    base = best[name]
    base_reach = epochs_to_target(mean_curve(base.values(), epochs), goal)
    methods = {}
    for method, runs in best.items():
        reach = epochs_to_target(mean_curve(runs.values(), epochs), goal)
        methods[method] = ToTarget(reach, ratio(reach, base_reach), seed_ratios(runs, base, goal, epochs),
                                   samples_per_epoch(runs.values()), measured_seconds_to_target(reach, runs.values()))
    return Targets(name, goal, margin, methods)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0

"""`pipetrain compare`: the same model, data and seed trained by each staleness method.

Methods: "data-parallel" (the synchronous baseline: a one-stage pipeline is plain training;
under torchrun stages=1 and data_parallel=world), "1f1b" (synchronous pipeline with a flush),
and async-1f1b with "vanilla" (stale weights), "stash" (PipeDream weight stashing), "2bw"
(PipeDream-2BW), "spectrain" (weight prediction) and "nesterov" (Nesterov look-ahead);
"spectrain@2" is spectrain with lookahead 2 (likewise nesterov@x). The pipelines all split each
mini-batch into the same micro-batches (so the same updates per epoch); `async_micro_batches=1`
gives the papers' setting, one micro-batch per mini-batch, where stage k's weights are
stages - k - 1 updates stale instead of a fraction of one.

Batch sizes side by side: every method trains with the run's one ``--optimizer``, and a method with ``+bs=N``
at N samples per mini-batch, its rate scaled by the rule that optimizer calls for (`lr_scale`: linear, square
root for LAMB) and its warm-up by the same samples (`warmup_updates`). ``--optimizer lars --lr-schedule
warmup-poly --methods data-parallel,data-parallel+bs=4096`` is the large-batch recipe (Jia et al. 2018) next to
its baseline; for another optimizer, run the comparison again with it.

A fair comparison gives every method the same chances: with several learning rates
(``lrs``) every method trains at each of them and is reported at its best (by mean validation
accuracy over the seeds), and with several ``seeds`` the table shows mean and spread. Each run
gets its own TensorBoard run under one log directory (so TensorBoard overlays them; the by_samples/
charts line up methods at different batch sizes, pipetrain.apps.run_log), and the comparison ends with a
PNG of the curves against the training samples seen and the table the SpecTrain paper reports.

Speed: the local engine runs the stages one after another in one process, so the samples/s it
measures are the runtime's overhead, not pipeline speed. The table keeps them under that name; the
PNG's throughput panel and the table's last column show what each method would reach on a named
cluster of one device per stage, predicted from its run's measured per-stage costs
(pipetrain.apps.throughput).

Time to target: per method, the epochs its mean validation curve needs to reach the synchronous
baseline's best mean accuracy minus a point, the ratio to the baseline's epochs (per seed too) and
the time that takes at the predicted speed (pipetrain.apps.time_to_target): asynchrony pays only if
its speed-up outweighs the extra epochs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import textwrap
from pathlib import Path
from typing import Sequence

from pipetrain import NonFiniteError
from pipetrain.apps.extras import import_extra
from pipetrain.apps.models import MODELS
from pipetrain.apps.throughput import local_cluster, predicted_samples_per_second, stage_seconds
from pipetrain.apps.run_config import RunConfig, add_arguments, config_from_args
from pipetrain.apps.run_log import OVERLAY_HINT
from pipetrain.apps.run_summary import RunSummary, human_bytes
from pipetrain.apps.time_to_target import (BASELINES, MARGIN, Reach, ToTarget, seconds_to_target, spread_text,
                                          to_target)
from pipetrain.apps.training import is_rank_zero, run
from pipetrain.options import PREDICTING, STALENESS
from schedules import Cluster

ASYNC = tuple(s for s in STALENESS if s != "none")
METHODS = ["data-parallel", "1f1b", *ASYNC]


DC_LAMBDA, PIPEMARE_WARMUP = 2.0, 500  # "+dc" and "+pm" without a value: DC-ASGD-a's lambda_0 of its paper; T in updates
# Method suffixes: the delay corrections of pipetrain.runtime.staleness.corrections, and spectrain's variant.
SUFFIXES = {"sc": "spike compensation (Kosson et al.)", "dc[=L]": f"DC-ASGD-a with lambda_0 L (default {DC_LAMBDA:g})",
            "pm[=T]": f"PipeMare's per-stage rates over T updates (default {PIPEMARE_WARMUP})",
            "sm": "delay-matched momentum per stage", "ef": "error feedback on the update (Zmushko et al.)",
            "fo": "spectrain's forward-only variant",
            "bs=N": "mini-batches of N samples, the rate scaled by N / --batch-size (--optimizer lamb: its square "
                    "root) and --warmup by --batch-size / N",
            "m=N": "N micro-batches per mini-batch (instead of --async-micro-batches / --micro-batches)"}
# +bs=N and +m=N are the suffixes the synchronous methods take too (data-parallel: +bs only): their run at the
# async method's batch size is the control that separates what asynchrony costs from what the smaller batch
# changes. "nesterov+sm+m=1+bs=8" is async at one update per micro-batch of 8 samples.
SIZES = ("batch_size", "micro_batches")
SQRT_SCALED = ("lamb",)  # the optimizers whose rate scales with the square root of the batch (lr_scale)


def parse_method(method: str) -> tuple[str, float, dict]:
    """``"spectrain@2"`` -> ("spectrain", 2.0, {}); ``"stash+sc+dc=1"`` -> ("stash", 1.0, the wrap options of
    the corrections); ``"nesterov+bs=8"`` -> ("nesterov", 1.0, {"batch_size": 8}); a plain name has lookahead 1
    and no options."""
    head, *suffixes = method.split("+")
    name, _, lookahead = head.partition("@")
    if name not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)} "
                         f"(spectrain@x / nesterov@x: lookahead x; async methods take +{', +'.join(SUFFIXES)})")
    options: dict = {}
    for suffix in suffixes:
        key, _, value = suffix.partition("=")
        try:
            if key == "sc" and not value:
                options["spike_compensation"] = True
            elif key == "dc":
                options["dc_lambda"] = float(value) if value else DC_LAMBDA
            elif key == "pm":
                options["stage_lr_warmup"] = int(value) if value else PIPEMARE_WARMUP
            elif key == "sm" and not value:
                options["stage_momentum"] = True
            elif key == "ef" and not value:
                options["error_feedback"] = True
            elif key == "fo" and not value and name == "spectrain":
                options["spectrain_variant"] = "forward-only"
            elif key == "bs" and int(value) > 0:
                options["batch_size"] = int(value)
            elif key == "m" and int(value) > 0 and name != "data-parallel":
                options["micro_batches"] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"{method!r}: unknown suffix +{suffix}; async methods take "
                             + "; ".join(f"+{k}: {v}" for k, v in SUFFIXES.items())) from None
    if set(options) - set(SIZES) and name in ("data-parallel", "1f1b"):
        raise ValueError(f"{method!r}: the suffixes correct async-1f1b's delay; {name} has none")
    if not lookahead:
        return name, 1.0, options
    if name not in PREDICTING:
        raise ValueError(f"{method!r}: only {' and '.join(PREDICTING)} take a lookahead (@x)")
    try:
        return name, float(lookahead), options
    except ValueError:
        raise ValueError(f"{method!r}: the lookahead after @ must be a number, e.g. spectrain@2") from None


def method_config(base: RunConfig, method: str, world: int | None = None,
                  async_micro_batches: int | None = None) -> RunConfig:
    """``base`` changed to train with ``method``; ``world`` is the torchrun world size (None: local engine).

    The async methods split a mini-batch into ``async_micro_batches`` (default base.micro_batches). A method
    with ``+bs=N`` trains on mini-batches of N samples at ``lr_scale(base, config)`` times the rate and warms
    up over ``warmup_updates(base, config)`` (compare applies both); ``+m=N`` splits them into N micro-batches.
    """
    name, lookahead, corrections = parse_method(method)
    sizes = {key: corrections.pop(key) for key in SIZES if key in corrections}
    c = dataclasses.replace(base, label=method, staleness="none", schedule="1f1b", lookahead=1.0, **sizes)
    if name == "data-parallel":
        return dataclasses.replace(c, stages=1, micro_batches=1, data_parallel=world or 1)
    if name == "1f1b":
        return c
    m = sizes.get("micro_batches", base.micro_batches if async_micro_batches is None else async_micro_batches)
    return dataclasses.replace(c, schedule="async-1f1b", staleness=name, micro_batches=m, lookahead=lookahead,
                               **corrections)


def lr_scale(base: RunConfig, config: RunConfig) -> float:
    """The factor on a grid's rate for a method trained at another batch size than ``base``'s, by the rule the
    optimizer calls for, so that one grid means the same rate per sample for every method: square-root scaling
    for LAMB (You et al. 2019, which keeps the update's variance as the batch grows), the linear scaling rule
    (Goyal et al. 2017) for the others, SGD and LARS (You et al. 2017) among them."""
    ratio = config.resolved().batch_size / base.resolved().batch_size
    return math.sqrt(ratio) if config.optimizer in SQRT_SCALED else ratio


def warmup_updates(base: RunConfig, config: RunConfig) -> int:
    """``base.warmup`` for a method trained at another batch size: the updates that see the same samples (at
    least one), so that every batch size warms up over the same share of its epochs, as Goyal et al.'s 5 epochs."""
    if not base.warmup:
        return 0
    return max(1, round(base.warmup * base.resolved().batch_size / config.resolved().batch_size))


@dataclasses.dataclass
class MethodResult:
    """One method's runs over the learning-rate grid and the seeds, and its best learning rate."""

    runs: dict[tuple[float, int], RunSummary]

    def at(self, lr: float) -> list[RunSummary]:
        return [s for (rate, _), s in self.runs.items() if rate == lr]

    @property
    def lrs(self) -> list[float]:
        return sorted({lr for lr, _ in self.runs})

    @property
    def best_lr(self) -> float:
        """The rate with the highest mean validation accuracy over the seeds (then the lowest mean val loss)."""
        def score(lr: float) -> tuple[float, float]:
            runs = self.at(lr)
            acc = statistics.fmean(_finite(s.max_val_accuracy) for s in runs)
            return acc, -statistics.fmean(_finite(s.min_val_loss, math.inf) for s in runs)
        return max(self.lrs, key=score)

    @property
    def best(self) -> list[RunSummary]:
        return self.at(self.best_lr)

    @property
    def best_by_seed(self) -> dict[int, RunSummary]:
        """The runs at the best rate by seed (time_to_target pairs seeds across methods)."""
        return {seed: s for (lr, seed), s in self.runs.items() if lr == self.best_lr}


def _finite(value: float, instead: float = 0.0) -> float:
    """A diverged run (NaN) counts as the worst score, not as a hole in the mean."""
    return value if value == value else instead


def spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value; NaN when a value is NaN or infinite, as a
    seed that diverged before its first epoch leaves: statistics.stdev cannot take those)."""
    if not all(math.isfinite(v) for v in values):
        return statistics.fmean(values), math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_directory(root: Path, method: str, lr: float, seed: int, grid: bool) -> Path:
    return root / method / f"lr{lr:g}-seed{seed}" if grid else root / method


def compare(base: RunConfig, methods: Sequence[str], logdir: str | os.PathLike,
            async_micro_batches: int | None = None, lrs: Sequence[float] | None = None,
            seeds: Sequence[int] | None = None) -> dict[str, MethodResult]:
    """Train ``base`` with every method at every learning rate of ``lrs`` (default: base's) and every
    seed of ``seeds`` (default: base's). With one rate and one seed method m logs to ``logdir/m``,
    otherwise to ``logdir/m/lr<rate>-seed<seed>``."""
    root = Path(logdir)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    rates = list(lrs) if lrs else [base.resolved().lr]
    seed_list = list(seeds) if seeds else [base.seed]
    grid = len(rates) > 1 or len(seed_list) > 1
    configs = {m: method_config(base, m, world, async_micro_batches) for m in methods}
    for config in configs.values():  # every method's bad option (e.g. bf16 with async vanilla) before any training
        config.check()
    # Every rank checks, so under torchrun all stop together instead of rank 0 alone.
    taken = [m for m in methods if (root / m).is_dir() and any((root / m).iterdir())]
    if taken:
        raise ValueError(f"{root} already holds runs for {', '.join(taken)}; TensorBoard would mix old and new "
                         "curves: pass a new --logdir (or delete the old runs)")
    results = {}
    for m, c in configs.items():
        runs = {}
        for lr in rates:
            for seed in seed_list:
                label = f"{m} lr={lr:g} seed={seed}" if grid else m
                where = run_directory(root, m, lr, seed, grid)
                config = dataclasses.replace(c, lr=lr * lr_scale(base, c), warmup=warmup_updates(base, c),
                                             seed=seed, label=label, logdir=str(where))
                try:
                    runs[(lr, seed)] = run(config)
                except NonFiniteError as error:  # a rate too high for a method is a result, not the end of the grid
                    runs[(lr, seed)] = RunSummary(config.resolved(), diverged=str(error))
        results[m] = MethodResult(runs)
    return results


@dataclasses.dataclass(frozen=True)
class SpeedPrediction:
    """Every run's samples/s predicted on ``cluster`` (pipetrain.apps.throughput), by method and (lr, seed)."""

    cluster: Cluster
    runs: dict[str, dict[tuple[float, int], float]]

    def of_best(self, method: str, result: MethodResult) -> float:
        """Mean over the seeds of the method's best rate (NaN where none measured anything)."""
        values = [v for (lr, _), v in self.runs[method].items() if lr == result.best_lr and v == v]
        return statistics.fmean(values) if values else math.nan


def predict_speed(results: dict[str, MethodResult], cluster: Cluster | None = None) -> SpeedPrediction:
    """Each run's speed on one device per stage of the deepest pipeline compared (the data-parallel
    baseline: as many replicas), on ``cluster`` or, by default, throughput.local_cluster."""
    devices = max(s.config.stages for r in results.values() for s in r.runs.values())
    cluster = cluster or local_cluster(devices)
    return SpeedPrediction(cluster, {m: {key: predicted_samples_per_second(s, cluster, devices)
                                         for key, s in r.runs.items()} for m, r in results.items()})


def measured_speed_label() -> str:
    """What the measured samples/s are: the local engine's overhead, or a torchrun measurement."""
    world = os.environ.get("WORLD_SIZE")
    return f"samples/s, torchrun {world} processes" if world else "local-engine samples/s"


def format_table(results: dict[str, MethodResult], speed: SpeedPrediction | None = None,
                 margin: float = MARGIN, baseline: str | None = None) -> str:
    """The SpecTrain paper's table (min train loss, min val loss, max val accuracy) at each method's best
    learning rate, mean +- standard deviation over the seeds, plus measured throughput and traffic and,
    given ``speed``, the predicted throughput; with a learning-rate grid, each rate's mean accuracy too.
    Last, epochs to target (the sync baseline's best mean accuracy minus ``margin``), their ratio to the
    baseline's and, given ``speed``, the predicted time to target."""
    grid = any(len(r.lrs) > 1 for r in results.values())
    seeds = max(len(r.best) for r in results.values())
    pm = (lambda mean, sd, f: f"{f(mean)} ± {f(sd)}") if seeds > 1 else (lambda mean, sd, f: f(mean))
    head = ["method", "schedule", "min train loss", "min val loss", "max val acc", measured_speed_label(), "sent/step"]
    if grid:
        head[2:2] = ["best lr"]
        head.append("val acc by lr")
    if speed is not None:
        head.append("predicted samples/s")
    measured = bool(os.environ.get("WORLD_SIZE"))  # real ranks: their seconds are the pipeline's
    if measured:
        head.append("optimizer step (share)")
    batches = {m: r.best[0].config.batch_size for m, r in results.items()}
    # With +bs=N the methods' batches differ: the schedule column says each one's.
    schedule = {m: r.best[0].config.describe() + (f", batch {batches[m]}" if len(set(batches.values())) > 1 else "")
                for m, r in results.items()}
    rows = []
    for m, r in results.items():
        best = r.best
        predicted = [] if speed is None else [_rounded(speed.of_best(m, r))]
        predicted += [_optimizer_cell(best)] if measured else []
        if all(s.diverged for s in best):
            rows.append([m, schedule[m]] + (["-"] if grid else []) + ["diverged"] * 3 + ["-", "-"]
                        + (["every rate diverged"] if grid else []) + predicted)
            continue
        acc = spread([100 * _finite(s.max_val_accuracy) for s in best])
        row = [m, schedule[m],
               pm(*spread([s.min_train_loss for s in best]), lambda v: f"{v:.4f}"),
               pm(*spread([s.min_val_loss for s in best]), lambda v: f"{v:.4f}"),
               pm(*acc, lambda v: f"{v:.2f}%"),
               f"{statistics.fmean(s.samples_per_second for s in best):.0f}",
               human_bytes(statistics.fmean(s.bytes_per_step for s in best))]
        if grid:
            row[2:2] = [f"{r.best_lr:g}"]
            row.append(", ".join(f"{lr:g}: {statistics.fmean(100 * _finite(s.max_val_accuracy) for s in r.at(lr)):.1f}"
                                 for lr in r.lrs))
        rows.append(row + predicted)
    targets = to_target({m: r.best_by_seed for m, r in results.items()}, margin, baseline)
    if targets is not None:
        head += ["epochs to target", f"x {targets.baseline}'s epochs (seeds)"]
        head += [] if speed is None else ["predicted time to target"]
        head += ["measured time to target"] if measured else []
        for row, (m, r) in zip(rows, results.items()):
            row += _target_cells(targets.methods[m], None if speed is None else speed.of_best(m, r))
            row += [_seconds_or_never(targets.methods[m].measured_seconds, targets.methods[m].reach)] if measured \
                else []
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if grid and len(set(batches.values())) > 1:
        lines.append("\nbest lr and val acc by lr: the grid's rates; a method at another batch trained at the rate "
                     "times its batch over the grid's batch (linear scaling)")
    if seeds > 1:
        lines.append(f"\nmean ± sample standard deviation over {seeds} seeds, each method at its best learning rate")
    if not measured:
        lines.append("\nlocal-engine samples/s: one process runs the stages one after another, so they measure the "
                     "runtime's overhead, not pipeline speed")
    if speed is not None:
        lines.append(f"predicted samples/s: on {speed.cluster.name}, from each run's measured per-stage compute "
                     "and bytes (pipetrain.apps.throughput)")
    if targets is None:
        baseline = "every seed of the baseline diverged" if any(b in results for b in BASELINES) else \
            f"no synchronous baseline ({' or '.join(BASELINES)}) among the methods"
        lines.append(f"no epochs to target: {baseline}")
    else:
        b, goal = targets.baseline, targets.goal
        lines.append(f"target: {b}'s peak mean val accuracy {100 * (goal + margin):.2f}% - {100 * margin:g} = "
                     f"{100 * goal:.2f}% (the best epoch of the mean over seeds; max val acc is the mean of each "
                     "seed's best); epochs to target: the first epoch where the method's mean val accuracy over the "
                     f"seeds (at its best lr) reaches it; x {b}'s epochs: that over {b}'s, and its min–max over "
                     f"seeds (each seed's run against {b}'s of the same seed; >x: never reached, at least x)")
        if speed is not None:
            lines.append("predicted time to target: epochs to target x samples per epoch / predicted samples/s "
                         f"(a prediction for {speed.cluster.name}, not a measurement)")
        if measured:
            lines.append("measured time to target: rank 0's training seconds (steps, not validation) through the "
                         "epoch to target, the mean over the seeds")
    if measured:
        lines.append("optimizer step (share): rank 0's mean seconds per optimizer step, and the share of its "
                     "training seconds spent in them (pipetrain.apps.optimizer_clock)")
    return "\n".join(lines)


def _target_cells(t: ToTarget, predicted: float | None) -> list[str]:
    """A method's epochs to target, ratio (with its seeds' min–max) and, given its ``predicted`` samples/s,
    the predicted seconds to target."""
    cells = [str(t.reach), f"{t.ratio} ({spread_text(t.seeds.values())})" if len(t.seeds) > 1 else str(t.ratio)]
    if predicted is not None:
        cells.append(_seconds_or_never(seconds_to_target(t.reach, t.samples_per_epoch, predicted), t.reach))
    return cells


def _seconds_or_never(seconds: float, reach: Reach) -> str:
    """Seconds to target as text: "never" where it was not reached, "-" where nothing was measured."""
    return _seconds(seconds) if seconds == seconds else "never" if reach.epoch is None else "-"


def _optimizer_cell(runs: Sequence[RunSummary]) -> str:
    """Mean seconds per optimizer step over ``runs`` and the share of their training seconds it took."""
    stepped = [s for s in runs if s.optimizer_steps and s.train_seconds > 0]
    if not stepped:
        return "-"
    per_step = statistics.fmean(s.optimizer_seconds / s.optimizer_steps for s in stepped)
    share = statistics.fmean(s.optimizer_seconds / s.train_seconds for s in stepped)
    return f"{_seconds(per_step)} ({100 * share:.0f}%)"


def _seconds(value: float) -> str:
    """Three significant digits, whole seconds from 100 on: "0.107 s", "12.5 s", "1,234 s"."""
    return f"{value:,.0f} s" if value >= 100 else f"{value:.3g} s"


def _rounded(value: float) -> str:
    return f"{value:.0f}" if value == value else "-"


def speed_title(cluster: Cluster) -> str:
    """The throughput panel's title: what the bars are and where they are predicted for."""
    return f"samples/s predicted for {cluster.name}, from measured per-stage costs"


def compare_figure(summaries: dict[str, RunSummary], predicted: dict[str, float], cluster: Cluster):
    """Train loss per step, val loss and val accuracy per epoch, one line per method (one run each: with a
    grid, the caller passes each method's first seed at its best rate), against the training samples seen,
    and each method's ``predicted`` samples/s on ``cluster`` (horizontal bars, values printed). Returns the
    matplotlib Figure."""
    matplotlib = import_extra("matplotlib", "matplotlib", "the comparison plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    (loss_ax, val_ax), (acc_ax, speed_ax) = axes
    for m, s in summaries.items():
        # Samples, not updates, on x: a method at +bs=N takes more updates per epoch than the others, and
        # only at equal samples do the curves compare the same data (the x of TensorBoard's by_samples/ tags).
        batch = s.config.resolved().batch_size
        loss_ax.plot([batch * step for step in range(1, len(s.step_losses) + 1)], _smooth(s.step_losses), label=m)
        seen = [batch * e.step for e in s.epochs]
        val_ax.plot(seen, [e.val_loss for e in s.epochs], marker="o", label=m)
        acc_ax.plot(seen, [100 * e.val_accuracy for e in s.epochs], marker="o", label=m)
    for ax, title, ylabel in ((loss_ax, "train loss (smoothed)", "loss"),
                              (val_ax, "validation loss (after each epoch)", "loss"),
                              (acc_ax, "validation accuracy (after each epoch)", "%")):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("training samples seen")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.legend(fontsize="small")
    loss_ax.set_yscale("log")
    val_ax.set_yscale("log")
    _speed_panel(speed_ax, summaries, predicted, cluster)
    first = next(iter(summaries.values())).config
    stages = max(s.config.stages for s in summaries.values())  # the baseline runs one stage
    rates = {s.config.lr for s in summaries.values()}
    lr = f"lr {first.lr:g}" if len(rates) == 1 else "each method at its best lr"
    fig.suptitle(f"{first.model} on {first.dataset}: {stages} stages, {lr}, batch {first.batch_size}")
    fig.tight_layout()
    return fig


def _speed_panel(ax, summaries: dict[str, RunSummary], predicted: dict[str, float], cluster: Cluster) -> None:
    names = list(summaries)
    values = [predicted[m] for m in names]
    bars = ax.barh(range(len(names)), [v if v == v else 0.0 for v in values], color="tab:blue")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()  # the methods top-down in the legends' order
    ax.bar_label(bars, labels=[f"{v:,.0f}" if v == v else "not measured" for v in values], padding=3)
    top = max((v for v in values if v == v), default=1.0)
    ax.set_xlim(0, 1.25 * top)  # room for the printed values
    ax.set_title(textwrap.fill(speed_title(cluster), 52, break_on_hyphens=False))
    replicas = max(s.config.stages for s in summaries.values())
    ax.set_xlabel(f"samples/s (data-parallel: {replicas} replicas; pipelines: {replicas} stages)")


def plot(summaries: dict[str, RunSummary], predicted: dict[str, float], cluster: Cluster,
         path: str | os.PathLike, dpi: int = 100) -> Path:
    """Write compare_figure as a PNG at ``path``."""
    fig = compare_figure(summaries, predicted, cluster)
    import matplotlib.pyplot as plt  # compare_figure imported it (or said how to install it)

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _smooth(values: list[float], alpha: float = 0.2) -> list[float]:
    """Exponential moving average, so the per-step loss curves of several methods stay readable."""
    out, avg = [], math.nan
    for v in values:
        avg = v if math.isnan(avg) else (1 - alpha) * avg + alpha * v
        out.append(avg)
    return out


def add_arguments_compare(parser: argparse.ArgumentParser) -> None:
    """`pipetrain compare` options: the shared training ones plus methods and outputs."""
    add_arguments(parser, MODELS, pipeline=False)
    parser.set_defaults(logdir="runs/compare")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)}; spectrain@x / nesterov@x: lookahead x; "
                             f"an async method may add +{', +'.join(SUFFIXES)} (e.g. stash+sc+pm=200)")
    parser.add_argument("--lr-grid", help="comma-separated learning rates: every method trains at each and is "
                                          "reported at its best (default: --lr only)")
    parser.add_argument("--seeds", help="comma-separated seeds (or a count N for 0..N-1): mean and spread over them "
                                        "(default: --seed only)")
    parser.add_argument("--async-micro-batches", type=int,
                        help="micro-batches per mini-batch of the async runs (default: --micro-batches; "
                             "1 is the PipeDream/SpecTrain papers' setting)")
    parser.add_argument("--png", help="curves picture (default: <logdir>/compare.png)")
    parser.add_argument("--target-gap", type=float, default=100 * MARGIN, metavar="POINTS",
                        help="epochs to target aim at the sync baseline's best mean val accuracy minus this many "
                             "points (default: %(default)g)")
    parser.add_argument("--baseline", help="the synchronous method (one of --methods) the others' epochs to target "
                                           "are measured against, e.g. data-parallel+bs=8 (default: 1f1b, else "
                                           "data-parallel)")


def _numbers(text: str | None, kind: type, flag: str) -> list:
    if not text:
        return []
    try:
        return [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def grid_from_args(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """The learning rates and seeds of --lr-grid and --seeds (empty: the single --lr / --seed)."""
    lrs = _numbers(args.lr_grid, float, "--lr-grid")
    seeds = _numbers(args.seeds, int, "--seeds")
    if args.seeds and "," not in args.seeds and len(seeds) == 1:  # a count
        seeds = list(range(seeds[0]))
    return lrs, seeds


def config_from_compare_args(args: argparse.Namespace) -> tuple[RunConfig, list[str]]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ValueError(f"--methods is empty; choose from {', '.join(METHODS)}")
    for m in methods:
        parse_method(m)
    if args.baseline is not None and (args.baseline not in methods
                                      or parse_method(args.baseline)[0] not in ("data-parallel", "1f1b")):
        raise ValueError(f"--baseline {args.baseline} must be one of --methods and synchronous (data-parallel or "
                         "1f1b, with +bs=N if you like)")
    # Estimated layer costs: every method gets the same partition (timings are noisy). The logdir is
    # each run's own (see compare).
    return dataclasses.replace(config_from_args(args), profile=False), methods


def run_compare(args: argparse.Namespace) -> tuple[dict[str, MethodResult], Path | None]:
    """Train every method (over the grid), then (rank 0) print the table, write the PNG and a results.json."""
    base, methods = config_from_compare_args(args)
    lrs, seeds = grid_from_args(args)
    results = compare(base, methods, args.logdir, args.async_micro_batches, lrs, seeds)
    if not is_rank_zero():
        return results, None
    speed = predict_speed(results)
    firsts = {m: (r.best_lr, r.best[0].config.seed) for m, r in results.items()}
    png = plot({m: r.best[0] for m, r in results.items()}, {m: speed.runs[m][firsts[m]] for m in results},
               speed.cluster, args.png or Path(args.logdir) / "compare.png")
    measured_on = ("torchrun, one process per rank" if os.environ.get("WORLD_SIZE") else
                   "local engine: one process runs the stages one after another (its overhead, not pipeline speed)")
    record = {m: {"best_lr": r.best_lr,
                  "runs": [{"lr": lr, "seed": seed, "summary": s.line(), "diverged": s.diverged,
                            "min_train_loss": s.min_train_loss,
                            "min_val_loss": s.min_val_loss, "max_val_accuracy": s.max_val_accuracy,
                            "measured_samples_per_second": s.samples_per_second, "measured_on": measured_on,
                            "predicted_samples_per_second": speed.runs[m][(lr, seed)],
                            "predicted_for": speed.cluster.name,
                            "stage_seconds_per_step": stage_seconds(s),
                            "stage_activation_bytes": s.stage_activation_bytes,
                            "bytes_per_step": s.bytes_per_step,
                            "version_lag": s.version_lag, "weight_version_bytes": s.weight_version_bytes,
                            "prediction_distance": s.prediction_distance, "prediction_error": s.prediction_error,
                            "config": dataclasses.asdict(s.config), "epochs": [dataclasses.asdict(e) for e in s.epochs]}
                           for (lr, seed), s in r.runs.items()]}
              for m, r in results.items()}
    (Path(args.logdir) / "results.json").write_text(json.dumps(record, indent=1))
    for r in results.values():
        for s in r.runs.values():
            print(s.line())
    print()
    print(format_table(results, speed, args.target_gap / 100, args.baseline))
    print(f"\ncurves: {png}\nTensorBoard: tensorboard --logdir {args.logdir}\n  {OVERLAY_HINT}")
    return results, png


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of examples/compare_staleness.py (same options as `pipetrain compare`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments_compare(parser)
    args = parser.parse_args(argv)
    try:
        run_compare(args)
    except ValueError as exc:
        raise SystemExit(f"{parser.prog}: {exc}") from None
    return 0

"""`pipetrain compare`: the same model, data and seed trained by each staleness method.

Methods: "data-parallel" (the synchronous baseline: a one-stage pipeline is plain training;
under torchrun stages=1 and data_parallel=world), "1f1b" (synchronous pipeline with a flush),
and async-1f1b with "vanilla" (stale weights), "stash" (PipeDream weight stashing) and
"spectrain" (weight prediction). The pipelines all split each mini-batch into the same
micro-batches (so the same updates per epoch); `async_micro_batches=1` gives the papers'
setting, one micro-batch per mini-batch, where stage k's weights are stages - k - 1 updates
stale instead of a fraction of one. Each method gets its own TensorBoard run under one log
directory (so TensorBoard overlays them), and the comparison ends with a PNG of the curves and
the table the SpecTrain paper reports.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Sequence

from pipetrain.apps.models import MODELS
from pipetrain.apps.training import RunConfig, RunSummary, human_bytes, is_rank_zero, add_arguments, run

METHODS = ["data-parallel", "1f1b", "vanilla", "stash", "spectrain"]


def method_config(base: RunConfig, method: str, world: int | None = None,
                  async_micro_batches: int | None = None) -> RunConfig:
    """``base`` changed to train with ``method``; ``world`` is the torchrun world size (None: local engine).

    The async methods split a mini-batch into ``async_micro_batches`` (default base.micro_batches).
    """
    c = dataclasses.replace(base, label=method, staleness="none", schedule="1f1b")
    if method == "data-parallel":
        return dataclasses.replace(c, stages=1, micro_batches=1, data_parallel=world or 1)
    if method == "1f1b":
        return c
    if method in ("vanilla", "stash", "spectrain"):
        m = base.micro_batches if async_micro_batches is None else async_micro_batches
        return dataclasses.replace(c, schedule="async-1f1b", staleness=method, micro_batches=m)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def compare(base: RunConfig, methods: Sequence[str], logdir: str | os.PathLike,
            async_micro_batches: int | None = None) -> dict[str, RunSummary]:
    """Train ``base`` with every method; method m logs to ``logdir/m``. Returns the summaries by method."""
    root = Path(logdir)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    configs = {m: method_config(base, m, world, async_micro_batches) for m in methods}
    for config in configs.values():  # every method's bad option (e.g. bf16 with async vanilla) before any training
        config.check()
    # Every rank checks, so under torchrun all stop together instead of rank 0 alone.
    taken = [m for m in methods if (root / m).is_dir() and any((root / m).iterdir())]
    if taken:
        raise ValueError(f"{root} already holds runs for {', '.join(taken)}; TensorBoard would mix old and new "
                         "curves: pass a new --logdir (or delete the old runs)")
    return {m: run(dataclasses.replace(c, logdir=str(root / m))) for m, c in configs.items()}


def format_table(summaries: dict[str, RunSummary]) -> str:
    """The SpecTrain paper's table (min train loss, min val loss, max val accuracy) plus throughput and traffic."""
    head = ["method", "schedule", "min train loss", "min val loss", "max val acc", "samples/s", "sent/step"]
    rows = [[m, s.config.describe(), f"{s.min_train_loss:.4f}", f"{s.min_val_loss:.4f}",
             f"{100 * s.max_val_accuracy:.2f}%", f"{s.samples_per_second:.0f}", human_bytes(s.bytes_per_step)]
            for m, s in summaries.items()]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot(summaries: dict[str, RunSummary], path: str | os.PathLike) -> Path:
    """Train loss per step, val loss and val accuracy per epoch, and throughput, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (loss_ax, val_ax), (acc_ax, speed_ax) = axes
    for m, s in summaries.items():
        loss_ax.plot(range(1, len(s.step_losses) + 1), _smooth(s.step_losses), label=m)
        epochs = [e.epoch for e in s.epochs]
        val_ax.plot(epochs, [e.val_loss for e in s.epochs], marker="o", label=m)
        acc_ax.plot(epochs, [100 * e.val_accuracy for e in s.epochs], marker="o", label=m)
    speed_ax.bar(list(summaries), [s.samples_per_second for s in summaries.values()])
    first = next(iter(summaries.values())).config
    stages = max(s.config.stages for s in summaries.values())  # the baseline runs one stage
    for ax, title, ylabel in ((loss_ax, "train loss (smoothed)", "loss"), (val_ax, "validation loss", "loss"),
                              (acc_ax, "validation accuracy", "%"), (speed_ax, "throughput", "samples/s")):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if ax is not speed_ax:
            ax.legend()
    loss_ax.set_xlabel("step")
    val_ax.set_xlabel("epoch")
    acc_ax.set_xlabel("epoch")
    loss_ax.set_yscale("log")
    val_ax.set_yscale("log")
    fig.suptitle(f"{first.model} on {first.dataset}: {stages} stages, lr {first.lr:g}, batch {first.batch_size}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
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
                        help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--async-micro-batches", type=int,
                        help="micro-batches per mini-batch of the async runs (default: --micro-batches; "
                             "1 is the PipeDream/SpecTrain papers' setting)")
    parser.add_argument("--png", help="curves picture (default: <logdir>/compare.png)")


def config_from_compare_args(args: argparse.Namespace) -> tuple[RunConfig, list[str]]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"unknown method(s) {unknown} in --methods; choose from {', '.join(METHODS)}")
    base = RunConfig(model=args.model, dataset=args.dataset, data_dir=args.data_dir, download=args.download,
                     width=args.width,
                     depth=args.depth, stages=args.stages, micro_batches=args.micro_batches,
                     precision=args.precision, partitioner=args.partitioner, epochs=args.epochs,
                     batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, seed=args.seed,
                     train_samples=args.train_samples,
                     val_samples=args.val_samples, progress=args.progress,
                     # Estimated layer costs: every method gets the same partition (timings are noisy).
                     profile=False)
    return base, methods


def run_compare(args: argparse.Namespace) -> tuple[dict[str, RunSummary], Path | None]:
    """Train every method, then (rank 0) print the table, write the PNG and a results.json."""
    base, methods = config_from_compare_args(args)
    summaries = compare(base, methods, args.logdir, args.async_micro_batches)
    if not is_rank_zero():
        return summaries, None
    png = plot(summaries, args.png or Path(args.logdir) / "compare.png")
    results = {m: {"summary": s.line(), "min_train_loss": s.min_train_loss, "min_val_loss": s.min_val_loss,
                   "max_val_accuracy": s.max_val_accuracy, "samples_per_second": s.samples_per_second,
                   "bytes_per_step": s.bytes_per_step, "version_lag": s.version_lag,
                   "weight_version_bytes": s.weight_version_bytes, "config": dataclasses.asdict(s.config),
                   "epochs": [dataclasses.asdict(e) for e in s.epochs]} for m, s in summaries.items()}
    (Path(args.logdir) / "results.json").write_text(json.dumps(results, indent=1))
    for s in summaries.values():
        print(s.line())
    print()
    print(format_table(summaries))
    print(f"\ncurves: {png}\nTensorBoard: tensorboard --logdir {args.logdir}")
    return summaries, png


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

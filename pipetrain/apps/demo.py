"""`pipetrain demo` (what `make demo` runs): `pipetrain compare` on offline datasets.

VGG-11 and ResNet-20 (width 8) on digits and a residual LSTM on MNIST-1D, each split into 4
stages, are trained by data parallelism (the sync baseline), sync 1F1B and async 1F1B with vanilla, stash
(PipeDream), 2bw (PipeDream-2BW), spectrain and nesterov weights, with the same data, seed and
micro-batches (8 per mini-batch; 4 for ResNet, whose BatchNorm needs a few samples per micro-batch), and
by the recommended way to run async-1f1b at one micro-batch per update: nesterov with delay-matched momentum on
those micro-batches of 8 samples, each one update at the rate scaled by 8 / the batch (METHODS' last entry):
about 3 minutes on 2 CPU cores. It prints the paper-style tables, the PNGs (curves against the training
samples seen) and the TensorBoard command, with the tags to overlay (by_samples/: that last method takes 4-8x
the others' updates per epoch).
The PNGs' throughput is predicted for one core per stage from each run's measured per-stage costs
(pipetrain.apps.throughput): the local engine's own samples/s are its overhead, not pipeline speed.

What keeps it to a few minutes: the models' comparisons run side by side, one worker process per core
(``--jobs``; each trains with one thread, so two workers use the two cores one thread would leave
idle), and the two costliest models train fewer epochs than their families' DEFAULT_HPARAMS: ResNet 3
(not 4: every method but 2bw is past 90% validation accuracy after 3) and the LSTM 6 (not 10: its
curves are apart by then, nesterov highest, 2bw lowest, and the last 4 epochs were two fifths of the
demo's time). Learning rates and batch sizes stay the families' (a larger LSTM batch at a scaled rate
made 2bw diverge). ``pipetrain compare`` keeps the defaults.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

from pipetrain.apps.compare import METHODS as COMPARED, add_arguments_compare, run_compare
from pipetrain.apps.run_config import OPTIMIZERS
from pipetrain.apps.run_log import OVERLAY_HINT

# Every model's micro-batch is 8 samples (64 / 8; ResNet 32 / 4): at one update each, the lag of a stage in
# samples is that of async at 8 micro-batches per update (docs/async.md, one micro-batch per update).
METHODS = [*COMPARED, "nesterov+sm+m=1+bs=8"]

# Each family's DEFAULT_HPARAMS (lr, batch size, epochs) unless given here: vgg 0.05, 64, 3 epochs;
# resnet 0.02, 32, 3 epochs (default 4); lstm 0.1, 64, 6 epochs (default 10). Listed costliest first:
# the workers take them in this order.
DEMOS = {"lstm": ["--model=lstm", "--dataset=mnist1d", "--stages=4", "--micro-batches=8", "--epochs=6"],
         "resnet": ["--model=resnet", "--dataset=digits", "--stages=4", "--micro-batches=4", "--epochs=3"],
         "vgg": ["--model=vgg", "--dataset=digits", "--stages=4", "--micro-batches=8"]}
ORDER = ["vgg", "resnet", "lstm"]  # the order the reports are printed in


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logdir", help="default: runs/demo-<date>-<time> (a fresh directory each run)")
    parser.add_argument("--models", default=",".join(ORDER), help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="models compared at once, one process each (default: 2, or 1 on one core); "
                             "1 trains them in this process, with progress bars")
    parser.add_argument("--epochs", type=int, help="every model trains this many epochs (default: each model's, "
                        "above); with --train-samples, a quick look that still runs every model and method")
    parser.add_argument("--train-samples", type=int, help="train on the first N samples only (default: all)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="every model and method trains with it, at its default rate (pipetrain compare's "
                             "--optimizer; default: %(default)s)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def _compare(name: str, logdir: Path, progress: bool, capture: bool, sizes: list[str]) -> tuple[str, Path, float]:
    """One model's `pipetrain compare` (``sizes``: the demo's flags it passes on); returns what it printed
    (``capture``: held back, so that two workers' tables do not interleave), its PNG and its wall seconds."""
    # These models are tiny: one intra-op thread avoids thread-pool spinning, which costs more than
    # splitting such small kernels gains, the more so when other processes share the cores.
    torch.set_num_threads(1)
    start = time.perf_counter()
    parser = argparse.ArgumentParser()
    add_arguments_compare(parser)
    argv = [*DEMOS[name], f"--methods={','.join(METHODS)}", *sizes, f"--logdir={logdir / name}"]
    argv += [] if progress else ["--no-progress"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if capture else contextlib.nullcontext():
        _, png = run_compare(parser.parse_args(argv))
    return out.getvalue(), png, time.perf_counter() - start


def _header(name: str) -> str:
    return f"\n== pipetrain compare {' '.join(DEMOS[name])} (methods: {', '.join(METHODS)})"


def run_demo(args: argparse.Namespace) -> int:
    """Run the comparisons and say where their outputs are."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DEMOS]
    if unknown or not models:
        raise ValueError(f"unknown demo model(s) {unknown}; choose from {', '.join(ORDER)}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    logdir = Path(args.logdir or time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    sizes = [f"--{flag}={value}" for flag, value in (("epochs", args.epochs), ("train-samples", args.train_samples))
             if value is not None]  # after DEMOS' own: argparse keeps the last
    sizes.append(f"--optimizer={args.optimizer}")
    start = time.perf_counter()
    pngs = {}
    if args.jobs == 1 or len(models) == 1:
        for name in sorted(models, key=ORDER.index):
            print(_header(name), flush=True)
            _, pngs[name], _ = _compare(name, logdir, args.progress, capture=False, sizes=sizes)
    else:
        print(f"comparing {', '.join(models)} in {min(args.jobs, len(models))} processes "
              f"(methods: {', '.join(METHODS)}); each model's table follows when it is done", flush=True)
        # spawn, not fork: a forked child of a process that has started torch's threads may deadlock.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(args.jobs, len(models)), mp_context=context) as pool:
            futures = {pool.submit(_compare, name, logdir, False, True, sizes): name
                       for name in sorted(models, key=list(DEMOS).index)}
            for future in as_completed(futures):
                name = futures[future]
                printed, pngs[name], seconds = future.result()
                print(_header(name) + f" ({seconds:.0f} s)\n" + printed, end="", flush=True)
    print(f"\ndemo wall time: {time.perf_counter() - start:.0f} s")
    print("curves: " + ", ".join(str(pngs[m]) for m in ORDER if m in pngs))
    print(f"TensorBoard (all runs overlaid): tensorboard --logdir {logdir}\n  {OVERLAY_HINT};\n  "
          f"{METHODS[-1]} takes 4-8x the others' updates per epoch (8 samples each)")
    return 0

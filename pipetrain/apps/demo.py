"""`pipetrain demo` (what `make demo` runs): `pipetrain compare` on offline datasets.

VGG-11 and ResNet-20 (width 8) on digits and a residual LSTM on MNIST-1D, each split into 4
stages, are trained by data parallelism (the sync baseline), sync 1F1B and async 1F1B with vanilla, stash
(PipeDream), 2bw (PipeDream-2BW), spectrain and nesterov weights, with the same data, seed and
micro-batches (8 per mini-batch; 4 for ResNet, whose BatchNorm needs a few samples per micro-batch):
a few minutes on 2 CPU cores. It prints the paper-style tables, the PNGs and the TensorBoard command.
The PNGs' throughput is predicted for one core per stage from each run's measured per-stage costs
(pipetrain.apps.throughput): the local engine's own samples/s are its overhead, not pipeline speed.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pipetrain.apps.compare import METHODS, add_arguments_compare, run_compare

# Each family's DEFAULT_HPARAMS (lr, batch size, epochs): vgg 3 epochs, resnet 4, lstm 10.
DEMOS = {"vgg": ["--model=vgg", "--dataset=digits", "--stages=4", "--micro-batches=8"],
         "resnet": ["--model=resnet", "--dataset=digits", "--stages=4", "--micro-batches=4"],
         "lstm": ["--model=lstm", "--dataset=mnist1d", "--stages=4", "--micro-batches=8"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logdir", help="default: runs/demo-<date>-<time> (a fresh directory each run)")
    parser.add_argument("--models", default=",".join(DEMOS), help=f"comma-separated subset of {','.join(DEMOS)}")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def run_demo(args: argparse.Namespace) -> int:
    """Run the comparisons and say where their outputs are."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in DEMOS]
    if unknown or not models:
        raise ValueError(f"unknown demo model(s) {unknown}; choose from {', '.join(DEMOS)}")
    # These models are tiny: one intra-op thread avoids thread-pool spinning, which costs more than
    # splitting such small kernels gains, the more so when other processes share the cores.
    torch.set_num_threads(1)
    logdir = Path(args.logdir or time.strftime("runs/demo-%Y%m%d-%H%M%S"))
    start = time.perf_counter()
    pngs = []
    for name in models:
        print(f"\n== pipetrain compare {' '.join(DEMOS[name])} (methods: {', '.join(METHODS)})", flush=True)
        parser = argparse.ArgumentParser()
        add_arguments_compare(parser)
        argv = [*DEMOS[name], f"--logdir={logdir / name}"] + ([] if args.progress else ["--no-progress"])
        _, png = run_compare(parser.parse_args(argv))
        pngs.append(png)
    print(f"\ndemo wall time: {time.perf_counter() - start:.0f} s")
    print("curves: " + ", ".join(map(str, pngs)))
    print(f"TensorBoard (all runs overlaid): tensorboard --logdir {logdir}")
    return 0

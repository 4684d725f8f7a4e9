"""bf16 vs fp32 on CPU: a CNN stage's forward+backward, and a 2-stage pipeline step.

    .venv/bin/python examples/benchmarks/bench_precision.py [--rounds 7] [--width 32]

1. Stage: the first half of the feature layers of pipetrain.apps.models' VGG-11 at width
   `width` (first conv channels), 32x32 RGB input, batch 32; forward+backward under
   torch.autocast("cpu", dtype=torch.bfloat16) vs plain fp32.
2. Pipeline: the whole VGG-11 trained by wrap(stages=2, micro_batches=4, engine="local")
   with precision="bf16" vs "fp32", batch 64 from the digits dataset: step time and the
   bytes sent per step (activations + activation gradients, from StepResult.comm_bytes;
   boundary tensors travel in the dtype autocast gives them, bf16 for a convolution's output).
   Both split before features.12, where the graph partitioner cuts the fp32 model: profiled
   under bf16 it may cut elsewhere, and only the precision should differ here.
Variants take turns in every round (interleaved) and the numbers are medians over rounds,
so background load on the machine drifts over both alike. One thread.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

import pipetrain
from pipetrain.apps.datasets import load_dataset
from pipetrain.apps.models import build_model

PRECISIONS = ("fp32", "bf16")


def vgg(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("vgg", num_classes=10, width=width, depth=11)


def cnn_stage(width: int) -> torch.nn.Module:
    """The first half of VGG-11's feature layers (its convolutions, BN, ReLU and pools)."""
    layers = list(vgg(width).features)
    return torch.nn.Sequential(*layers[: len(layers) // 2])


def autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def stage_step(stage: torch.nn.Module, x: torch.Tensor, precision: str) -> float:
    """Seconds of one forward+backward of the stage (gradient of sum(output))."""
    t0 = time.perf_counter()
    with autocast(precision):
        out = stage(x)
    out.float().sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}, 1 thread")

    stage = cnn_stage(args.width)
    x = torch.randn(32, 3, 32, 32)
    data = load_dataset("digits", split="train")
    xb = torch.stack([data[i][0] for i in range(64)])
    yb = torch.stack([torch.as_tensor(data[i][1]) for i in range(64)])
    pipes = {p: pipetrain.wrap(vgg(args.width), xb[:16], stages=2, micro_batches=4, schedule="1f1b",
                               precision=p, partitioner=["features.12"], engine="local") for p in PRECISIONS}
    for p in PRECISIONS:  # warm-up (oneDNN kernel selection, allocator)
        stage_step(stage, x, p)
        pipes[p].step(xb, yb)
    stage_times = {p: [] for p in PRECISIONS}
    pipe_times = {p: [] for p in PRECISIONS}
    sent = {}
    for _ in range(args.rounds):
        for p in PRECISIONS:
            stage.zero_grad(set_to_none=True)
            stage_times[p].append(statistics.median(stage_step(stage, x, p) for _ in range(3)))
            t0 = time.perf_counter()
            pipes[p].step(xb, yb)
            pipe_times[p].append(time.perf_counter() - t0)
            r = pipes[p].last_result
            sent[p] = sum(sum(r.comm_bytes[k]) for k in ("activations", "activation_grads"))

    params = sum(p.numel() for p in stage.parameters())
    print(f"\n1. CNN stage: first {len(stage)} layers of VGG-11 width {args.width} ({params:,} parameters), "
          f"batch 32 x 3 x 32 x 32, forward+backward ({args.rounds} rounds x 3, median)")
    f32 = statistics.median(stage_times["fp32"])
    for p in PRECISIONS:
        t = statistics.median(stage_times[p])
        print(f"   {p:<5} {t * 1e3:8.2f} ms   {f32 / t:5.2f}x vs fp32")
    print(f"\n2. pipeline: VGG-11 width {args.width}, 2 stages x 4 micro-batches, 1f1b, local engine, "
          f"batch 64 (digits) ({args.rounds} steps, median)")
    f32 = statistics.median(pipe_times["fp32"])
    for p in PRECISIONS:
        t = statistics.median(pipe_times[p])
        print(f"   {p:<5} {t * 1e3:8.2f} ms per step   {f32 / t:5.2f}x vs fp32   "
              f"{sent[p]:>10,} bytes sent per step (activations + their gradients)")
    print(f"   bytes ratio fp32 / bf16: {sent['fp32'] / sent['bf16']:.2f}")


if __name__ == "__main__":
    main()

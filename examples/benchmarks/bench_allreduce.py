"""Gradient reduction on 4 gloo ranks: fused buckets vs per-tensor vs torch DDP, overlap vs not.

    .venv/bin/python examples/benchmarks/bench_allreduce.py [--blocks 50] [--bucket-kib 256]

Model: `blocks` x (Linear(64, 64) + LayerNorm(64)) = 4 * blocks small tensors.
Every variant runs the same forward/backward on the same data; "reduction" is
the step time minus the step time without any communication (so overlapped
variants show only the part of communication they could not hide). Numbers
are medians over steps of rank 0, after a barrier before every step. Buckets
default to 256 KiB (first 64 KiB) for us and DDP alike so the ~0.8 MiB model
has several buckets and overlap has something to hide; DDP's own default
(25 MiB) would make one bucket that can only start after the backward.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipetrain.allreduce.reducer import GradientReducer
from pipetrain.comm.local_ranks import start_local_ranks

WORLD = 4
LOCAL = "local fwd+bwd (no communication)"
FUSED = "fused flat buckets"
PER_TENSOR = "per-tensor all-reduce"
DDP = "torch DDP reducer (overlapped)"


def make_model(blocks: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(64, 64), torch.nn.LayerNorm(64)]
    return torch.nn.Sequential(*layers)


def measure(variants: dict[str, Callable[[], object]], rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each variant, all ranks starting every step together.

    Variants take turns (`rounds` x `steps` steps each) so load from other
    processes on the machine drifts over all of them alike.
    """
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, step in variants.items():  # warm-up
        for _ in range(2):
            step()
    for _ in range(rounds):
        for name, step in variants.items():
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def worker(rank: int, port: int, blocks: int, rounds: int, steps: int, bucket_kib: int, first_kib: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 4 processes share the cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = make_model(blocks)
    ddp = DistributedDataParallel(make_model(blocks), bucket_cap_mb=bucket_kib / 1024)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))
    sizes = dict(bucket_bytes=bucket_kib * 1024, first_bucket_bytes=first_kib * 1024)

    def backward(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        m(x).square().mean().backward()

    fused = GradientReducer(model.parameters(), None, algorithm="flat", **sizes)
    hierarchical = GradientReducer(model.parameters(), None, algorithm="hierarchical", hierarchy=(2, 2), **sizes)
    per_tensor = GradientReducer(model.parameters(), None, algorithm="per-tensor")
    overlapped = GradientReducer(model.parameters(), None, algorithm="flat", **sizes)
    overlapped.enable_overlap()

    def step_with(reducer: GradientReducer | None) -> Callable[[], None]:
        def step() -> None:
            if reducer is overlapped:
                overlapped.prepare(final=True)
                backward(model)
                overlapped.finish()
                return
            overlapped.prepare(final=False)  # the hooks of `overlapped` stay idle
            backward(model)
            if reducer is not None:
                reducer.reduce_now()
        return step

    steps_ms = measure({
        LOCAL: step_with(None),
        FUSED + ", after backward": step_with(fused),
        FUSED + ", overlapped": step_with(overlapped),
        "hierarchical 2x2 (emulated on one host), after backward": step_with(hierarchical),
        PER_TENSOR + ", after backward": step_with(per_tensor),
        DDP: lambda: backward(ddp),
    }, rounds, steps)
    step_with(None)()
    alone = measure({FUSED: fused.reduce_now, "hierarchical 2x2": hierarchical.reduce_now,
                     PER_TENSOR: per_tensor.reduce_now}, rounds, steps)
    if rank == 0:
        n_tensors = sum(1 for _ in model.parameters())
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"world {WORLD} (gloo, 127.0.0.1), {n_tensors} parameter tensors, {n_bytes / 2**20:.2f} MiB of fp32 "
              f"gradients in {len(fused.buckets)} buckets ({first_kib} KiB first, {bucket_kib} KiB others; "
              f"DDP bucket_cap_mb={bucket_kib / 1024:g})")
        report(steps_ms, alone)
    dist.destroy_process_group()


def report(steps: dict[str, float], alone: dict[str, float]) -> None:
    local = steps[LOCAL]
    red = {k: t - local for k, t in steps.items()}
    print(f"\n{'variant':58s} {'step ms':>8s} {'reduction ms':>13s}")
    for name, t in steps.items():
        print(f"{name:58s} {t * 1e3:8.2f} {red[name] * 1e3:13.2f}")
    print(f"\n{'reduce_now() alone (gradients already there)':58s} {'ms':>8s}")
    for name, t in alone.items():
        print(f"{name:58s} {t * 1e3:8.2f}")
    after, over = FUSED + ", after backward", FUSED + ", overlapped"
    print("\nratios (measured above, same run)")
    print(f"  per-tensor / fused, reduce_now alone:             {alone[PER_TENSOR] / alone[FUSED]:7.1f}x")
    print(f"  per-tensor / fused, reduction share of the step:  {red[PER_TENSOR + ', after backward'] / red[after]:7.1f}x")
    print(f"  step time, fused after backward / overlapped:     {steps[after] / steps[over]:7.2f}x")
    print(f"  step time, DDP / fused overlapped:                {steps[DDP] / steps[over]:7.2f}x")
    print(f"  reduction share, DDP / fused overlapped:          {red[DDP] / red[over]:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    parser.add_argument("--bucket-kib", type=int, default=256)
    parser.add_argument("--first-bucket-kib", type=int, default=64)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_local_ranks(worker, (port, args.blocks, args.rounds, args.steps, args.bucket_kib, args.first_bucket_kib), WORLD)


if __name__ == "__main__":
    main()

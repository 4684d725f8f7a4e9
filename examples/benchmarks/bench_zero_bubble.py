"""Zero-bubble schedules on 2 gloo ranks: bubble, held activations against the memory model, compile.

    .venv/bin/python examples/benchmarks/bench_zero_bubble.py [--steps 24] [--rounds 3] [--compile]

Model: a chain of ``--layers`` blocks Linear(width, width) + GELU between an input and an output
Linear, batch 64 in 8 micro-batches, SGD with momentum, one thread per rank. A Linear's forward, its
input gradient and its weight gradient are one matmul each, so F = B = W per block: the costs the
simulated bubbles assume. 1f1b and zb-h1 run one stage per rank; interleaved-zb two chunks per rank
(loop placement), zbv and dualpipev two chunks per rank in V placement (rank 0 holds the first and the
last quarter of the model).

Per schedule, printed:
  simulated  the bubble of the same schedule at F = B = W = 1 and free communication (schedules.simulate);
  measured   1 - (seconds both ranks spent in stage computations) / (2 x step seconds), from
             StepResult.busy_fraction: everything that is not a forward, B or W is idle here, so
             messages, the optimizer step and the runtime's own bookkeeping count as bubble;
  step       median step seconds, and the median of the per-round ratios to 1f1b (rounds take turns,
             so the load of other processes drifts over all schedules alike);
  memory     per virtual stage, the activation bytes held at the peak (StepResult.activation_bytes) and
             the measured peak of the stage's tensors (StepResult.peak_memory) against the memory
             model's prediction (pipe.plan.stage_memory).
With ``--compile``, every split schedule also runs with ``compile=True`` (the graph-level B/W split),
and its step time is given as a ratio to the same schedule eager.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import pipetrain
from pipetrain.comm.local_ranks import start_local_ranks
import schedules

WORLD = 2
SCHEDULES = ("1f1b", "zb-h1", "interleaved-zb", "zbv", "dualpipev")
SPLIT = ("zb-h1", "interleaved-zb", "zbv", "dualpipev")
OPTIONS = {"interleaved-zb": {"chunks": 2}}


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Linear(32, width), nn.GELU()]
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def simulated_bubble(kind: str, micro_batches: int) -> float:
    built = schedules.build(kind, WORLD, micro_batches, **OPTIONS.get(kind, {}))
    return schedules.simulate(built, schedules.Costs(forward=1, backward=1, weight=1)).bubble_fraction


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(args.batch_size, 32, generator=gen), torch.randint(0, 10, (args.batch_size,), generator=gen))
               for _ in range(4)]
    example = batches[0][0][: args.batch_size // args.micro_batches]
    variants = [(kind, False) for kind in SCHEDULES] + [(kind, True) for kind in SPLIT if args.compile]
    pipes = {}
    for kind, compiled in variants:
        pipes[(kind, compiled)] = pipetrain.wrap(
            make_model(args.layers, args.width), example, stages=WORLD, micro_batches=args.micro_batches,
            schedule=kind, loss_fn=F.cross_entropy, profile=False, engine="distributed", compile=compiled,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9), **OPTIONS.get(kind, {}))
    for pipe in pipes.values():  # warm-up: allocator, gloo connections, compilation
        for x, y in batches[: args.warmup]:
            pipe.step(x, y)
    seconds = {v: [] for v in variants}
    bubbles = {v: [] for v in variants}
    per_round = max(1, args.steps // args.rounds)
    for r in range(args.rounds):
        for v in variants:
            dist.barrier()
            for i in range(per_round):
                x, y = batches[(r + i) % len(batches)]
                t0 = time.perf_counter()
                pipes[v].step(x, y)
                seconds[v].append(time.perf_counter() - t0)
                bubbles[v].append(1 - sum(pipes[v].last_result.busy_fraction) / WORLD)
    if rank == 0:
        report(pipes, seconds, bubbles, per_round, args)
    dist.destroy_process_group()


def median_ratio(a: list[float], b: list[float], per_round: int) -> float:
    """Median over rounds of (a's median step in the round) / (b's)."""
    rounds = range(0, len(a), per_round)
    return statistics.median(statistics.median(a[i:i + per_round]) / statistics.median(b[i:i + per_round])
                             for i in rounds)


def report(pipes: dict, seconds: dict, bubbles: dict, per_round: int, args: argparse.Namespace) -> None:
    print(f"{args.layers} blocks of Linear({args.width}) + GELU, batch {args.batch_size} in {args.micro_batches} "
          f"micro-batches, 2 gloo ranks, 1 thread each; {args.rounds} rounds x {per_round} steps per schedule")
    base = seconds[("1f1b", False)]
    print(f"{'schedule':<22} {'simulated':>9} {'measured':>9} {'step ms':>8} {'vs 1f1b':>8}")
    for (kind, compiled), times in seconds.items():
        label = kind + (" compiled" if compiled else "")
        print(f"{label:<22} {100 * simulated_bubble(kind, args.micro_batches):>8.1f}% "
              f"{100 * statistics.median(bubbles[(kind, compiled)]):>8.1f}% {1e3 * statistics.median(times):>8.2f} "
              f"{median_ratio(times, base, per_round):>8.3f}")
    if args.compile:
        print("compiled / eager step time, same schedule: " + ", ".join(
            f"{kind} {median_ratio(seconds[(kind, True)], seconds[(kind, False)], per_round):.3f}" for kind in SPLIT))
    print("\nper virtual stage: held activations at the peak, measured peak of the stage's tensors, predicted peak "
          "(kB; prediction error)")
    for (kind, compiled), pipe in pipes.items():
        if compiled:
            continue
        result, predicted = pipe.last_result, pipe.plan.stage_memory
        cells = [f"{result.activation_bytes[v] / 1e3:.0f}/{result.peak_memory[v] / 1e3:.0f}/{predicted[v] / 1e3:.0f}"
                 f" ({100 * (predicted[v] / result.peak_memory[v] - 1):+.1f}%)" for v in range(len(predicted))]
        print(f"{kind:<16} " + "  ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed mini-batches per schedule (over all rounds)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="untimed mini-batches per schedule first")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="also time each split schedule with compile=True")
    args = parser.parse_args()
    if args.batch_size % args.micro_batches:
        parser.error("--batch-size must be a multiple of --micro-batches")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_local_ranks(worker, (port, args), WORLD)


if __name__ == "__main__":
    main()

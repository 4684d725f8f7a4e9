"""Runtime throughput on 2 gloo ranks (CPU, 1 thread each): pipetrain vs torch.distributed.pipelining.

    .venv/bin/python examples/benchmarks/bench_runtime.py [--steps 40] [--micro-batches 8] [--batch-size 64]
    .venv/bin/python examples/benchmarks/bench_runtime.py --tiny [--steps 200]

``--tiny``: the per-action overhead of the two runtimes side by side. A tiny model (4 x Linear(16)
with ReLU, then Linear(16, 10); 16 micro-batches of 4 samples, split in the middle) computes almost
nothing, so each rank's CPU time per step divided by its 32 forward and backward actions is what
the runtime itself costs per action: dispatch, bookkeeping and the point-to-point posting.

Model: VGG-11 with BatchNorm, first conv width 16 (0.58 M parameters) on 32x32 inputs,
split before `--split` for every pipelined variant (default features.15, which balances
the CPU time of the halves): pipetrain plans with partitioner=[split], and torch's
PipelineStage wraps the very stage modules that plan builds, so both frameworks run the
same code on the same two halves with the same micro-batches. Variants, all in one run:

  pipetrain 1f1b            pipe.step(x, y) per mini-batch (flushes every step)
  ... receives at use       the same with receive_ahead=False: each receive posted right before
                            its computation instead of one computation early
  pipetrain zb-h1           the same with the zero-bubble schedule (backward split into B and W)
  torch Schedule1F1B        schedule.step(...) then optimizer.step() per mini-batch
  pipetrain async-1f1b      pipe.train(stream) with staleness "stash" and "spectrain"; one
                            stream per round, so its fill and drain count once per round
  single process            the unsplit model on rank 0 (rank 1 idles), whole mini-batch
                            and accumulated over the same micro-batches

Variants take turns (`--rounds` rounds of steps/rounds steps each) so load from other
processes drifts over all of them alike; each round starts and ends at a barrier and
rank 0 times it. The CPU column is each rank's process time per step (all its threads,
gloo's included): what a variant costs whatever else the machine runs. Before timing, the first step of both frameworks starts from the same
weights on the same mini-batch and must report the same loss.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import pipetrain
from pipetrain.apps.models.vgg import VGG

WORLD = 2
PT_1F1B = "pipetrain 1f1b"
PT_AT_USE = "pipetrain 1f1b, receives at use (receive_ahead=False)"
PT_ZB = "pipetrain zb-h1"
TORCH_1F1B = "torch Schedule1F1B"
PT_STASH = "pipetrain async-1f1b stash"
PT_SPEC = "pipetrain async-1f1b spectrain"
SINGLE = "single process, whole mini-batch"
SINGLE_MB = "single process, micro-batches accumulated"


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return VGG(11, width=width)


def make_batches(count: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch_size, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
            for _ in range(count)]


def stage_copy(pipe: pipetrain.Pipeline) -> torch.nn.Module:
    """A copy of the stage module this rank runs in ``pipe`` (its weights as they are now)."""
    (stage,) = pipe.held_stages.values()
    return copy.deepcopy(stage.module)


def torch_pipeline(stage_module: torch.nn.Module, rank: int, micro_batches: int):
    """torch.distributed.pipelining's 1F1B over `stage_module` (this rank's half), on its own group."""
    group = dist.new_group(list(range(WORLD)))
    stage = PipelineStage(stage_module, rank, WORLD, torch.device("cpu"), group=group)
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=F.cross_entropy)
    optimizer = sgd(stage_module.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None
    return step


def single_process(model: torch.nn.Module, rank: int, micro_batches: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Plain training of the unsplit model on rank 0 (gradients accumulated over `micro_batches`
    pieces of the mini-batch); the other rank only waits at the round's barrier."""
    optimizer = sgd(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank != 0:
            return
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            (F.cross_entropy(model(xs), ys) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def check_same_loss(pt_step: Callable, torch_step: Callable, batch, rank: int) -> tuple[float, float]:
    """First step of both frameworks from identical weights on one mini-batch: the losses must agree."""
    ours = pt_step(*batch)
    theirs = torch_step(*batch)
    box = torch.tensor([theirs if theirs is not None else 0.0], dtype=torch.float64)
    dist.broadcast(box, src=WORLD - 1)
    theirs = float(box)
    if abs(ours - theirs) > 1e-5 * max(1.0, abs(ours)):
        raise RuntimeError(f"first-step losses differ: pipetrain {ours:.7f} vs torch {theirs:.7f}; "
                           "the two pipelines do not compute the same model")
    return ours, theirs


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    m, b = args.micro_batches, args.batch_size
    batches = make_batches(4, b)
    model = make_model(args.width)
    example = batches[0][0][: b // m]

    def wrap(schedule: str, staleness: str = "none", **extra):
        return pipetrain.wrap(model, example, stages=WORLD, micro_batches=m, schedule=schedule, staleness=staleness,
                              partitioner=[args.split], loss_fn=F.cross_entropy, optimizer=sgd, profile=False,
                              engine="distributed", **extra)

    pt_sync = wrap("1f1b")
    # The same half pipetrain runs, copied before any step: identical initial weights.
    torch_step = torch_pipeline(stage_copy(pt_sync), rank, m)
    first = check_same_loss(pt_sync.step, torch_step, batches[0], rank)
    stash, spec = wrap("async-1f1b", "stash"), wrap("async-1f1b", "spectrain")
    zero_bubble = wrap("zb-h1")
    at_use = wrap("1f1b", receive_ahead=False)

    def stream(pipe) -> Callable[[list], None]:
        def run(bs: list) -> None:
            for _ in pipe.train(bs):
                pass
        return run

    def each(step) -> Callable[[list], None]:
        def run(bs: list) -> None:
            for x, y in bs:
                step(x, y)
        return run

    variants = {PT_1F1B: each(pt_sync.step), PT_AT_USE: each(at_use.step),
                TORCH_1F1B: each(torch_step), PT_ZB: each(zero_bubble.step),
                PT_STASH: stream(stash),
                PT_SPEC: stream(spec), SINGLE: each(single_process(copy.deepcopy(model), rank, 1)),
                SINGLE_MB: each(single_process(copy.deepcopy(model), rank, m))}
    per_round = max(1, args.steps // args.rounds)
    for run in variants.values():  # warm-up: allocator, gloo connections, torch's shape inference
        run([batches[i % len(batches)] for i in range(args.warmup)])
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    cpu = torch.zeros(len(variants), WORLD, dtype=torch.float64)  # CPU seconds of each rank's process
    for r in range(args.rounds):
        for v, (name, run) in enumerate(variants.items()):
            work = [batches[(r + i) % len(batches)] for i in range(per_round)]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run(work)
            cpu[v, rank] += time.process_time() - c0
            dist.barrier()
            seconds[name].append(time.perf_counter() - t0)
    dist.all_reduce(cpu)
    if rank == 0:
        print(f"VGG-11 width {args.width} on 32x32, batch {b} in {m} micro-batches, split before {args.split!r}; "
              f"gloo on 127.0.0.1, 1 thread per process; {args.rounds} rounds x {per_round} steps per variant")
        print(f"first-step loss: pipetrain {first[0]:.6f}, torch {first[1]:.6f} (same weights, same batch)")
        report(seconds, cpu / (args.rounds * per_round), per_round, b)
    dist.destroy_process_group()


def report(seconds: dict[str, list[float]], cpu_per_step: torch.Tensor, steps_per_round: int, batch_size: int) -> None:
    """Throughput from the median round (robust to bursts of load from other processes) and each
    rank's CPU time per step (what the variant costs, whatever else runs on the machine)."""
    rate = {k: steps_per_round * batch_size / statistics.median(v) for k, v in seconds.items()}
    print(f"\n{'variant':44s} {'samples/s':>10s} {'ms/step':>8s} {'CPU ms/step rank 0, 1':>22s}")
    for v, (name, s) in enumerate(seconds.items()):
        print(f"{name:44s} {rate[name]:10.1f} {statistics.median(s) / steps_per_round * 1e3:8.1f} "
              f"{cpu_per_step[v, 0] * 1e3:13.1f}, {cpu_per_step[v, 1] * 1e3:6.1f}")

    def ratio(a: str, b: str) -> str:
        rounds = [x / y for x, y in zip(seconds[b], seconds[a])]  # throughput ratio a/b per round
        return f"{statistics.median(rounds):6.2f}x  (rounds range {min(rounds):.2f}-{max(rounds):.2f})"

    print("\nthroughput ratios (median over rounds of the ratio within a round)")
    print(f"  pipetrain 1f1b / torch Schedule1F1B:             {ratio(PT_1F1B, TORCH_1F1B)}")
    print(f"  pipetrain 1f1b, receives ahead / at use:         {ratio(PT_1F1B, PT_AT_USE)}")
    print(f"  pipetrain zb-h1 / pipetrain 1f1b:                {ratio(PT_ZB, PT_1F1B)}")
    print(f"  pipetrain zb-h1 / torch Schedule1F1B:            {ratio(PT_ZB, TORCH_1F1B)}")
    print(f"  pipetrain async-1f1b stash / pipetrain 1f1b:     {ratio(PT_STASH, PT_1F1B)}")
    print(f"  pipetrain async-1f1b spectrain / pipetrain 1f1b: {ratio(PT_SPEC, PT_1F1B)}")
    print(f"  pipetrain 1f1b (2 procs) / single process:       {ratio(PT_1F1B, SINGLE)}")
    print(f"  torch Schedule1F1B (2 procs) / single process:   {ratio(TORCH_1F1B, SINGLE)}")
    print(f"  pipetrain 1f1b / single process, micro-batched:  {ratio(PT_1F1B, SINGLE_MB)}")
    print(f"  single process, micro-batched / whole batch:     {ratio(SINGLE_MB, SINGLE)}")


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 10))


def tiny_worker(rank: int, port: int, args: argparse.Namespace) -> None:
    """CPU per forward or backward action: pipetrain 1f1b vs torch Schedule1F1B, rounds alternating."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    m = 16
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * m, 16, generator=gen), torch.randint(0, 10, (4 * m,), generator=gen)) for _ in range(4)]
    model = tiny_model()
    pipe = pipetrain.wrap(model, batches[0][0][:4], stages=WORLD, micro_batches=m, partitioner=["4"],
                          loss_fn=F.cross_entropy, optimizer=sgd, profile=False, engine="distributed")
    torch_step = torch_pipeline(stage_copy(pipe), rank, m)
    first = check_same_loss(pipe.step, torch_step, batches[0], rank)
    variants = {PT_1F1B: pipe.step, TORCH_1F1B: torch_step}
    for step in variants.values():
        for i in range(args.warmup):
            step(*batches[i % len(batches)])
    per_round = max(1, args.steps // args.rounds)
    cpu = torch.zeros(args.rounds, len(variants), WORLD, dtype=torch.float64)
    for r in range(args.rounds):
        for v, step in enumerate(variants.values()):
            dist.barrier()
            c0 = time.process_time()
            for i in range(per_round):
                step(*batches[(r + i) % len(batches)])
            cpu[r, v, rank] = time.process_time() - c0
            dist.barrier()
    dist.all_reduce(cpu)
    if rank == 0:
        per_action = cpu / (per_round * 2 * m) * 1e3  # ms per forward or backward action
        print(f"tiny MLP (4 x Linear(16)), {m} micro-batches of 4, 2 gloo ranks on 127.0.0.1, 1 thread each; "
              f"{args.rounds} rounds x {per_round} steps; first-step loss {first[0]:.6f} (both)")
        print(f"\n{'CPU ms per F or B action':30s} {'rank 0':>8s} {'rank 1':>8s}   (median over rounds; range)")
        for v, name in enumerate(variants):
            cells = []
            for k in range(WORLD):
                column = per_action[:, v, k].tolist()
                cells.append(f"{statistics.median(column):6.3f} ({min(column):.3f}-{max(column):.3f})")
            print(f"{name:30s} " + "   ".join(cells))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed mini-batches per variant (over all rounds)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="untimed mini-batches per variant first")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--split", default="features.15", help="module the second stage starts with")
    parser.add_argument("--tiny", action="store_true", help="per-action CPU of both runtimes on a tiny MLP")
    args = parser.parse_args()
    if args.batch_size % args.micro_batches:
        parser.error("--batch-size must be a multiple of --micro-batches (both frameworks then cut the same pieces)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(tiny_worker if args.tiny else worker, args=(port, args), nprocs=WORLD)


if __name__ == "__main__":
    main()

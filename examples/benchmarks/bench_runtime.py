"""Runtime throughput on 2 gloo ranks (CPU, 1 thread each): pipetrain vs torch.distributed.pipelining,
schedule by schedule on the same split.

    .venv/bin/python examples/benchmarks/bench_runtime.py [--steps 96] [--rounds 4] [--schedules gpipe,1f1b,...]
    .venv/bin/python examples/benchmarks/bench_runtime.py --tiny [--steps 160]

Model: VGG-11 with BatchNorm, first conv width 16 (0.58 M parameters) on 32x32 inputs, batch 64 in
8 micro-batches. Each pipetrain schedule is paired with torch's counterpart over copies of the very
stage modules pipetrain built (same split, same code, same micro-batches, same initial weights):

  gpipe             torch ScheduleGPipe
  1f1b              torch Schedule1F1B
  interleaved-1f1b  torch ScheduleInterleaved1F1B (2 virtual stages per rank, 4 in all)
  zb-h1             torch ScheduleInterleavedZeroBubble with one stage per rank (ZB1P, the same
                    zero-bubble family: backward split into input and weight gradients)

Two-stage variants split before `--split` (default features.15, which balances the CPU time of the
halves); the interleaved pair uses pipetrain's partitioner for its 4 virtual stages. Before timing,
each pair's first step from identical weights on one mini-batch must report the same loss.

Also timed, against pipetrain 1f1b: the same with receive_ahead=False (each receive posted right before
the computation that needs it instead of one computation early), async-1f1b with every staleness policy (`pipe.train` over a stream of
the round's mini-batches, its fill and drain counted once per round: the ratio it can reach and the
share of that gain it delivers are printed for that stream length, beside the bound the measured split
allows: removing the wait of sync 1f1b's busiest rank), and the unsplit model in one process (rank 1 idles).

Last, the CPU of one forward and backward of the unsplit model with the other rank idle and with both
computing at once: what co-running computations alone cost each other on this machine.

Variants take turns (`--rounds` rounds of steps/rounds mini-batches each) so load from other processes
drifts over all of them alike; each round starts and ends at a barrier and rank 0 times it. Ratios are
medians of within-round ratios. The CPU columns are each rank's process time (all its threads, gloo's
included) per forward or backward action: what the runtime costs whatever else the machine runs.
``--tiny`` measures only that per-action CPU, on a model that computes almost nothing.

``--local`` stays in one process: the local engine with 4 stages of the same VGG, CPU per mini-batch of
async-1f1b with each policy (``pipe.train`` over the round's mini-batches) against sync 1F1B
(``pipe.step`` per mini-batch), and the unsplit model accumulating its micro-batches one at a time
against all forwards first (what holding every micro-batch's activations costs by itself).
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
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

import pipetrain
from pipetrain.apps.models.vgg import VGG
from pipetrain.comm.local_ranks import start_local_ranks

WORLD = 2
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
                   "zb-h1": ScheduleInterleavedZeroBubble}
POLICIES = ("vanilla", "stash", "2bw", "spectrain", "nesterov")
SINGLE = "single process, whole mini-batch"
AT_USE = "pipetrain 1f1b, receives at use"


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return VGG(11, width=width)


def make_batches(count: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch_size, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch_size,), generator=gen))
            for _ in range(count)]


def torch_pipeline(pipe: pipetrain.Pipeline, schedule: str, micro_batches: int) -> Callable:
    """torch.distributed.pipelining's ``schedule`` over copies of the stage modules this rank runs in
    ``pipe`` (their weights as they are now), on a process group of its own; returns its step(x, y)."""
    group = dist.new_group(list(range(WORLD)))
    held = sorted(pipe.held_stages.items())
    virtual = WORLD * len(held)
    modules = [copy.deepcopy(rt.module) for _, rt in held]
    stages = [PipelineStage(m, v, virtual, torch.device("cpu"), group=group) for (v, _), m in zip(held, modules)]
    kind = TORCH_SCHEDULES[schedule]
    single = issubclass(kind, PipelineScheduleSingle)
    runner = kind(stages[0] if single else stages, micro_batches, loss_fn=F.cross_entropy)
    optimizer = sgd([p for m in modules for p in m.parameters()])
    holds_first, holds_last = held[0][0] == 0, held[-1][0] == virtual - 1

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        runner.step(*((x,) if holds_first else ()), target=y if holds_last else None,
                    losses=losses if holds_last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(torch.stack(losses).detach().mean()) if losses else None
    return step


def single_process(model: torch.nn.Module, rank: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """Plain training of the unsplit model on rank 0; the other rank only waits at the round's barrier."""
    optimizer = sgd(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank != 0:
            return
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def check_same_loss(pt_step: Callable, torch_step: Callable, batch, what: str) -> float:
    """First step of both frameworks from identical weights on one mini-batch: the losses must agree."""
    ours = pt_step(*batch)
    theirs = torch_step(*batch)
    box = torch.tensor([theirs if theirs is not None else 0.0], dtype=torch.float64)
    dist.broadcast(box, src=WORLD - 1)  # the last stage is on the last rank in every schedule here
    theirs = float(box)
    if abs(ours - theirs) > 1e-5 * max(1.0, abs(ours)):
        raise RuntimeError(f"{what}: first-step losses differ: pipetrain {ours:.7f} vs torch {theirs:.7f}; "
                           "the two pipelines do not compute the same model")
    return ours


def each_step(step: Callable) -> Callable[[list], None]:
    def run(bs: list) -> None:
        for x, y in bs:
            step(x, y)
    return run


def stream(pipe: pipetrain.Pipeline) -> Callable[[list], None]:
    def run(bs: list) -> None:
        for _ in pipe.train(bs):
            pass
    return run


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    m, b = args.micro_batches, args.batch_size
    batches = make_batches(4, b)
    model = make_model(args.width)
    example = batches[0][0][: b // m]

    def wrap(schedule: str, staleness: str = "none", **extra) -> pipetrain.Pipeline:
        split = {} if schedule == "interleaved-1f1b" else {"partitioner": [args.split]}
        return pipetrain.wrap(model, example, stages=WORLD, micro_batches=m, schedule=schedule, staleness=staleness,
                              loss_fn=F.cross_entropy, optimizer=sgd, profile=False, engine="distributed",
                              **split, **extra)

    variants: dict[str, Callable[[list], None]] = {}
    actions: dict[str, int] = {}  # forward and backward actions per step on each rank
    losses = {}
    for schedule in args.schedules:
        pipe = wrap(schedule)
        theirs = torch_pipeline(pipe, schedule, m)  # copies the stage modules before any step
        losses[schedule] = check_same_loss(pipe.step, theirs, batches[0], schedule)
        variants[f"pipetrain {schedule}"], variants[f"torch {TORCH_SCHEDULES[schedule].__name__}"] = (
            each_step(pipe.step), each_step(theirs))
        actions[f"pipetrain {schedule}"] = actions[f"torch {TORCH_SCHEDULES[schedule].__name__}"] = (
            2 * m * len(pipe.held_stages))
    if "1f1b" in args.schedules:
        variants[AT_USE], actions[AT_USE] = each_step(wrap("1f1b", receive_ahead=False).step), 2 * m
    for policy in args.policies:
        name = f"pipetrain async-1f1b {policy}"
        variants[name], actions[name] = stream(wrap("async-1f1b", policy)), 2 * m
    variants[SINGLE], actions[SINGLE] = each_step(single_process(copy.deepcopy(model), rank)), 0
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
    alone, together = co_running(model, batches[0], rank, per_round, args.rounds)
    if rank == 0:
        print(f"VGG-11 width {args.width} on 32x32, batch {b} in {m} micro-batches, 2-stage split before "
              f"{args.split!r}; gloo on 127.0.0.1, 1 thread per process; {args.rounds} rounds x {per_round} "
              "mini-batches per variant")
        print("first-step loss, pipetrain = torch (same weights, same batch): "
              + ", ".join(f"{s} {loss:.6f}" for s, loss in losses.items()))
        report(seconds, cpu / (args.rounds * per_round), actions, per_round, b, args)
        print(f"  co-running: a forward and backward of the unsplit model on one micro-batch costs {alone * 1e3:.2f} ms "
              f"of CPU with the other rank idle, {together * 1e3:.2f} ms while it runs the same "
              f"({together / alone:.3f}x; medians over {args.rounds} rounds, each rank's mean)")
    dist.destroy_process_group()


def co_running(model: torch.nn.Module, batch: tuple, rank: int, iterations: int, rounds: int) -> tuple[float, float]:
    """CPU seconds of one forward and backward of ``model`` on a micro-batch, each rank's mean: with the other
    rank waiting at a barrier (each alone in turn) and with both computing at once, in alternating rounds.
    What an async stream pays where it keeps both processes busy: on a machine whose cores share caches or
    memory bandwidth, co-running computations slow each other down."""
    x, y = batch[0][:8], batch[1][:8]  # the micro-batch size of the default run
    replica = copy.deepcopy(model)

    def cpu_per_pass() -> float:
        c0 = time.thread_time()
        for _ in range(iterations):
            F.cross_entropy(replica(x), y).backward()
        return (time.thread_time() - c0) / iterations

    cpu_per_pass()  # warm-up
    alone, together = [], []
    for _ in range(rounds):
        mine = 0.0
        for turn in range(WORLD):  # each rank alone while the others wait
            dist.barrier()
            if turn == rank:
                mine = cpu_per_pass()
            dist.barrier()
        alone.append(mine)
        dist.barrier()
        together.append(cpu_per_pass())
    pair = torch.tensor([statistics.median(alone), statistics.median(together)], dtype=torch.float64)
    dist.all_reduce(pair)
    return float(pair[0]) / WORLD, float(pair[1]) / WORLD


def report(seconds: dict[str, list[float]], cpu_per_step: torch.Tensor, actions: dict[str, int],
           steps_per_round: int, batch_size: int, args: argparse.Namespace) -> None:
    """Throughput from the median round (robust to bursts of load from other processes), each rank's CPU
    per action and idle time per mini-batch (wall minus the process's CPU: near 0 on a rank that computes or
    communicates all the time), and the ratios of the pairs."""
    rate = {k: steps_per_round * batch_size / statistics.median(v) for k, v in seconds.items()}
    print(f"\n{'variant':44s} {'samples/s':>10s} {'CPU ms per F/B action, rank 0, 1':>34s} "
          f"{'idle ms per mini-batch, rank 0, 1':>34s}")
    wall: dict[str, float] = {}
    idle: dict[str, list[float]] = {}
    for v, name in enumerate(seconds):
        per_action = (f"{cpu_per_step[v, 0] * 1e3 / actions[name]:13.3f}, {cpu_per_step[v, 1] * 1e3 / actions[name]:6.3f}"
                      if actions[name] else "")
        wall[name] = sum(seconds[name]) / (len(seconds[name]) * steps_per_round)
        idle[name] = [wall[name] - float(cpu_per_step[v, r]) for r in range(WORLD)]
        print(f"{name:44s} {rate[name]:10.1f} {per_action:>34s} "
              f"{f'{idle[name][0] * 1e3:13.1f}, {idle[name][1] * 1e3:6.1f}':>34s}")

    def round_ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(seconds[b], seconds[a])]  # throughput ratio a/b per round

    def ratio(a: str, b: str) -> str:
        rounds = round_ratios(a, b)
        return f"{statistics.median(rounds):5.2f}x  (rounds {min(rounds):.2f}-{max(rounds):.2f})"

    print("\nthroughput ratios (median over rounds of the ratio within a round)")
    for schedule in args.schedules:
        theirs = f"torch {TORCH_SCHEDULES[schedule].__name__}"
        print(f"  {'pipetrain ' + schedule + ' / ' + theirs:62s} {ratio('pipetrain ' + schedule, theirs)}")
    if "1f1b" in args.schedules:
        print(f"  {'pipetrain 1f1b, receives ahead / at use':62s} {ratio('pipetrain 1f1b', AT_USE)}")
        m, n = args.micro_batches, steps_per_round
        # 1F1B runs M + S - 1 slots per mini-batch; a stream of n mini-batches n M + S - 1 (one fill and drain).
        ideal = n * (m + WORLD - 1) / (n * m + WORLD - 1)
        # Stages of unequal cost: the busiest rank waits less than 1F1B's bubble, and its wait is all a stream
        # can remove (one fill and drain per stream kept): n T / (n (T - w) + w).
        sync_wall, wait = wall["pipetrain 1f1b"], min(idle["pipetrain 1f1b"])
        measured = n * sync_wall / (n * (sync_wall - wait) + wait)
        print(f"  (1F1B's bubble on {WORLD} equal stages and {m} micro-batches: {(WORLD - 1) / (m + WORLD - 1):.3f} of "
              f"its time; async streams of {n} mini-batches, one fill and drain each, can reach {ideal:.3f}x. On this "
              f"split the busiest rank of sync 1f1b waits {wait * 1e3:.1f} of {sync_wall * 1e3:.1f} ms per mini-batch: "
              f"removing that wait reaches {measured:.3f}x)")
        for policy in args.policies:
            name = f"pipetrain async-1f1b {policy}"
            gain = statistics.median(round_ratios(name, "pipetrain 1f1b")) - 1
            print(f"  {name + ' / pipetrain 1f1b':62s} {ratio(name, 'pipetrain 1f1b')}  {gain / (ideal - 1):4.0%} of the "
                  f"equal-stage gain, {gain / (measured - 1):4.0%} of the busiest rank's wait")
        print(f"  {'pipetrain 1f1b (2 processes) / ' + SINGLE:62s} {ratio('pipetrain 1f1b', SINGLE)}")


def local_engine(args: argparse.Namespace) -> None:
    """CPU per mini-batch on the local engine (4 stages): async-1f1b per policy against sync 1F1B; and the
    unsplit model's micro-batches one at a time against all forwards first; rounds alternating."""
    torch.set_num_threads(1)
    m, b = args.micro_batches, args.batch_size
    batches = make_batches(4, b)
    model = make_model(args.width)

    def wrap(schedule: str, staleness: str = "none") -> pipetrain.Pipeline:
        return pipetrain.wrap(model, batches[0][0][: b // m], stages=4, micro_batches=m, schedule=schedule,
                              staleness=staleness, loss_fn=F.cross_entropy, optimizer=sgd, profile=False,
                              engine="local")

    def unsplit(forwards_first: bool) -> Callable[[list], None]:
        copy_ = copy.deepcopy(model)
        optimizer = sgd(copy_.parameters())

        def run(bs: list) -> None:
            for x, y in bs:
                pieces = list(zip(x.chunk(m), y.chunk(m)))
                if forwards_first:
                    for loss in [F.cross_entropy(copy_(xs), ys) / m for xs, ys in pieces]:
                        loss.backward()
                else:
                    for xs, ys in pieces:
                        (F.cross_entropy(copy_(xs), ys) / m).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return run

    variants = {"sync 1f1b": each_step(wrap("1f1b").step)}
    variants.update({f"async-1f1b {p}": stream(wrap("async-1f1b", p)) for p in args.policies})
    variants["unsplit, micro-batches one at a time"] = unsplit(False)
    variants["unsplit, all forwards first"] = unsplit(True)
    per_round = max(1, args.steps // args.rounds)
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for run in variants.values():
        run([batches[i % len(batches)] for i in range(args.warmup)])
    for r in range(args.rounds):
        for name, run in variants.items():
            c0 = time.process_time()
            run([batches[(r + i) % len(batches)] for i in range(per_round)])
            cpu[name].append((time.process_time() - c0) / per_round)
    ms = {name: statistics.median(v) * 1e3 for name, v in cpu.items()}
    print(f"local engine, VGG-11 width {args.width} in 4 stages, batch {b} in {m} micro-batches, 1 thread; "
          f"{args.rounds} rounds x {per_round} mini-batches (an async stream's fill and drain once per round)")
    print(f"\n{'variant':40s} {'CPU ms per mini-batch':>22s} {'ratio':>8s}")
    for name, value in ms.items():
        base = ms["unsplit, micro-batches one at a time"] if name.startswith("unsplit") else ms["sync 1f1b"]
        print(f"{name:40s} {value:22.1f} {value / base:8.2f}")


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 10))


def tiny_worker(rank: int, port: int, args: argparse.Namespace) -> None:
    """CPU per forward or backward action, each pipetrain schedule against torch's, rounds alternating."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    m = args.tiny_micro_batches
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4 * m, 16, generator=gen), torch.randint(0, 10, (4 * m,), generator=gen)) for _ in range(4)]
    variants: dict[str, Callable] = {}
    actions: dict[str, int] = {}
    for schedule in args.schedules:
        split = ["2", "4", "6"] if schedule == "interleaved-1f1b" else ["4"]
        pipe = pipetrain.wrap(tiny_model(), batches[0][0][:4], stages=WORLD, micro_batches=m, partitioner=split,
                              schedule=schedule, loss_fn=F.cross_entropy, optimizer=sgd, profile=False,
                              engine="distributed")
        theirs = torch_pipeline(pipe, schedule, m)
        check_same_loss(pipe.step, theirs, batches[0], schedule)
        for name, step in ((f"pipetrain {schedule}", pipe.step), (f"torch {TORCH_SCHEDULES[schedule].__name__}", theirs)):
            variants[name], actions[name] = step, 2 * m * len(pipe.held_stages)
        if schedule == "1f1b":
            at_use = pipetrain.wrap(tiny_model(), batches[0][0][:4], stages=WORLD, micro_batches=m, partitioner=split,
                                    loss_fn=F.cross_entropy, optimizer=sgd, profile=False, engine="distributed",
                                    receive_ahead=False)
            variants[AT_USE], actions[AT_USE] = at_use.step, 2 * m
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
        print(f"tiny MLP (4 x Linear(16)), {m} micro-batches of 4, 2 gloo ranks on 127.0.0.1, 1 thread each; "
              f"{args.rounds} rounds x {per_round} steps; first-step losses equal")
        print(f"\n{'CPU ms per F or B action':40s} {'rank 0':>20s} {'rank 1':>20s}   (median over rounds; range)")
        for v, name in enumerate(variants):
            cells = []
            for k in range(WORLD):
                column = (cpu[:, v, k] / (per_round * actions[name]) * 1e3).tolist()
                cells.append(f"{statistics.median(column):6.3f} ({min(column):.3f}-{max(column):.3f})")
            print(f"{name:40s} " + "   ".join(cells))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=96, help="timed mini-batches per variant (over all rounds)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed mini-batches per variant first")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv")
    parser.add_argument("--split", default="features.15", help="module the second stage starts with")
    parser.add_argument("--schedules", default=",".join(TORCH_SCHEDULES),
                        help=f"comma-separated subset of {','.join(TORCH_SCHEDULES)}")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="async-1f1b staleness policies to time against pipetrain 1f1b (empty: none)")
    parser.add_argument("--tiny", action="store_true", help="per-action CPU of both runtimes on a tiny MLP")
    parser.add_argument("--tiny-micro-batches", type=int, default=16,
                        help="--tiny: micro-batches of 4 samples per step (two counts separate per-step from "
                             "per-action costs)")
    parser.add_argument("--local", action="store_true",
                        help="one process: local-engine async-1f1b per policy against sync 1F1B (CPU per mini-batch)")
    args = parser.parse_args()
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = [s for s in args.schedules if s not in TORCH_SCHEDULES]
    if unknown:
        parser.error(f"unknown schedules {unknown}; choose from {', '.join(TORCH_SCHEDULES)}")
    if args.batch_size % args.micro_batches:
        parser.error("--batch-size must be a multiple of --micro-batches (both frameworks then cut the same pieces)")
    if args.local:
        local_engine(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_local_ranks(tiny_worker if args.tiny else worker, (port, args), WORLD)


if __name__ == "__main__":
    main()

"""The layout planner's predicted per-rank peak (``pipetrain plan``'s pricing: partitioners.planners.layout
evaluate_layout) against the peak the runtime measures, on 2 stages x 2 replicas of gloo ranks.

An MLP built on the meta device, Adam, 1F1B; for each ZeRO level in LEVELS and each recomputation setting in
RECOMPUTE one pipeline is wrapped and stepped twice (Adam makes its state at the first step), all in one
torchrun world. Measured: each rank's own peak of its second step, as the runtime takes it on CPU (the bytes of
the stage's tensors: weights, gradients, optimizer state, held activations; pipetrain.runtime.tensor_bytes).
Predicted: evaluate_layout on the plan's own graph and cuts, the same options. A ZeRO level is one entry of
LEVELS: its wrap options.

    python examples/benchmarks/bench_plan_memory.py               # docs/big-models.md's table (about a minute)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

LEVELS: dict[int, dict] = {0: {}, 1: {"zero": 1}, 2: {"zero": 2}, 3: {"zero": 3}}  # zero level -> wrap options
RECOMPUTE = ("none", "always")
STAGES, REPLICAS = 2, 2


def build_model(width: int, depth: int) -> torch.nn.Module:
    """``depth`` Linear + ReLU layers of ``width`` and a 10-class head, on the meta device."""
    with torch.device("meta"):
        layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(depth)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def measure(args: argparse.Namespace, zero: int, recompute: str) -> dict:
    """One rank's measured and predicted peak bytes for one setting."""
    import torch.distributed as dist

    import pipetrain
    from partitioners.planners.layout import evaluate_layout
    from schedules.cluster import Cluster

    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    micro = args.batch // (REPLICAS * args.micro_batches)
    pipe = pipetrain.wrap(build_model(args.width, args.depth), x[:micro], stages=STAGES,
                          micro_batches=args.micro_batches, data_parallel=REPLICAS, schedule="1f1b",
                          optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), partitioner="params", profile=False,
                          engine="distributed", recompute=recompute, allreduce="flat", timeout=300,
                          **LEVELS[zero])
    (k, runtime), = pipe.held_stages.items()
    taken = []
    take = runtime._take_peak_memory  # the runtime's own measurement, recorded as this rank takes it
    runtime._take_peak_memory = lambda: taken.append(take()) or taken[-1]
    pipe.step(x, y)
    pipe.step(x, y)  # from the second step on Adam's state exists
    cluster = Cluster(nodes=1, devices_per_node=STAGES * REPLICAS, intra_bandwidth=1e9, intra_latency=0.0,
                      inter_bandwidth=1e9, inter_latency=0.0)
    predicted = evaluate_layout(pipe.plan.graph, cluster, pipe.plan.cuts, replicas=REPLICAS,
                                micro_batches=args.micro_batches, schedule="1f1b", batch_size=args.batch,
                                profiled_batch=micro, optimizer="adam", zero=zero, recompute=recompute)
    mine = {"rank": dist.get_rank(), "stage": k, "zero": zero, "recompute": recompute, "measured": taken[-1],
            "predicted": predicted.stage_memory[k].total}
    pipe.close()
    return mine


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: every setting in turn, the figures gathered on rank 0."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = [measure(args, zero, recompute) for zero in args.levels for recompute in RECOMPUTE]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() == 0:
        print("FIGURES " + json.dumps([row for rank in gathered for row in rank]), flush=True)


def run(args: argparse.Namespace) -> list[dict]:
    """Every rank's rows of one torchrun world."""
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("width", "depth", "batch", "micro_batches")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={STAGES * REPLICAS}",
               __file__, "--worker", "--levels", *map(str, args.levels), *passthrough]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"the gloo world failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("FIGURES "))
    return json.loads(line[len("FIGURES "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048, help="global mini-batch, over 2 replicas x micro-batches")
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = sorted(run(args), key=lambda r: (r["zero"], RECOMPUTE.index(r["recompute"]), r["rank"]))
    print(f"{STAGES} stages x {REPLICAS} replicas, 1f1b, {args.micro_batches} micro-batches of "
          f"{args.batch // (REPLICAS * args.micro_batches)}, MLP width {args.width} depth {args.depth}, Adam")
    print(f"{'zero':>4} {'recompute':>9} {'rank':>4} {'stage':>5} {'predicted B':>12} {'measured B':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['zero']:>4} {r['recompute']:>9} {r['rank']:>4} {r['stage']:>5} {r['predicted']:>12.0f} "
              f"{r['measured']:>12.0f} {r['measured'] / r['predicted']:>6.3f}")


if __name__ == "__main__":
    main()

"""Calibrate the hybrid cost model on this machine: predicted vs measured step times (gloo, CPU).

    .venv/bin/python examples/benchmarks/bench_calibration.py [--steps 6]

1. Times dist.all_reduce of several sizes on 2 and 4 gloo ranks and fits the ring
   model's latency alpha and bandwidth beta (t = 2(p-1) alpha + 2(p-1)/p n / beta).
2. Profiles an MLP once (partitioners.trace, one thread), runs pipetrain.wrap on 2 and 4
   ranks (pipeline of 2 and 4 stages; hybrid 2 stages x data_parallel 2) and compares the
   median step time with schedules.simulate_hybrid on a one-node Cluster built from the fit.
   Ranks beyond the machine's cores share them, so the cluster's speed is cores / ranks then.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import partitioners
import pipetrain
from partitioners.layout import evaluate_layout
from schedules.cluster import Cluster
from schedules.collectives_cost import Reduction

SIZES = [4, 64 * 1024, 1 << 20, 4 << 20]
WIDTH, DEPTH, BATCH, MICRO = 512, 8, 128, 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 10))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, job: str, out: str, steps: int, dp: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: object
    try:
        if job == "allreduce":
            result = {}
            for n in SIZES:
                t = torch.zeros(max(1, n // 4))
                times = []
                for i in range(steps * 5 + 3):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t)
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                result[n] = statistics.median(times)
        else:
            torch.manual_seed(1)
            x, y = torch.randn(BATCH, WIDTH), torch.randint(0, 10, (BATCH,))
            pipe = pipetrain.wrap(make_model(), x[: BATCH // (MICRO * dp)], stages=world // dp,
                                  micro_batches=MICRO, schedule="1f1b", data_parallel=dp,
                                  engine="distributed", partitioner="time")
            times = []
            for i in range(steps + 2):
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, y)
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            result = {"seconds": statistics.median(times), "cuts": pipe.plan.cuts}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except Exception as exc:  # report to the parent (e.g. data_parallel unsupported)
        torch.save({"error": repr(exc)}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(world: int, job: str, steps: int, dp: int = 1) -> object:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, _port(), job, out, steps, dp), nprocs=world)
        return torch.load(Path(out) / "rank0.pt", weights_only=False)


def fit_ring(samples: dict[int, dict[int, float]]) -> tuple[float, float]:
    """Least-squares alpha, 1/beta of the ring model over every (world, size) sample."""
    rows, times = [], []
    for p, by_size in samples.items():
        for n, t in by_size.items():
            rows.append([2 * (p - 1), 2 * (p - 1) / p * n])
            times.append(t)
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)
    return max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    samples = {p: run(p, "allreduce", args.steps) for p in (2, 4)}
    alpha, beta = fit_ring(samples)
    print(f"gloo all_reduce on this machine ({cores} cores): fit alpha = {alpha * 1e3:.3f} ms per step, "
          f"beta = {beta / 1e9:.3f} GB/s")
    print(f"{'ranks':>5} {'bytes':>9} {'measured ms':>12} {'ring model ms':>14}")
    for p, by_size in samples.items():
        for n, t in by_size.items():
            model = 2 * (p - 1) * alpha + 2 * (p - 1) / p * n / beta
            print(f"{p:>5} {n:>9} {t * 1e3:>12.3f} {model * 1e3:>14.3f}")

    torch.set_num_threads(1)
    x = torch.randn(BATCH // MICRO, WIDTH)
    graph = partitioners.trace(make_model(), x, profile=True)
    print(f"\nMLP {DEPTH} x Linear({WIDTH}), batch {BATCH}, {MICRO} micro-batches, 1f1b; compute "
          f"profiled at micro-batch {BATCH // MICRO}: {graph.total_time() * 1e3:.2f} ms fwd+bwd")
    print(f"{'run':<28} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for world, dp in ((2, 1), (4, 1), (4, 2)):
        label = f"world {world}: {world // dp} stages x {dp} replicas"
        got = run(world, "pipeline", args.steps, dp)
        if "error" in got:
            print(f"{label:<28} not run: {got['error']}")
            continue
        cluster = Cluster(nodes=1, devices_per_node=world, intra_bandwidth=beta, intra_latency=alpha,
                          inter_bandwidth=beta, inter_latency=alpha, speed=min(1.0, cores / world))
        lay = evaluate_layout(graph, cluster, got["cuts"], replicas=dp, micro_batches=MICRO,
                              schedule="1f1b", batch_size=BATCH, profiled_batch=BATCH // MICRO,
                              reduction=Reduction(bucket_bytes=25e6))
        err = lay.step_time / got["seconds"] - 1
        print(f"{label:<28} {got['seconds'] * 1e3:>12.2f} {lay.step_time * 1e3:>13.2f} {100 * err:>+6.1f}%")


if __name__ == "__main__":
    main()

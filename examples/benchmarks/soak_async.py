"""Soak: a long async-1f1b stream on 4 gloo ranks holds memory flat and loses no step.

    .venv/bin/python examples/benchmarks/soak_async.py [--steps 20000] [--staleness stash]

Model: 4 x Linear(16, 16) with ReLU, one stage per rank, 2 micro-batches of 4 samples per
mini-batch, SGD with momentum; the mini-batches are generated on the fly (every rank draws the
same stream from one seed). Each rank samples its resident set size (RSS, /proc/self/statm)
every 1,000 steps. Growth is measured from the end of the warm-up (step 2,000: allocator pools,
gloo buffers and the autograd graph cache are full by then) to the end. It prints per rank
the results it received (must equal --steps, each with step numbers 1..N in order), the RSS at
warm-up and at the end, and the growth in percent.
"""
from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pipetrain

WORLD, WIDTH, BATCH, MICRO = 4, 16, 8, 2
WARMUP, SAMPLE_EVERY = 2000, 1000


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def stream(steps: int, seed: int):
    """`steps` random (x, y) regression mini-batches, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def worker(rank: int, port: int, steps: int, staleness: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(WORLD) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])
    pipe = pipetrain.wrap(model, torch.randn(BATCH // MICRO, WIDTH), stages=WORLD, micro_batches=MICRO,
                          schedule="async-1f1b", staleness=staleness, partitioner="uniform", profile=False,
                          loss_fn=torch.nn.functional.mse_loss, engine="distributed",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    seen, samples = [], {}
    for result in pipe.train(stream(steps, seed=1)):
        seen.append(result.step)
        if result.step % SAMPLE_EVERY == 0 or result.step == WARMUP:
            samples[result.step] = rss_bytes()
    samples[len(seen)] = rss_bytes()
    torch.save({"steps": seen, "rss": samples, "finite": all(torch.isfinite(v).all() for v in pipe.state_dict().values())},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--staleness", default="stash", choices=["vanilla", "stash", "spectrain"])
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        raise SystemExit(f"--steps must exceed the {WARMUP}-step warm-up")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args.steps, args.staleness, args.out), nprocs=WORLD)
    print(f"async-1f1b/{args.staleness}, {WORLD} ranks, {args.steps} mini-batches:")
    worst = 0.0
    for rank in range(WORLD):
        r = torch.load(Path(args.out) / f"rank{rank}.pt", weights_only=False)
        complete = r["steps"] == list(range(1, args.steps + 1))
        start, end = r["rss"][WARMUP], r["rss"][max(r["rss"])]
        growth = 100 * (end - start) / start
        worst = max(worst, growth)
        print(f"  rank {rank}: {len(r['steps'])} results, in order and complete: {complete}; parameters finite: "
              f"{r['finite']}; RSS {start / 2**20:.1f} MiB at step {WARMUP} -> {end / 2**20:.1f} MiB at the end "
              f"({growth:+.2f}%)")
    print(f"worst RSS growth after warm-up: {worst:+.2f}%")


if __name__ == "__main__":
    main()

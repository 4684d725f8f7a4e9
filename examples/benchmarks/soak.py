"""Soak: a long async-1f1b stream on 4 gloo ranks holds memory flat and loses no step.

    python examples/benchmarks/soak.py [--steps 20000] [--warmup 2000] [--every 1000] [--staleness stash]

Model: 4 x Linear(16, 16) with ReLU, one stage per rank, 2 micro-batches of 4 samples per
mini-batch, SGD with momentum; the mini-batches are generated on the fly (every rank draws the
same stream from one seed). Each rank samples its resident set size (RSS, /proc/self/statm)
every --every steps. Growth is measured from the end of the warm-up (--warmup: allocator pools,
gloo buffers and the autograd graph cache are full by then) to the end. It prints the RSS of every
rank at each sample, then per rank the results it received (must be --steps, with step numbers
1..N in order), the growth in percent, and a verdict against the 2% bound. It exits with status 1
when a rank lost a step or ended with non-finite parameters (the RSS verdict is only printed: a
short run, e.g. --steps 60 --warmup 20 --every 20, measures no steady state).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.comm.local_ranks import start_local_ranks

WORLD, WIDTH, BATCH, MICRO = 4, 16, 8, 2
MAX_GROWTH = 2.0  # percent of RSS after warm-up that "flat" allows


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def stream(steps: int, seed: int):
    """`steps` random (x, y) regression mini-batches, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def worker(rank: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    # A file store: no port to choose, so no other program can take it between choice and use.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(WORLD) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])
    pipe = pipetrain.wrap(model, torch.randn(BATCH // MICRO, WIDTH), stages=WORLD, micro_batches=MICRO,
                          schedule="async-1f1b", staleness=args.staleness, partitioner="uniform", profile=False,
                          loss_fn=torch.nn.functional.mse_loss, engine="distributed",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    # Counted, not kept: a list of 20,000 step numbers would itself grow the RSS being measured.
    received, in_order, samples = 0, True, {}
    for result in pipe.train(stream(args.steps, seed=1)):
        received += 1
        in_order &= result.step == received
        if result.step % args.every == 0 or result.step == args.warmup:
            samples[result.step] = rss_bytes()
    samples[received] = rss_bytes()
    torch.save({"received": received, "in_order": in_order, "rss": samples,
                "finite": all(torch.isfinite(v).all() for v in pipe.state_dict().values())}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def report(args: argparse.Namespace, ranks: list[dict]) -> bool:
    """Print the RSS table, per-rank results and verdicts; True when no rank lost a step."""
    mib = 2 ** 20
    print(f"async-1f1b/{args.staleness}, {WORLD} gloo ranks, {args.steps} mini-batches, warm-up {args.warmup}")
    print("step     " + "".join(f"rank {r} RSS MiB  " for r in range(WORLD)))
    for step in sorted(ranks[0]["rss"]):
        print(f"{step:<8} " + "".join(f"{r['rss'][step] / mib:>14.1f}  " for r in ranks))
    ok, worst = True, 0.0
    for rank, r in enumerate(ranks):
        complete = r["received"] == args.steps and r["in_order"]
        ok &= complete and r["finite"]
        start, end = r["rss"][args.warmup], r["rss"][max(r["rss"])]
        growth = 100 * (end - start) / start
        worst = max(worst, growth)
        print(f"rank {rank}: {r['received']} of {args.steps} results, in order and complete: {complete}; "
              f"parameters finite: {r['finite']}; RSS {start / mib:.1f} MiB at step {args.warmup} -> "
              f"{end / mib:.1f} MiB at the end ({growth:+.2f}%)")
    print(f"worst RSS growth after warm-up: {worst:+.2f}% ({'within' if worst < MAX_GROWTH else 'ABOVE'} the "
          f"{MAX_GROWTH:g}% bound)")
    print(f"steps: {'none lost' if ok else 'LOST OR OUT OF ORDER (or non-finite parameters)'}")
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=2000, help="RSS growth is measured from this step on")
    parser.add_argument("--every", type=int, default=1000, help="sample RSS every this many steps")
    parser.add_argument("--staleness", default="stash", choices=["vanilla", "stash", "spectrain", "2bw", "nesterov"])
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps or args.every < 1:
        raise SystemExit("need 0 < --warmup < --steps and --every >= 1")
    with tempfile.TemporaryDirectory() as out:
        start_local_ranks(worker, (args, out), WORLD)
        ranks = [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    sys.exit(0 if report(args, ranks) else 1)


if __name__ == "__main__":
    main()

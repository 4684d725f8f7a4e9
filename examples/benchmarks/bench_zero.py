"""ZeRO in hybrid mode on this machine: a small Transformer with Adam, 2 stages x D replicas (D = 1, 2, 4) on
gloo ranks, zero = 0, 1, 2, 3 side by side in one run.

Per rank it measures the peak resident memory (``ru_maxrss``), the parameter bytes held between steps (1/D
under zero=3), the optimizer-state bytes (Adam's even slices
under zero: the largest share is printed against 1/D), the gradient bytes held when the optimizer steps, the time per step and the bytes the process writes to its sockets per step
(``wchar`` of /proc/self/io: gloo sends with write/writev, so this is what goes on the wire, pipeline
activations included, which are the same at every zero level). Each figure is printed per rank and as the
ratio to zero=0 at the same D.

    python examples/benchmarks/bench_zero.py                    # README's figures (a few minutes)
    python examples/benchmarks/bench_zero.py --width 64 --steps 2   # seconds
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from pipetrain.runtime.local_shards import local_bytes

MIB = 2 ** 20


def written_bytes() -> int:
    """Bytes this process has passed to write-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def optimizer_bytes(pipe) -> int:
    """Bytes of this rank's optimizer state (its local shards under zero=3)."""
    return sum(local_bytes(t) for rt in pipe.held_stages.values() if rt.optimizer is not None
               for state in rt.optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def gradients_at_step(pipe) -> dict:
    """zero=3: records the bytes of the gradient shards this rank's optimizers step on (FSDP2 has no reducer of
    pipetrain's to ask)."""
    seen = {"bytes": 0}

    def record(optimizer, args, kwargs) -> None:
        seen["bytes"] = sum(local_bytes(p.grad) for g in optimizer.param_groups for p in g["params"]
                            if p.grad is not None)

    for rt in pipe.held_stages.values():
        if rt.optimizer is not None:
            rt.optimizer.register_step_pre_hook(record)
    return seen


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: wrap, a warm-up step, ``steps`` timed steps, its figures gathered on rank 0."""
    import torch.distributed as dist

    import pipetrain
    from pipetrain.apps.models import TransformerClassifier

    torch.set_num_threads(1)
    class Classifier(TransformerClassifier):
        def reset_parameters(self) -> None:  # the learned positions, which the model initialises inline
            torch.nn.init.normal_(self.pos, std=0.02)

    # Built on the meta device: each rank materialises only its stage, so its peak is its stage's own.
    with torch.device("meta"):
        model = Classifier(num_classes=10, in_features=4, width=args.width, depth=args.depth,
                           heads=max(1, args.width // 64), max_len=args.seq)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.seq, 4, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    replicas = int(os.environ["WORLD_SIZE"]) // 2
    pipe = pipetrain.wrap(model, x[:2], stages=2, micro_batches=args.micro_batches, data_parallel=replicas,
                          optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), partitioner="params", profile=False,
                          engine="distributed", zero=args.zero, allreduce="flat", timeout=300)
    at_step = gradients_at_step(pipe)
    pipe.step(x, y)  # warm-up: Adam's state is made at the first step
    dist.barrier()
    written, start = written_bytes(), time.perf_counter()
    for _ in range(args.steps):
        pipe.step(x, y)
    seconds = (time.perf_counter() - start) / args.steps
    wire = (written_bytes() - written) / args.steps
    reducer = pipe.gradient_reducer
    params = sum(local_bytes(p) for rt in pipe.held_stages.values() for p in rt.params)  # held between steps
    mine = {"rank": dist.get_rank(), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "param_bytes": params, "optimizer_bytes": optimizer_bytes(pipe),
            "grad_bytes": reducer.gradient_bytes if reducer is not None else at_step["bytes"],
            "step_s": seconds, "wire_bytes": wire}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        print("FIGURES " + json.dumps(gathered), flush=True)
    pipe.close()


def run(args: argparse.Namespace, replicas: int, zero: int) -> list[dict]:
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                   for k in ("width", "depth", "seq", "batch", "micro_batches", "steps")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={2 * replicas}",
               __file__, "--worker", f"--zero={zero}", *passthrough]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"D={replicas} zero={zero} failed:\n{done.stderr[-4000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("FIGURES "))
    return json.loads(line[len("FIGURES "):])


def report(replicas: int, results: dict[int, list[dict]]) -> None:
    base = results[0]
    print(f"\nD = {replicas} replicas per stage ({2 * replicas} ranks); per rank, zero=k / zero=0")
    print(f"{'zero':>4} {'rank':>4} {'peak RSS MiB':>12} {'params':>10} {'optimizer':>10} {'gradients':>10} "
          f"{'step s':>8} {'wire B/step':>11} | {'RSS':>5} {'param':>5} {'optim':>5} {'grads':>5} {'time':>5} {'wire':>5}")
    for zero, ranks in sorted(results.items()):
        for r, b in zip(ranks, base):
            print(f"{zero:>4} {r['rank']:>4} {r['peak_rss_mib']:>12.0f} {r['param_bytes'] / MIB:>9.2f}M "
                  f"{r['optimizer_bytes'] / MIB:>9.2f}M "
                  f"{r['grad_bytes'] / MIB:>9.2f}M {r['step_s']:>8.3f} {r['wire_bytes']:>11.0f} | "
                  f"{r['peak_rss_mib'] / b['peak_rss_mib']:>5.2f} {r['param_bytes'] / b['param_bytes']:>5.2f} "
                  f"{r['optimizer_bytes'] / b['optimizer_bytes']:>5.2f} "
                  f"{r['grad_bytes'] / b['grad_bytes']:>5.2f} {r['step_s'] / b['step_s']:>5.2f} "
                  f"{r['wire_bytes'] / b['wire_bytes']:>5.3f}")
        total = sum(r["wire_bytes"] for r in ranks) / sum(b["wire_bytes"] for b in base)
        print(f"{'':>4} all ranks' wire bytes per step: {total:.4f} x zero=0's")
        if zero:
            share = max(r["optimizer_bytes"] / b["optimizer_bytes"] for r, b in zip(ranks, base))
            print(f"{'':>4} largest optimizer-state share of a rank: {share:.4f} of its stage's (1/D = {1 / replicas:.4f})")
        if zero == 3:
            held = max((r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"])
                       / (b["param_bytes"] + b["grad_bytes"] + b["optimizer_bytes"]) for r, b in zip(ranks, base))
            print(f"{'':>4} largest parameters + gradients + optimizer share of a rank: {held:.4f} (1/D = "
                  f"{1 / replicas:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    for replicas in args.replicas:
        levels = (0,) if replicas == 1 else (0, 1, 2, 3)  # zero needs replicas to shard over
        report(replicas, {zero: run(args, replicas, zero) for zero in levels})


if __name__ == "__main__":
    main()

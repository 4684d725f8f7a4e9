"""Memory per stage: predicted vs measured peak, what recomputation costs, and torch's Schedule1F1B.

    .venv/bin/python examples/benchmarks/bench_memory.py [--rounds 9] [--fast]

For a Transformer (pipetrain.apps.models "transformer", width 64, 4 layers, sequences of 64 steps)
and a CNN (VGG-11 at width 16, 32x32 RGB), both split into 4 stages by the graph partitioner, batch
64 in 8 micro-batches, SGD with momentum, engine="local":

1. per stage, the plan's predicted peak (pipe.plan.stage_memory) against the measured one
   (StepResult.peak_memory), at 1f1b and gpipe with recompute none / except-last / always, and the
   peak activation bytes (StepResult.activation_bytes);
2. the step time of each setting, the fastest of its rounds (the settings take turns in every round;
   on a machine shared with other work the fastest is the one least disturbed), and its ratio to the
   step without recomputation;
3. the same split trained by torch.distributed.pipelining's Schedule1F1B and by pipetrain's 1f1b,
   each stage a gloo process, measured the same way: the peak bytes of the activations autograd keeps
   alive (distinct storages, weights left out) during a step, through saved_tensors_hooks.

--fast: tiny models, one round, no torch comparison (the test suite runs it).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipetrain
from pipetrain.apps.models import build_model
from pipetrain.comm.local_ranks import start_local_ranks

STAGES, MICRO_BATCHES, BATCH = 4, 8, 64
SCHEDULES = ("1f1b", "gpipe")
RECOMPUTE = ("none", "except-last", "always")


def sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def models(fast: bool):
    """(name, model factory, inputs, targets) of the two benchmark models."""
    g = torch.Generator().manual_seed(0)
    width, length, side = (16, 16, 32) if fast else (64, 64, 32)
    batch = 16 if fast else BATCH

    def transformer():
        torch.manual_seed(0)
        return build_model("transformer", num_classes=10, width=width, depth=4)

    def cnn():
        torch.manual_seed(0)
        return build_model("vgg", num_classes=10, width=width // 4 if fast else 16, depth=11)

    y = torch.randint(0, 10, (batch,), generator=g)
    return [("transformer", transformer, torch.randn(batch, length, 1, generator=g), y),
            ("cnn", cnn, torch.randn(batch, 3, side, side, generator=g), y)]


def wrap(factory, x, schedule: str, recompute: str, engine: str = "local"):
    return pipetrain.wrap(factory(), x[: x.shape[0] // MICRO_BATCHES], stages=STAGES, micro_batches=MICRO_BATCHES,
                          schedule=schedule, optimizer=sgd, profile=False, engine=engine, recompute=recompute)


def measure(factory, x, y, rounds: int) -> dict:
    """Per (schedule, recompute): predicted and measured peaks, activation peaks, fastest step seconds."""
    pipes = {(s, r): wrap(factory, x, s, r) for s in SCHEDULES for r in RECOMPUTE}
    results = {key: pipe.train([(x, y)]) for key, pipe in pipes.items()}
    last = {key: next(iter(it)) for key, it in results.items()}  # warm-up (counts shapes once)
    seconds: dict = {key: [] for key in pipes}
    for _ in range(rounds):
        for key, pipe in pipes.items():
            start = time.perf_counter()
            last[key] = next(iter(pipe.train([(x, y)])))
            seconds[key].append(time.perf_counter() - start)
    return {key: {"predicted": pipes[key].plan.stage_memory, "measured": last[key].peak_memory,
                  "activations": last[key].activation_bytes, "seconds": min(seconds[key]),
                  "cuts": pipes[key].plan.cuts}
            for key in pipes}


class LiveActivations(torch.autograd.graph.saved_tensors_hooks):
    """The bytes of the distinct storages autograd keeps for backward, alive at once, and their peak."""

    def __init__(self, weights: set[int]):
        self.count: dict[int, list[int]] = {}
        self.live = self.peak = 0
        tracker = self

        class Held:
            __slots__ = ("tensor", "key")

            def __init__(self, tensor: torch.Tensor, key: int):
                self.tensor, self.key = tensor, key

            def __del__(self):
                tracker._release(self.key)

        def pack(t: torch.Tensor):
            key = t.untyped_storage().data_ptr()
            if key in weights:
                return t
            entry = self.count.setdefault(key, [0, t.numel() * t.element_size()])
            if entry[0] == 0:
                self.live += entry[1]
                self.peak = max(self.peak, self.live)
            entry[0] += 1
            return Held(t, key)

        super().__init__(pack, lambda h: h.tensor if isinstance(h, Held) else h)

    def _release(self, key: int) -> None:
        entry = self.count[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.count[key]


def _weights(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(STAGES),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(STAGES))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=STAGES, timeout=timedelta(seconds=300))
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    peaks = {}
    for name, factory, x, y in models(fast=False):
        pipe = wrap(factory, x, "1f1b", "none", engine="distributed")
        list(pipe.train([(x, y)]))  # warm-up: the stage counts its saved bytes once per shape, by a hook of its own
        ours = LiveActivations(_weights(pipe.state_dict().values()))  # this rank's parameters and buffers
        with ours:
            list(pipe.train([(x, y)]))
        (held,) = pipe.held_stages.values()
        stage = PipelineStage(copy.deepcopy(held.module), rank, STAGES, torch.device("cpu"))
        optimizer = sgd(stage.submod.parameters())
        schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=F.cross_entropy)

        def torch_step():
            args = (x,) if rank == 0 else ()
            schedule.step(*args, target=y if rank == STAGES - 1 else None)
            optimizer.step()
            optimizer.zero_grad()

        torch_step()
        theirs = LiveActivations(_weights(stage.submod.state_dict().values()))
        with theirs:
            torch_step()
        peaks[name] = (ours.peak, theirs.peak)
    torch.save(peaks, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def against_torch() -> dict:
    """Per model, per stage: (pipetrain 1f1b, torch Schedule1F1B) peak live activation bytes."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        start_local_ranks(_rank, (port, out), STAGES)
        per_rank = [torch.load(os.path.join(out, f"rank{k}.pt")) for k in range(STAGES)]
    return {name: [per_rank[k][name] for k in range(STAGES)] for name in per_rank[0]}


def mb(n: float) -> str:
    return f"{n / 2**20:.2f}"


def report(name: str, rows: dict) -> None:
    print(f"\n{name}: 4 stages, {MICRO_BATCHES} micro-batches; per stage predicted / measured peak MiB (error)")
    for (schedule, recompute), r in rows.items():
        base = rows[(schedule, "none")]["seconds"]
        cells = "  ".join(f"{mb(p)}/{mb(m)} ({(p - m) / m:+.1%})" for p, m in zip(r["predicted"], r["measured"]))
        print(f"  {schedule:>5} {recompute:>11}  {cells}  step {r['seconds'] * 1e3:7.1f} ms "
              f"(x{r['seconds'] / base:.2f})  activations MiB {' '.join(mb(a) for a in r['activations'])}")
    worst = max(abs(p - m) / m for (s, rc), r in rows.items() if rc in ("none", "always")
                for p, m in zip(r["predicted"], r["measured"]))
    print(f"  largest prediction error (none, always): {worst:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--fast", action="store_true", help="tiny models, one round, no torch comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 1 if args.fast else args.rounds
    for name, factory, x, y in models(args.fast):
        report(name, measure(factory, x, y, rounds))
    if args.fast:
        return
    print("\npeak live activation MiB per stage, 1f1b on the same split, each stage a gloo process:")
    for name, stages in against_torch().items():
        cells = "  ".join(f"{mb(a)} vs {mb(b)} ({a / b:.2f})" for a, b in stages)
        print(f"  {name:>11}: pipetrain vs torch Schedule1F1B  {cells}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

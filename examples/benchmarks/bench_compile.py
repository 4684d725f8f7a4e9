"""compile=True vs eager: step time per schedule and the compile time, on a small Transformer LM.

    .venv/bin/python examples/benchmarks/bench_compile.py [--rounds 5] [--steps 4] [--width 64] [--length 64]
        [--schedules gpipe,zb-h1]

pipetrain.apps.models' TransformerLM (`depth` pre-norm encoder layers of width `width`, 4 heads, vocabulary
64) trained by wrap(stages=2, micro_batches=4, engine="local", partitioner="uniform") on random tokens,
batch 32 of `length` tokens, per schedule (gpipe, 1f1b, interleaved-1f1b, async-1f1b with stash, zb-h1: its
stages run derived F, B and W graphs, compiled). For each,
an eager and a compiled pipeline are built from the same weights; "compile s" is the compiled pipeline's
first step minus the eager one's (each stage's graphs compiled; in torch's fresh_cache, an empty on-disk
cache and cleared in-memory ones, so nothing is reused from an earlier run or schedule). Then both take turns in every round, `steps`
mini-batches each, and the ratio is the median over rounds of eager / compiled seconds per step, so
background load drifts over both alike. "pays after" is the compile time over the time saved per step.
One thread (as each rank of the distributed engine).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch._inductor.utils import fresh_cache

SCHEDULES = (("gpipe", "none"), ("1f1b", "none"), ("interleaved-1f1b", "none"), ("async-1f1b", "stash"),
             ("zb-h1", "none"))
VOCAB, BATCH = 64, 32


def tokens(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, length + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


class Timed:
    """A pipeline and a way to run `steps` mini-batches of it; returns seconds per step."""

    def __init__(self, args, schedule: str, staleness: str, compile: bool):
        import pipetrain
        from pipetrain.apps.models.transformer import TransformerLM

        torch.manual_seed(0)
        model = TransformerLM(num_classes=VOCAB, width=args.width, depth=args.depth, heads=4, max_len=args.length)
        self.pipe = pipetrain.wrap(model, tokens(args.length, 0)[0][:8], stages=2, micro_batches=4, schedule=schedule,
                                   staleness=staleness, partitioner="uniform", profile=False, engine="local",
                                   compile=compile)
        self.length, self.async_ = args.length, schedule == "async-1f1b"

    def run(self, steps: int, seed: int) -> float:
        batches = [tokens(self.length, seed + i) for i in range(steps)]
        start = time.perf_counter()
        if self.async_:
            for _ in self.pipe.train(batches):
                pass
        else:
            for x, y in batches:
                self.pipe.step(x, y)
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="mini-batches per variant per round")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES), help="comma-separated")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"TransformerLM width {args.width}, {args.depth} layers, batch {BATCH} x {args.length} tokens, "
          f"2 stages x 4 micro-batches, local engine, {args.rounds} rounds x {args.steps} steps, one thread")
    print(f"{'schedule':<22}{'compile s':>10}{'eager ms':>10}{'compiled ms':>12}{'eager/compiled':>16}{'pays after':>12}")
    for schedule, staleness in [c for c in SCHEDULES if c[0] in args.schedules.split(",")]:
        eager, compiled = Timed(args, schedule, staleness, False), Timed(args, schedule, staleness, True)
        with fresh_cache():
            compile_s = compiled.run(1, 0) - eager.run(1, 0)
        eager_s, compiled_s, ratios = [], [], []
        for r in range(args.rounds):
            seed = 1000 * (r + 1)
            e, c = eager.run(args.steps, seed), compiled.run(args.steps, seed)
            eager_s.append(e)
            compiled_s.append(c)
            ratios.append(e / c)
        e, c = statistics.median(eager_s), statistics.median(compiled_s)
        saved = e - c
        pays = f"{compile_s / saved:.0f} steps" if saved > 0 else "never"
        name = schedule if staleness == "none" else f"{schedule} {staleness}"
        print(f"{name:<22}{compile_s:>10.1f}{e * 1e3:>10.1f}{c * 1e3:>12.1f}{statistics.median(ratios):>15.2f}x{pays:>12}",
              flush=True)


if __name__ == "__main__":
    main()

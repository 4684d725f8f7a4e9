"""Simulated makespan and bubble of every schedule, and the cost of building a big one.

Costs: forward = 1, backward = 1 (input gradient) + 1 (weight gradient), free
communication; so a full backward costs 2 and zb-h1 runs the two halves as B and W.
async-1f1b streams 4 mini-batches (its makespan covers all of them).
Run: python examples/benchmarks/bench_schedules.py
"""
import time

from schedules import BUILDERS, Costs, build, simulate

COSTS = Costs(forward=1, backward=1, weight=1)
OPTIONS = {"interleaved-1f1b": {"chunks": 2}, "async-1f1b": {"mini_batches": 4}}


def table() -> None:
    print(f"{'schedule':<18} {'p':>3} {'m':>4} {'makespan':>9} {'bubble':>8}")
    for kind in BUILDERS:
        for p in (4, 8):
            for m in (4, 8, 32):
                if kind == "interleaved-1f1b" and m % p:
                    print(f"{kind:<18} {p:>3} {m:>4} {'n/a (m % p != 0)':>18}")
                    continue
                result = simulate(build(kind, p, m, **OPTIONS.get(kind, {})), COSTS)
                print(f"{kind:<18} {p:>3} {m:>4} {result.makespan:>9g} {100 * result.bubble_fraction:>7.2f}%")


def big() -> None:
    print("\nbuild + validate + simulate, p=64, m=512 (CPU seconds)")
    for kind in BUILDERS:
        t0 = time.process_time()
        schedule = build(kind, 64, 512, **OPTIONS.get(kind, {}))
        t1 = time.process_time()
        simulate(schedule, COSTS)  # validates first
        t2 = time.process_time()
        actions = sum(len(a) for a in schedule.actions)
        print(f"{kind:<18} {actions:>8} actions  build {t1 - t0:.3f}s  "
              f"validate+simulate {t2 - t1:.3f}s  total {t2 - t0:.3f}s")


if __name__ == "__main__":
    table()
    big()

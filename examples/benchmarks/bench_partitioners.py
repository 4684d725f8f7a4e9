"""Partitioner quality and speed.

For torchvision resnet50 and a 24-layer Transformer encoder at 4 and 8 stages, prints
each method's predicted bottleneck relative to the lower bound
max(total / stages, largest node); then the solve time of the optimal methods on a
synthetic 5,000-node graph with residual and long skip connections.

    python examples/benchmarks/bench_partitioners.py [--estimate] [--bandwidth 1e10]
"""
from __future__ import annotations

import argparse
import random
import time

import networkx as nx
import torch
import torch.nn as nn
import torchvision

import partitioners

METHODS = ("uniform", "params", "time", "graph")


class TransformerLM(nn.Module):
    """Token embedding -> nn.TransformerEncoder -> vocabulary head."""

    def __init__(self, layers: int = 24, d: int = 256, vocab: int = 8000):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def synthetic_graph(n: int, seed: int = 0) -> nx.DiGraph:
    """A chain of n nodes, a residual skip every 4 nodes and one skip spanning the graph."""
    rng = random.Random(seed)
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(i, op="call_function", fwd_time=rng.uniform(1e-4, 1e-3),
                   bwd_time=rng.uniform(2e-4, 2e-3), param_bytes=rng.randint(0, 4 << 20),
                   act_bytes=rng.randint(1 << 16, 1 << 20))
    for i in range(1, n):
        g.add_edge(i - 1, i)
        if i % 4 == 0 and i >= 8:
            g.add_edge(i - 8, i)
    g.add_edge(0, n - 1)
    for u, v in g.edges:
        g.edges[u, v]["bytes"] = g.nodes[u]["act_bytes"]
    return g


def report(name: str, cg: partitioners.CostGraph, bandwidth: float) -> None:
    times = [cg.graph.nodes[n]["fwd_time"] + cg.graph.nodes[n]["bwd_time"] for n in cg.graph]
    print(f"\n{name}: {len(cg)} nodes, {sum(times) * 1e3:.1f} ms fwd+bwd per micro-batch")
    print(f"{'stages':>6} {'lower bound ms':>15} " + " ".join(f"{m:>9}" for m in METHODS)
          + f" {'graph solve s':>14}")
    for stages in (4, 8):
        lower = max(sum(times) / stages, max(times))
        ratios, solve = [], 0.0
        for method in METHODS:
            start = time.perf_counter()
            plan = partitioners.partition(cg, stages, method=method, bandwidth=bandwidth)
            if method == "graph":
                solve = time.perf_counter() - start
            ratios.append(plan.bottleneck / lower)
        print(f"{stages:>6} {lower * 1e3:>15.2f} " + " ".join(f"{r:>9.3f}" for r in ratios)
              + f" {solve:>14.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--estimate", action="store_true",
                        help="FLOP/byte estimates instead of profiling")
    parser.add_argument("--bandwidth", type=float, default=partitioners.DEFAULT_BANDWIDTH,
                        help="bytes/s between stages (default %(default).3g)")
    parser.add_argument("--repeats", type=int, default=3, help="timing repetitions per node")
    args = parser.parse_args()
    torch.manual_seed(0)
    profile = not args.estimate
    print(f"predicted bottleneck / lower bound (1.000 is optimal-or-better), bandwidth "
          f"{args.bandwidth:.3g} B/s, costs {'profiled' if profile else 'estimated'} on CPU")

    model = torchvision.models.resnet50()
    cg = partitioners.trace(model, torch.randn(4, 3, 128, 128), profile=profile,
                            repeats=args.repeats)
    report("resnet50 (4x3x128x128)", cg, args.bandwidth)

    model = TransformerLM()
    cg = partitioners.trace(model, torch.randint(0, 8000, (4, 64)), profile=profile,
                            repeats=args.repeats)
    report("transformer, 24 layers, d=256 (4x64 tokens)", cg, args.bandwidth)

    g = synthetic_graph(5000)
    print("\nsynthetic 5,000-node graph (residual skips + one skip spanning the graph), 8 stages")
    for method in ("time", "graph"):
        start = time.perf_counter()
        plan = partitioners.partition(g, 8, method=method, bandwidth=1e9)
        print(f"  {method:>5}: solved in {time.perf_counter() - start:.3f} s, "
              f"bottleneck {plan.bottleneck * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

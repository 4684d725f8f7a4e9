"""Flat vs hierarchical vs fp16 all-reduce of a model's gradients on two torchrun agents, measured and predicted.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29511 \
        examples/benchmarks/bench_hierarchical_allreduce.py [--mib 8] [--rounds 30]

and the same command with ``--node-rank 1`` in a second shell: two agents, two "nodes" of 2 gloo ranks each on
127.0.0.1 (node = rank // LOCAL_WORLD_SIZE, as torchrun places them).

The gradients of an MLP (4 x Linear(w, w), w chosen so they hold about ``--mib`` MiB of fp32) are averaged by
pipetrain's own `GradientReducer` (default buckets: 1 MiB first, 25 MiB after), four ways: flat ring,
hierarchical (reduce-scatter in the node, all-reduce across nodes, all-gather in the node), and each with fp16
compression. Per variant, per step:

* bytes sent per rank: every collective the reducer issues is counted (its tensor, its group) at the volume
  gloo's algorithm sends per rank: ring all-reduce 2(p-1)/p x n, all-to-all (p-1)/p x n, ring all-gather
  (p-1) x shard; "across/node" is the part that leaves a node (ring and all-gather send to the next member of
  the group, all-to-all to every member), per node. "socket" is what the process really wrote (``wchar`` of
  /proc/self/io: gloo sends with write/writev), the check on the count: it adds gloo's message headers.
* time: median over ``--rounds`` rounds (after 2 of warm-up) of the slowest rank's ``reduce_now()``, every rank
  starting together after a barrier; the variants take turns each round.
* predicted: the planner's reduction model (schedules.cluster.reductions.reduction_finish, no overlap) on the
  reducer's real buckets (the bytes they send) and this layout, with the links of a Cluster measured here first
  by ping-pong (both pairs at once, as in a ring step; the fastest of 30 trips of 4 B and of 1 MiB: latency and
  bandwidth), inside a node and across, both loopback. It prices the transfers only: not the reducer's copies and
  casts, nor a process waiting to be scheduled (4 ranks here may share fewer cores).

Every variant's averaged gradients are checked against a plain dist.all_reduce of the same tensors (see
`check`). Last, the model's verdict for real clusters' links (schedules.cluster PRESETS), for the same buckets on
this layout and on the preset's own size.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipetrain.allreduce.reducer import GradientReducer
from schedules.cluster import PRESETS, Cluster
from schedules.cluster.reductions import Group, Reduction, reduction_finish

LAYERS = 4
WARMUP = 2
TRIPS = 30  # ping-pongs per calibration size
SMALL, LARGE = 4, 1 << 20  # calibration message bytes: latency, then bandwidth
U32, U16 = 2.0 ** -24, 2.0 ** -11  # unit roundoff of float32 and float16
VARIANTS = {  # name: (GradientReducer algorithm, compress)
    "flat": ("flat", None),
    "hierarchical": ("hierarchical", None),
    "flat + fp16": ("flat", torch.float16),
    "hierarchical + fp16": ("hierarchical", torch.float16),
}


@dataclass(frozen=True)
class Layout:
    """Where this process sits: torchrun's nodes (agents) and ranks per node."""

    rank: int
    world: int
    per_node: int

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


def layout_from_torchrun() -> Layout:
    """The layout torchrun launched; refuses one without two levels to compare."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise SystemExit("launch with torchrun (see this script's docstring): two agents, "
                         "--nnodes 2 --nproc-per-node 2")
    layout = Layout(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"]))
    if layout.nodes % 2 or layout.per_node % 2:
        raise SystemExit(f"{layout.nodes} nodes x {layout.per_node} ranks: the link probe pairs nodes and ranks; "
                         "launch an even number of agents (--nnodes 2) of an even number of ranks (--nproc-per-node 2)")
    return layout


def gradients(mib: float, rank: int) -> tuple[torch.nn.Module, int]:
    """An MLP of LAYERS x Linear(w, w) holding about `mib` MiB of fp32 gradients, after one backward on this
    rank's own batch; and w."""
    width = max(2, round(math.sqrt(mib * 2 ** 20 / (4 * LAYERS))))
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(1 + rank))
    model(x).square().mean().backward()
    return model, width


# --- counting what the reducer sends ------------------------------------------------------------------
class Sent:
    """Bytes this rank sends in the collectives issued inside `counting()`: in all, and to other nodes."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.total = 0.0
        self.across = 0.0

    def add(self, ranks: list[int], volume: float, to: list[int]) -> None:
        """`volume` bytes sent, spread evenly over the members `to` (group ranks)."""
        self.total += volume
        me = self.layout.node_of(self.layout.rank)
        self.across += volume * sum(self.layout.node_of(ranks[k]) != me for k in to) / len(to)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count every all_reduce / all_to_all_single / all_gather_single torch.distributed runs meanwhile."""
        originals = {name: getattr(dist, name) for name in ("all_reduce", "all_to_all_single", "all_gather_single")}

        def members(group: dist.ProcessGroup | None) -> tuple[list[int], int]:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            return ranks, ranks.index(self.layout.rank)

        def all_reduce(tensor, *args, group=None, **kw):
            ranks, me = members(group)
            p = len(ranks)
            if p > 1:  # ring: reduce-scatter then all-gather, each p-1 chunks of n/p to the next member
                self.add(ranks, 2 * (p - 1) / p * tensor.nbytes, [(me + 1) % p])
            return originals["all_reduce"](tensor, *args, group=group, **kw)

        def all_to_all_single(output, input, *args, group=None, **kw):
            ranks, me = members(group)
            p = len(ranks)
            self.add(ranks, (p - 1) / p * input.nbytes, [k for k in range(p) if k != me])
            return originals["all_to_all_single"](output, input, *args, group=group, **kw)

        def all_gather_single(output, input, *args, group=None, **kw):
            ranks, me = members(group)
            p = len(ranks)
            self.add(ranks, (p - 1) * input.nbytes, [(me + 1) % p])  # ring: p-1 shards to the next member
            return originals["all_gather_single"](output, input, *args, group=group, **kw)

        for name, counted in (("all_reduce", all_reduce), ("all_to_all_single", all_to_all_single),
                              ("all_gather_single", all_gather_single)):
            setattr(dist, name, counted)
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)


def written_bytes() -> int:
    """Bytes this process has passed to write-like system calls (sockets included)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


# --- calibrating the links ----------------------------------------------------------------------------
def one_way(partner: int, nbytes: int, layout: Layout) -> float:
    """One-way seconds of an nbytes message to `partner` at best: the fastest of TRIPS ping-pongs, halved (every
    rank has a partner, so all pairs run at once, as in a ring step); the mean over the pairs, on every rank.

    The fastest, not the median: with more ranks than cores a trip's median is mostly waiting for a process to
    be scheduled, which is not the link (the measured/predicted column shows what such waits cost)."""
    buffer = torch.zeros(nbytes // 4)
    lead = layout.rank < partner
    trips = []
    dist.barrier()
    for _ in range(TRIPS):
        t0 = time.perf_counter()
        for send in (lead, not lead):
            (dist.send if send else dist.recv)(buffer, partner)
        trips.append(time.perf_counter() - t0)
    mine = torch.tensor([min(trips) / 2 if lead else 0.0], dtype=torch.float64)
    dist.all_reduce(mine)
    return mine.item() / (layout.world / 2)


def link(partner: int, layout: Layout) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) to `partner` by the alpha-beta model through two message sizes."""
    small, large = one_way(partner, SMALL, layout), one_way(partner, LARGE, layout)
    if large <= small:
        raise SystemExit(f"link probe: a {LARGE} B message took {large * 1e6:.1f} us, no longer than a {SMALL} B one "
                         f"({small * 1e6:.1f} us); the machine is too busy to measure, run again")
    bandwidth = (LARGE - SMALL) / (large - small)
    return bandwidth, max(0.0, small - SMALL / bandwidth)


def loopback_cluster(layout: Layout) -> Cluster:
    """A Cluster of this layout whose intra- and inter-node links are measured on this loopback."""
    intra = link(layout.rank ^ 1, layout)  # the neighbouring rank of the same node (per_node is even)
    other_node = layout.node_of(layout.rank) ^ 1  # nodes paired 0-1, 2-3, ...: the same local index there
    inter = link(other_node * layout.per_node + layout.rank % layout.per_node, layout)
    return Cluster(nodes=layout.nodes, devices_per_node=layout.per_node, intra_bandwidth=intra[0],
                   intra_latency=intra[1], inter_bandwidth=inter[0], inter_latency=inter[1],
                   name="loopback (measured)", backend="gloo")


# --- the reductions -----------------------------------------------------------------------------------
@dataclass
class Result:
    """One variant's numbers, as every rank holds them once `measure` has gathered them."""

    sent: float          # bytes per rank per step, counted
    across: float        # bytes leaving each node per step, counted
    socket: float        # bytes written per rank per step, measured
    seconds: float       # median over rounds of the slowest rank
    error_ratio: float   # largest |reduced - reference| / bound over all gradient elements
    comm_bytes: list[int]  # what each bucket sends (its dtype), in launch order


def check(model: torch.nn.Module, grads: list[torch.Tensor], compress: torch.dtype | None) -> float:
    """Largest error / bound of the averaged gradients against dist.all_reduce(sum) / world of `grads`.

    The reducer scales each gradient by 1/world (exact: a power of two) before summing, the reference after.
    Both sum 4 float32 terms in some order: each sum is within 3 u32 S of the exact one (S the sum of the
    terms' magnitudes), so they differ by at most 6 u32 S. fp16 rounds each term once and each of 3 partial
    sums once (u16 relative each, 2^-25 absolute below fp16's normal range): 4 u16 S + 2^-23, plus the
    reference's 3 u32 S. Errors and bounds are taken in float64, so their own rounding does not count.
    """
    world = dist.get_world_size()
    worst = 0.0
    for p, g in zip(model.parameters(), grads):
        reference, magnitude = g.clone(), g.abs()
        dist.all_reduce(reference)
        dist.all_reduce(magnitude)
        scale = magnitude.double() / world
        bound = 6 * U32 * scale if compress is None else (4 * U16 + 3 * U32) * scale + 2.0 ** -23
        error = (p.grad.double() - reference.double() / world).abs()
        worst = max(worst, (error / bound.clamp_min(torch.finfo(torch.float64).tiny)).max().item())
    return worst


def reduce_once(model: torch.nn.Module, grads: list[torch.Tensor], reducer: GradientReducer,
                sent: Sent | None) -> tuple[float, int]:
    """Seconds and socket bytes of one reduce_now() of `grads`, all ranks starting together; counted in
    `sent` when given."""
    for p, g in zip(model.parameters(), grads):  # the previous reduce_now replaced them with the average
        p.grad.copy_(g)
    dist.barrier()
    before, t0 = written_bytes(), time.perf_counter()
    with sent.counting() if sent is not None else contextlib.nullcontext():
        reducer.reduce_now()
    return time.perf_counter() - t0, written_bytes() - before


def measure(model: torch.nn.Module, layout: Layout, rounds: int) -> dict[str, Result]:
    """Every variant's bytes, time and correctness on this model's gradients (see the module docstring)."""
    grads = [p.grad.clone() for p in model.parameters()]
    reducers = {name: GradientReducer(model.parameters(), None, algorithm=algorithm, compress=compress)
                for name, (algorithm, compress) in VARIANTS.items()}
    sent = {name: Sent(layout) for name in VARIANTS}
    written = dict.fromkeys(VARIANTS, 0)
    seconds = torch.zeros(len(VARIANTS), rounds, dtype=torch.float64)
    errors = {}
    for r in range(-WARMUP, rounds):
        for v, (name, reducer) in enumerate(reducers.items()):
            elapsed, wrote = reduce_once(model, grads, reducer, sent[name] if r == 0 else None)
            if r == -WARMUP:
                errors[name] = check(model, grads, VARIANTS[name][1])
            if r >= 0:
                seconds[v, r], written[name] = elapsed, written[name] + wrote
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank does
    results = {}
    for v, (name, reducer) in enumerate(reducers.items()):
        totals = torch.tensor([sent[name].total, sent[name].across, written[name] / rounds], dtype=torch.float64)
        worst = torch.tensor([errors[name]], dtype=torch.float64)
        dist.all_reduce(totals)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if worst.item() > 1:
            raise SystemExit(f"{name}: the averaged gradients differ from dist.all_reduce's by {worst.item():.2f} x "
                             "the rounding bound (see check()): the reduction is wrong; report it with this command")
        results[name] = Result(totals[0].item() / layout.world, totals[1].item() / layout.nodes,
                               totals[2].item() / layout.world, statistics.median(seconds[v].tolist()),
                               worst.item(), [b.comm.nbytes for b in reducer.buckets])
    return results


def predict(comm_bytes: list[int], group: Group, cluster: Cluster, hierarchical: bool) -> float:
    """Seconds the planner's model gives these buckets, reduced one after another after the backward."""
    # Each bucket is one message (bucket_bytes=None: no further fusion), all ready at once (no overlap).
    return reduction_finish(comm_bytes, [0.0] * len(comm_bytes), group, cluster,
                            Reduction(bucket_bytes=None, hierarchical=hierarchical))


# --- report -------------------------------------------------------------------------------------------
def report(results: dict[str, Result], cluster: Cluster, layout: Layout, width: int, rounds: int) -> None:
    """Rank 0's table: what was measured here beside the model's prediction, then the model's real clusters."""
    group = Group(layout.nodes, layout.per_node)
    fp32 = results["flat"].comm_bytes
    print(f"{layout.nodes} nodes (torchrun agents) x {layout.per_node} ranks, gloo on 127.0.0.1, "
          f"{torch.get_num_threads()} thread per rank, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores")
    print(f"gradients: {LAYERS} x Linear({width}, {width}), {sum(fp32) / 2 ** 20:.2f} MiB fp32 in {len(fp32)} "
          f"bucket(s) of {', '.join(str(b) for b in fp32)} B; median of {rounds} rounds after {WARMUP} of warm-up")
    print(f"loopback links measured (fastest ping-pong): inside a node {cluster.intra_latency * 1e6:.1f} us + "
          f"{cluster.intra_bandwidth / 1e9:.2f} GB/s, across nodes {cluster.inter_latency * 1e6:.1f} us + "
          f"{cluster.inter_bandwidth / 1e9:.2f} GB/s")
    print(f"\n{'variant':<20} {'sent B/rank':>12} {'across B/node':>13} {'socket B/rank':>13} {'measured ms':>11} "
          f"{'predicted ms':>12} {'measured/predicted':>18} {'error/bound':>11}")
    for name, r in results.items():
        predicted = predict(r.comm_bytes, group, cluster, VARIANTS[name][0] == "hierarchical")
        print(f"{name:<20} {r.sent:>12.0f} {r.across:>13.0f} {r.socket:>13.0f} {r.seconds * 1e3:>11.3f} "
              f"{predicted * 1e3:>12.3f} {r.seconds / predicted:>18.2f} {r.error_ratio:>11.3f}")
    for suffix in ("", " + fp16"):
        flat, hier = results["flat" + suffix], results["hierarchical" + suffix]
        model_ratio = (predict(hier.comm_bytes, group, cluster, True) /
                       predict(flat.comm_bytes, group, cluster, False))
        verdict = "pays" if hier.seconds < flat.seconds else "does not pay"
        print(f"hierarchical{suffix} / flat{suffix}: measured {hier.seconds / flat.seconds:.2f}, predicted "
              f"{model_ratio:.2f}: on this loopback hierarchy {verdict}")
    report_presets(fp32, group)


def report_presets(fp32: list[int], group: Group) -> None:
    """The model's flat and hierarchical times of these buckets on each GPU preset's links, on this layout
    and on the preset's own nodes x devices."""
    print(f"\nthe model on real clusters' links, the same fp32 buckets ({sum(fp32)} B), flat vs hierarchical:")
    print(f"{'cluster':<13} {'inside a node':>20} {'across nodes':>20} {'layout':>8} {'flat ms':>9} "
          f"{'hier ms':>9} {'hier/flat':>9}  hierarchy")
    for preset in (c for c in PRESETS.values() if c.backend == "nccl"):
        for shape in (group, Group(preset.nodes, preset.devices_per_node)):
            flat_s, hier_s = predict(fp32, shape, preset, False), predict(fp32, shape, preset, True)
            print(f"{preset.name:<13} {_link(preset.intra_bandwidth, preset.intra_latency):>20} "
                  f"{_link(preset.inter_bandwidth, preset.inter_latency):>20} {f'{shape.nodes}x{shape.per_node}':>8} "
                  f"{flat_s * 1e3:>9.3f} {hier_s * 1e3:>9.3f} {hier_s / flat_s:>9.2f}  "
                  f"{'pays' if hier_s < flat_s else 'does not pay'}")


def _link(bandwidth: float, latency: float) -> str:
    return f"{bandwidth / 1e9:g} GB/s {latency * 1e6:g} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8.0, help="fp32 gradient MiB to reduce (about)")
    parser.add_argument("--rounds", type=int, default=30, help="timed rounds of every variant")
    args = parser.parse_args()
    layout = layout_from_torchrun()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group("gloo")
    try:
        model, width = gradients(args.mib, layout.rank)
        cluster = loopback_cluster(layout)
        results = measure(model, layout, args.rounds)
        if layout.rank == 0:
            report(results, cluster, layout, width, args.rounds)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""search_layouts(): the fastest pipeline x data-parallel layout of a model on a cluster.

For every stage count S, replica count R (S x R <= devices), micro-batch count m and
schedule, the step is predicted by schedules.simulate_cluster_step (pipeline schedule plus
gradient all-reduce across replicas). Cuts: every split of the cuttable positions when
there are at most `exhaustive_limit` of them for that S, otherwise the "graph"
partitioner's optimal split (slowest stage minimised). Compute and activation bytes of a
micro-batch scale linearly with its size (the graph was profiled at `profiled_batch`
samples). A layout fits when every stage's memory is within cluster.memory: its parameter
bytes x param_memory_factor (one copy for the weights, one for the gradients, the rest for the
optimizer state: 4 for Adam's two moments; with ZeRO (`zero` >= 1, replicas > 1) each replica keeps
1/replicas of that state) plus what its in-flight micro-batches keep for the backward
(StageMemory). Only each shape's best cuts are kept; `zeros` adds the ZeRO level as one more choice
(equal step times rank zero=0 first: the model charges sharding nothing, so it is chosen where it
makes a layout fit).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import networkx as nx

from schedules.cluster import Cluster
from schedules.cluster.reductions import Reduction
from schedules.cluster.step import CLUSTER_SCHEDULES, ClusterStepResult, StageWork, simulate_cluster_step

from ..chain import Chain
from ..errors import PartitionError
from ..graph import CostGraph
from ..partition import partition

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_REDUCTION = Reduction(bucket_bytes=25e6, hierarchical=True, overlap=True)


@dataclass(frozen=True)
class StageMemory:
    """Predicted bytes one device of a stage holds at its peak, by what holds them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float  # what autograd keeps for the backward, of all in-flight micro-batches
    in_flight: int      # micro-batches the schedule has in flight at the stage's peak

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        """'weights 27 GB, gradients 27 GB, optimizer 54 GB, activations 2.1 GB (4 micro-batches in flight)'."""
        return (f"weights {format_bytes(self.weights)}, gradients {format_bytes(self.gradients)}, "
                f"optimizer {format_bytes(self.optimizer)}, activations {format_bytes(self.activations)} "
                f"({_count(self.in_flight, 'micro-batch')} in flight)")


@dataclass
class Layout:
    """One candidate: cuts of the topological order, replicas, micro-batches, schedule."""

    cuts: list[int]
    replicas: int
    micro_batches: int
    schedule: str
    batch_size: int
    result: ClusterStepResult
    fits: bool
    stage_memory: list[StageMemory]  # what result.memory adds up, per stage
    zero: int = 0                    # ZeRO level: 1 and 2 keep 1/replicas of the optimizer state per replica

    @property
    def stages(self) -> int:
        return len(self.cuts) - 1

    @property
    def step_time(self) -> float:
        return self.result.step_time

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.result.throughput(self.batch_size)

    def key(self) -> tuple:
        """Ranking key: fitting layouts first, then faster, then fewer devices and stages."""
        return (not self.fits, self.step_time, self.zero, self.result.devices, self.stages, self.micro_batches,
                self.schedule, self.cuts)


class _Model:
    """Per-position costs of a graph laid out for cutting (from partitioners.chain)."""

    def __init__(self, graph: CostGraph | nx.DiGraph):
        self.chain = Chain.from_graph(graph)
        g = graph.graph if isinstance(graph, CostGraph) else graph
        nodes = [g.nodes[name] for name in self.chain.names]
        self.fwd = [float(a.get("fwd_time", 0.0)) for a in nodes]
        self.bwd = [float(a.get("bwd_time", 0.0)) for a in nodes]
        self.tensors = _grad_tensors(graph, self.chain.names, nodes)

    def params(self, i: int, j: int) -> float:
        """Parameter bytes of positions [i, j) (a shared parameter at its first user)."""
        return float(self.chain.params[i:j].sum())

    def work(self, i: int, j: int, scale: float, param_memory_factor: float) -> StageWork:
        """StageWork of positions [i, j) for micro-batches `scale` x the profiled size."""
        seg = self.chain.segment(i, j)
        grads, ready = [], []
        total_bwd = sum(self.bwd[i:j])
        done = 0.0
        for v in range(j - 1, i - 1, -1):  # the backward visits the stage back to front
            done += self.bwd[v]
            for size in self.tensors[v]:
                grads.append(size)
                ready.append(done / total_bwd if total_bwd > 0 else 1.0)
        return StageWork(forward=sum(self.fwd[i:j]) * scale, backward=total_bwd * scale,
                         grad_bytes=tuple(grads), ready_fraction=tuple(ready),
                         send_bytes=seg["sent"] * scale, memory=seg["params"] * param_memory_factor,
                         # what autograd keeps of one micro-batch (memory_model.py's model), held per micro-batch in flight
                         activation_memory=seg["activations"] * scale,
                         # the runtime's first stage has no input gradient to split off (zb-h1)
                         weight_fraction=0.0 if i == 0 else 0.5)


def _grad_tensors(graph: CostGraph | nx.DiGraph, names: list[str], nodes: list[dict]) -> list[list[float]]:
    """Gradient tensor sizes owned by each position (a shared parameter at its first user).

    A CostGraph knows each parameter's exact size from its model; a plain graph gives
    param_bytes per node, taken as one tensor."""
    sizes: dict[str, float] = {}
    if isinstance(graph, CostGraph):
        sizes = {n: float(p.numel() * p.element_size()) for n, p in graph.model.named_parameters()}
    seen: set[str] = set()
    out = []
    for attrs in nodes:
        params = [n for n in attrs.get("params", []) if n in sizes and n not in seen]
        seen.update(params)
        if params:
            out.append([sizes[n] for n in params])
        elif attrs.get("param_bytes", 0) > 0:
            out.append([float(attrs["param_bytes"])])
        else:
            out.append([])
    return out


def evaluate_layout(model: _Model | CostGraph | nx.DiGraph, cluster: Cluster, cuts: Sequence[int], *,
                    replicas: int, micro_batches: int, schedule: str, batch_size: int,
                    profiled_batch: int, reduction: Reduction = DEFAULT_REDUCTION,
                    param_memory_factor: float = 4.0, zero: int = 0) -> Layout:
    """Predict one layout: global batch_size split over replicas x micro_batches.
    param_memory_factor: bytes a stage keeps per parameter byte (weights 1 + gradients 1 + optimizer
    state: 4 with Adam's two moments, 3 with SGD's momentum). zero >= 1: each replica keeps
    1/replicas of the optimizer state (ZeRO-2's gradient shard does not lower the peak: gradients
    accumulate whole over the micro-batches); the bytes on the wire, and so the time, are zero=0's."""
    if not param_memory_factor >= 2:
        raise ValueError(f"param_memory_factor {param_memory_factor!r} counts less than the weights and their "
                         "gradients; fix: 2 + the optimizer's state copies (4 for Adam)")
    m = model if isinstance(model, _Model) else _Model(model)
    per_micro = batch_size / (replicas * micro_batches)
    if per_micro != int(per_micro) or per_micro < 1:
        raise ValueError(f"batch_size {batch_size} does not split into {replicas} replicas x "
                         f"{micro_batches} micro-batches; fix: pick counts that divide it")
    scale = per_micro / profiled_batch
    state_factor = (param_memory_factor - 2) / (replicas if zero else 1)
    work = [m.work(cuts[k], cuts[k + 1], scale, 2 + state_factor) for k in range(len(cuts) - 1)]
    result = simulate_cluster_step(work, cluster, replicas=replicas, micro_batches=micro_batches,
                             schedule=schedule, reduction=reduction)
    fits = cluster.memory is None or max(result.memory) <= cluster.memory
    memory = []
    for k, (w, in_flight) in enumerate(zip(work, result.sim.peak_in_flight)):
        params = m.params(cuts[k], cuts[k + 1])  # the terms of simulate_cluster_step's memory, apart
        memory.append(StageMemory(weights=params, gradients=params, optimizer=params * state_factor,
                                  activations=in_flight * w.activation_memory, in_flight=in_flight))
    return Layout(list(cuts), replicas, micro_batches, schedule, batch_size, result, fits, memory, zero)


def search_layouts(graph: CostGraph | nx.DiGraph, cluster: Cluster, *, batch_size: int,
                   profiled_batch: int, schedules: Sequence[str] = CLUSTER_SCHEDULES,
                   micro_batches: Sequence[int] = MICRO_BATCHES, max_stages: int | None = None,
                   reduction: Reduction = DEFAULT_REDUCTION, param_memory_factor: float = 4.0,
                   exhaustive_limit: int = 64, zeros: Sequence[int] = (0,)) -> list[Layout]:
    """The best layout of every shape (stages, replicas, micro-batches, schedule), best first
    (see the module docstring for the search space)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not profiled_batch > 0:
        raise ValueError(f"profiled_batch must be > 0 samples, got {profiled_batch!r}")
    if not zeros or any(z not in (0, 1, 2) for z in zeros):
        raise ValueError(f"zeros must list ZeRO levels among 0, 1, 2, got {list(zeros)}")
    bad = [k for k in schedules if k not in CLUSTER_SCHEDULES]
    if bad:
        raise ValueError(f"schedules {bad} cannot be planned; choose from {CLUSTER_SCHEDULES}")
    model = _Model(graph)
    positions = [c for c in range(1, model.chain.n) if model.chain.cuttable[c]]
    top = min(cluster.devices, len(positions) + 1, max_stages or cluster.devices)
    best: dict[tuple, Layout] = {}  # per shape (stages, replicas, micro-batches, schedule)
    for stages in range(1, top + 1):
        for cuts in _cut_candidates(graph, model, positions, stages, cluster, exhaustive_limit):
            for replicas in _replica_counts(cluster.devices // stages):
                if batch_size % replicas:
                    continue
                for m in micro_batches:
                    if (batch_size // replicas) % m:
                        continue
                    for kind, zero in itertools.product(schedules, zeros if replicas > 1 else (0,)):
                        # every schedule even with one stage: they differ in memory
                        lay = evaluate_layout(
                            model, cluster, cuts, replicas=replicas, micro_batches=m, schedule=kind,
                            batch_size=batch_size, profiled_batch=profiled_batch,
                            reduction=reduction, param_memory_factor=param_memory_factor, zero=zero)
                        shape = (stages, replicas, m, kind, zero)
                        if shape not in best or lay.key() < best[shape].key():
                            best[shape] = lay
    if not best:
        raise ValueError(f"no layout splits batch_size={batch_size} over the allowed replicas and "
                         f"micro-batches {list(micro_batches)}; fix: use a batch size with small factors")
    return sorted(best.values(), key=Layout.key)


def plan_layout(graph: CostGraph | nx.DiGraph, cluster: Cluster, **options: object) -> Layout:
    """The fastest layout that fits memory (options as search_layouts)."""
    layouts = search_layouts(graph, cluster, **options)
    if not layouts[0].fits:
        raise PartitionError(f"{describe_no_fit(layouts, cluster)}; fix: more devices, a smaller batch or "
                             "lower-precision weights")
    return layouts[0]


def describe_no_fit(layouts: Sequence[Layout], cluster: Cluster) -> str:
    """Why none of `layouts` fits the cluster's device memory: the layout whose largest stage needs
    least, that stage's predicted peak, how far over it is and what holds it."""
    closest = min(layouts, key=lambda lay: max(lay.result.memory))  # ties: the faster, as ranked
    k = max(range(closest.stages), key=closest.result.memory.__getitem__)
    peak = closest.result.memory[k]
    return (f"no layout fits cluster {cluster.name!r} ({format_bytes(cluster.memory)} per device): the closest, "
            f"{_count(closest.stages, 'stage')} x {_count(closest.replicas, 'replica')} "
            f"({_count(closest.micro_batches, 'micro-batch')}, {closest.schedule}), puts a predicted peak of "
            f"{format_bytes(peak)} = {peak:.4g} bytes on stage {k}, "
            f"{format_bytes(peak - cluster.memory)} over ({closest.stage_memory[k].describe()})")


def _replica_counts(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself (use every device)."""
    counts = {most}
    r = 1
    while r <= most:
        counts.add(r)
        r *= 2
    return sorted(counts)


def _cut_candidates(graph: CostGraph | nx.DiGraph, model: _Model, positions: list[int], stages: int,
                    cluster: Cluster, limit: int) -> list[list[int]]:
    n = model.chain.n
    if math.comb(len(positions), stages - 1) <= limit:
        return [[0, *inner, n] for inner in itertools.combinations(positions, stages - 1)]
    try:
        plan = partition(graph, stages, method="graph", bandwidth=cluster.intra_bandwidth)
    except PartitionError:
        return []
    return [list(plan.cuts)]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('h') else 's'}"


def format_bytes(n: float) -> str:
    """Bytes in decimal units with 4 significant digits ('26.95 GB', '13.47 kB'), as devices are sold."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


def format_stage_memory(layout: Layout, cluster: Cluster) -> str:
    """Table of each stage's predicted peak memory per device (weights, gradients, optimizer state,
    activations of the schedule's in-flight micro-batches) against the cluster's device memory."""
    lines = [f"{'stage':>5} {'graph nodes':>11} {'weights':>10} {'gradients':>10} {'optimizer':>10} "
             f"{'activations':>11} {'in flight':>9} {'total':>10} {'of device':>9}"]
    for k, mem in enumerate(layout.stage_memory):
        share = "-" if cluster.memory is None else f"{100 * mem.total / cluster.memory:.1f}%"
        nodes = f"{layout.cuts[k]}-{layout.cuts[k + 1] - 1}"
        lines.append(f"{k:>5} {nodes:>11} {format_bytes(mem.weights):>10} {format_bytes(mem.gradients):>10} "
                     f"{format_bytes(mem.optimizer):>10} {format_bytes(mem.activations):>11} {mem.in_flight:>9} "
                     f"{format_bytes(mem.total):>10} {share:>9}")
    return "\n".join(lines)


def format_ranking(layouts: Sequence[Layout], top: int = 10) -> str:
    """Table of the best `top` layouts: shape, predicted step time, throughput, efficiency, memory."""
    lines = [f"{'rank':>4} {'stages':>6} {'replicas':>8} {'devices':>7} {'micro':>5} {'schedule':>8} "
             f"{'step ms':>10} {'samples/s':>10} {'efficiency':>10} {'reduce ms':>9} {'mem GB':>7} fits"]
    for i, lay in enumerate(layouts[:top], 1):
        r = lay.result
        schedule = lay.schedule + (f"/zero{lay.zero}" if lay.zero else "")  # one cell: the columns stay as they were
        lines.append(f"{i:>4} {lay.stages:>6} {lay.replicas:>8} {r.devices:>7} {lay.micro_batches:>5} "
                     f"{schedule:>8} {1e3 * lay.step_time:>10.3f} {lay.throughput:>10.1f} "
                     f"{100 * r.scaling_efficiency:>9.1f}% {1e3 * max(r.reduction_exposed):>9.3f} "
                     f"{max(r.memory) / 1e9:>7.2f} {'yes' if lay.fits else 'NO'}")
    return "\n".join(lines)

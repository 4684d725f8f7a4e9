"""search_layouts(): the fastest pipeline x data-parallel layout of a model on a cluster.

For every stage count S, replica count R (S x R <= devices), micro-batch count m and
schedule, the step is predicted by schedules.simulate_cluster_step (pipeline schedule plus
gradient all-reduce across replicas). Cuts: every split of the cuttable positions when
there are at most `exhaustive_limit` of them for that S, otherwise the "graph"
partitioner's optimal split (slowest stage minimised). Compute and activation bytes of a
micro-batch scale linearly with its size (the graph was profiled at `profiled_batch`
samples). A layout fits when every stage's predicted peak is within cluster.memory
(stage_state.py: fp32 weights, gradients and the optimizer's state copies as pipetrain keeps them,
split by the ZeRO level, plus the activations the schedule's action lists hold at each moment, whole
or, when recomputed, as boundary inputs). `zeros` and `recomputes` are choices per shape: each shape
takes the fastest (recomputation costs a forward per recomputed micro-batch) and then least sharded
option that fits; ZeRO is charged no time (the bytes on the wire are zero=0's).

`tensor_parallel` adds T, the ranks each stage's matrices are split over (tensor_parallel.py says what that
changes in a stage's price): a layout takes stages x replicas x T devices, its T ranks of a stage on one
node, so the pipeline and the gradient all-reduce are simulated on "lanes" of T devices (devices_per_node / T
lanes per node), each reducing its 1/T of the split gradients. "auto" searches every T dividing the devices
per node with the same cut candidates (the cuts do not depend on T).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import networkx as nx
import numpy as np

from schedules.cluster import Cluster
from schedules.cluster.reductions import Reduction
from schedules.cluster.step import CLUSTER_SCHEDULES, ClusterStepResult, StageWork, simulate_cluster_step
from schedules.gc_pause import gc_paused

from ..chain import Chain
from ..errors import PartitionError
from ..graph import CostGraph
from ..algorithms import SegmentCosts, optimal_cuts
from .stage_state import (OPTIMIZER_STATE, RECOMPUTE, StageMemory, format_bytes, recomputed_share,
                          schedule_moments, stage_peak)
from .tensor_parallel import activation_share, allgather_seconds, allreduce_seconds, degrees, is_split, rowwise_bytes

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# beyond 32, at most this many micro-batches per stage: more only shrink the micro-batch further. A stage of T
# tensor-parallel ranks counts as T stages: its few stages need the small micro-batches (for memory) that a
# pipeline on as many devices gets
MICRO_BATCHES_PER_STAGE = 4
# on graphs with more cut positions than CHEAP_CUTS_ABOVE, deep pipelines' cuts are searched only where at most
# CROSSING_SLACK times the bytes of the cheapest cuts enough for them cross (between a transformer's blocks)
CROSSING_SLACK = 2.0
CHEAP_CUTS_ABOVE = 1024
CHEAP_CUTS_AT_LEAST = 32  # the threshold's rank even for shallow searches: past the few cuts before the first layer
# ZeRO levels the search may choose: those wrap() runs. stage_state.stage_peak prices zero=3 already; it joins
# here when the runtime has it.
SEARCHED_ZERO = (0, 1, 2, 3)
DEFAULT_REDUCTION = Reduction(bucket_bytes=25e6, hierarchical=True, overlap=True)


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
    zero: int = 0                    # ZeRO level (stage_state.py)
    recompute: str = "none"          # the runtime's recomputation setting, for every stage
    needs: str = ""                  # why cheaper options were not taken: 'zero=0 recompute=none: 35.2 GB'
    tensor_parallel: int = 1         # T: ranks each stage's matrices are split over (result: lanes of T devices)
    sequence_parallel: bool = False  # with T > 1: the activations between the split blocks cut along the sequence

    @property
    def stages(self) -> int:
        return len(self.cuts) - 1

    @property
    def devices(self) -> int:
        """Devices the layout takes: stages x replicas x T."""
        return self.result.devices * self.tensor_parallel

    @property
    def step_time(self) -> float:
        return self.result.step_time

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.result.throughput(self.batch_size)

    def key(self) -> tuple:
        """Ranking key: fitting layouts first, then faster, then fewer devices and stages."""
        return (not self.fits, self.step_time, self.zero, RECOMPUTE.index(self.recompute), self.devices,
                self.tensor_parallel, self.stages, self.micro_batches, self.schedule, self.cuts)

    def label(self) -> str:
        """'8x8 1f1b m=32 zero=1 recompute=always': stages x replicas (then 'T=4' with tensor parallelism),
        schedule, micro-batches, options."""
        tp = f" T={self.tensor_parallel}{' SP' if self.sequence_parallel else ''}" if self.tensor_parallel > 1 else ""
        return (f"{self.stages}x{self.replicas}{tp} {self.schedule} m={self.micro_batches} zero={self.zero} "
                f"recompute={self.recompute}")


class _Model:
    """Per-position costs of a graph laid out for cutting (from partitioners.chain)."""

    def __init__(self, graph: CostGraph | nx.DiGraph):
        self.chain = Chain.from_graph(graph)
        g = graph.graph if isinstance(graph, CostGraph) else graph
        nodes = [g.nodes[name] for name in self.chain.names]
        self.fwd = [float(a.get("fwd_time", 0.0)) for a in nodes]
        self.bwd = [float(a.get("bwd_time", 0.0)) for a in nodes]
        self.tensors = _grad_tensors(graph, self.chain.names, nodes)
        # per position: parameter bytes split over tensor-parallel ranks, bytes all-reduced after it
        self.split = np.array([sum(size for size, split in sizes if split) for sizes in self.tensors])
        self.rowwise = rowwise_bytes(graph, self.chain.names, self.split)
        self.splittable = bool(self.split.any())
        self._segments: dict[tuple[int, int], dict[str, float]] = {}
        self._works: dict[tuple[int, int], tuple] = {}
        self._cheap: tuple[int, Chain] | None = None
        self._rows: tuple[Chain, SegmentCosts] | None = None

    def params(self, i: int, j: int) -> float:
        """Parameter bytes of positions [i, j) (a shared parameter at its first user)."""
        return float(self.chain.params[i:j].sum())

    def cheap_chain(self, cuts: int) -> Chain:
        """The chain with cuts only where at most CROSSING_SLACK x the bytes of the `cuts`-th cheapest cut
        cross (a transformer's boundaries between blocks): the cut search of deep pipelines runs on these."""
        c = self.chain
        if self._cheap is None or self._cheap[0] != cuts:
            delta = np.zeros(c.n + 2)
            for v in range(c.n):  # value v crosses every cut in (v, last user]
                if c.last[v] > v:
                    delta[v + 1] += c.out_bytes[v]
                    delta[c.last[v] + 1] -= c.out_bytes[v]
            crossing = np.cumsum(delta)[: c.n + 1]
            inner = c.cuttable.copy()
            inner[0] = inner[c.n] = False
            ranked = np.sort(crossing[inner])
            enough = ranked[min(max(cuts, CHEAP_CUTS_AT_LEAST), len(ranked)) - 1] if len(ranked) else 0.0
            keep = c.cuttable & (crossing <= CROSSING_SLACK * enough)
            keep[0] = keep[c.n] = True
            self._cheap = (cuts, dataclasses.replace(c, cuttable=keep))
        return self._cheap[1]

    def rows(self, chain: Chain) -> SegmentCosts:
        """SegmentCosts of `chain` (the model's or its cheap_chain), made once for the cut search of every depth."""
        if self._rows is None or self._rows[0] is not chain:
            self._rows = (chain, SegmentCosts(chain))
        return self._rows[1]

    def split_params(self, i: int, j: int) -> float:
        """Parameter bytes of positions [i, j) that tensor parallelism splits (tensor_parallel.is_split)."""
        return float(self.split[i:j].sum())

    def segment(self, i: int, j: int) -> dict[str, float]:
        """chain.segment of positions [i, j), computed once per segment."""
        if (i, j) not in self._segments:
            self._segments[i, j] = self.chain.segment(i, j)
        return self._segments[i, j]

    def work(self, i: int, j: int, scale: float, recomputed: float = 0.0, tensor_parallel: int = 1,
             cluster: Cluster | None = None) -> StageWork:
        """StageWork of positions [i, j) for micro-batches `scale` x the profiled size on one of T ranks;
        `recomputed`: the share of micro-batches whose forward runs again before their backward (with its
        all-reduces; its input is kept, not received again). T > 1 needs the cluster, whose node links carry
        the all-reduces and the all-gathers of what each rank receives 1/T of (tensor_parallel.py)."""
        forward, backward, grads, ready, sent, rowwise = self._work(i, j, tensor_parallel)
        t = tensor_parallel
        # in profiled-device seconds, as compute: the simulator divides them by the cluster's speed
        reduce = gather_in = gather_out = 0.0
        if t > 1:
            reduce = allreduce_seconds(rowwise, scale, t, cluster) * cluster.speed
            gather_in = allgather_seconds(self.segment(i, j)["received"] * scale, t, cluster) * cluster.speed
            gather_out = allgather_seconds(sent * scale, t, cluster) * cluster.speed  # the sent values' gradients
        # memory is priced by stage_state.py (evaluate_layout), not by the simulator
        backward = (backward + recomputed * forward) * scale / t + (1.0 + recomputed) * reduce + gather_out
        return StageWork(forward=forward * scale / t + reduce + gather_in, backward=backward,
                         grad_bytes=grads, ready_fraction=ready, send_bytes=sent * scale / t,
                         # the runtime's first stage has no input gradient to split off (zb-h1)
                         weight_fraction=0.0 if i == 0 else 0.5)

    def _work(self, i: int, j: int, tensor_parallel: int) -> tuple[float, float, tuple[float, ...],
                                                                  tuple[float, ...], float, tuple[float, ...]]:
        """What work() reads of positions [i, j) on one of T ranks, computed once per segment and T (thousands
        of layouts share a few hundred): forward and backward seconds, gradient tensor sizes (split ones 1/T),
        when each is final, bytes sent, bytes all-reduced after each rowwise matrix."""
        if (i, j, tensor_parallel) not in self._works:
            grads, ready = [], []
            total_bwd = sum(self.bwd[i:j])
            done = 0.0
            for v in range(j - 1, i - 1, -1):  # the backward visits the stage back to front
                done += self.bwd[v]
                for size, split in self.tensors[v]:
                    grads.append(size / tensor_parallel if split else size)
                    ready.append(done / total_bwd if total_bwd > 0 else 1.0)
            rowwise = tuple(float(b) for b in self.rowwise[i:j] if b > 0)
            self._works[i, j, tensor_parallel] = (sum(self.fwd[i:j]), total_bwd, tuple(grads), tuple(ready),
                                                  self.segment(i, j)["sent"], rowwise)
        return self._works[i, j, tensor_parallel]


def _grad_tensors(graph: CostGraph | nx.DiGraph, names: list[str],
                  nodes: list[dict]) -> list[list[tuple[float, bool]]]:
    """Gradient tensors owned by each position (a shared parameter at its first user): their sizes and
    whether tensor parallelism splits them (tensor_parallel.is_split).

    A CostGraph knows each parameter's exact size and shape from its model; a plain graph gives
    param_bytes per node, taken as one tensor, split when the node is a matmul or embedding."""
    sizes: dict[str, float] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    if isinstance(graph, CostGraph):
        for n, p in graph.model.named_parameters():
            sizes[n], shapes[n] = float(p.numel() * p.element_size()), tuple(p.shape)
    seen: set[str] = set()
    out = []
    for attrs in nodes:
        params = [n for n in attrs.get("params", []) if n in sizes and n not in seen]
        seen.update(params)
        if params:
            out.append([(sizes[n], is_split(shapes[n], None)) for n in params])
        elif attrs.get("param_bytes", 0) > 0:
            out.append([(float(attrs["param_bytes"]), is_split(None, attrs.get("target", "")))])
        else:
            out.append([])
    return out


def evaluate_layout(model: _Model | CostGraph | nx.DiGraph, cluster: Cluster, cuts: Sequence[int], *,
                    replicas: int, micro_batches: int, schedule: str, batch_size: int,
                    profiled_batch: int, reduction: Reduction = DEFAULT_REDUCTION, optimizer: str | float = "adam",
                    param_scale: float = 1.0, zero: int = 0, recompute: str = "none",
                    tensor_parallel: int = 1, sequence_parallel: bool = False) -> Layout:
    """Predict one layout: global batch_size split over replicas x micro_batches, each stage's matrices split
    over tensor_parallel ranks (sequence_parallel: with the activations between them cut along the sequence).
    optimizer: a name of stage_state.OPTIMIZER_STATE or the fp32 state copies it keeps per parameter;
    param_scale: fp32 bytes per parameter byte of the graph (2 for a model built in bf16)."""
    m = model if isinstance(model, _Model) else _Model(model)
    (t,) = degrees(tensor_parallel, cluster, m.splittable)
    devices = (len(cuts) - 1) * replicas * t
    if devices > cluster.devices:
        raise ValueError(f"{len(cuts) - 1} stages x {replicas} replicas x T={t} need {devices} devices but cluster "
                         f"{cluster.name!r} has {cluster.devices}; fix: fewer stages, replicas or T")
    scale = _micro_scale(batch_size, replicas, micro_batches, profiled_batch)
    copies = _state_copies(optimizer)
    memory = _price(m, cuts, replicas, micro_batches, schedule, scale, copies, param_scale, zero, recompute, t,
                    sequence_parallel)
    return _simulate(m, cluster, cuts, replicas, micro_batches, schedule, batch_size, scale, reduction, memory,
                     zero, recompute, t, sequence_parallel)


def _micro_scale(batch_size: int, replicas: int, micro_batches: int, profiled_batch: int) -> float:
    per_micro = batch_size / (replicas * micro_batches)
    if per_micro != int(per_micro) or per_micro < 1:
        raise ValueError(f"batch_size {batch_size} does not split into {replicas} replicas x "
                         f"{micro_batches} micro-batches; fix: pick counts that divide it")
    return per_micro / profiled_batch


def _state_copies(optimizer: str | float) -> float:
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZER_STATE:
            raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATE)} or give "
                             "the fp32 state copies it keeps per parameter (Adam 2)")
        return float(OPTIMIZER_STATE[optimizer])
    if not optimizer >= 0:
        raise ValueError(f"optimizer state copies must be >= 0, got {optimizer!r}")
    return float(optimizer)


def _price(m: _Model, cuts: Sequence[int], replicas: int, micro_batches: int, schedule: str, scale: float,
           copies: float, param_scale: float, zero: int, recompute: str,
           tensor_parallel: int = 1, sequence_parallel: bool = False) -> list[StageMemory]:
    """Each stage's predicted peak (stage_state.stage_peak) at the moments its action list holds, on one of
    its T ranks: 1/T of the split parameters and tensor_parallel.activation_share of the activations (a
    recomputed micro-batch's kept input is whole)."""
    moments = schedule_moments(schedule, len(cuts) - 1, micro_batches, recompute)
    share = activation_share(tensor_parallel, sequence_parallel)
    out = []
    for k in range(len(cuts) - 1):
        seg = m.segment(cuts[k], cuts[k + 1])
        # written so that T=1 gives today's bytes exactly: minus 0.0, times 1.0
        params = seg["params"] - m.split_params(cuts[k], cuts[k + 1]) * (1.0 - 1.0 / tensor_parallel)
        out.append(stage_peak(moments[k], params * param_scale, seg["activations"] * scale * share,
                              seg["boundary"] * scale, replicas=replicas, zero=zero, state_copies=copies))
    return out


def _simulate(m: _Model, cluster: Cluster, cuts: Sequence[int], replicas: int, micro_batches: int, schedule: str,
              batch_size: int, scale: float, reduction: Reduction, memory: list[StageMemory], zero: int,
              recompute: str, tensor_parallel: int = 1, sequence_parallel: bool = False) -> Layout:
    """The layout's step, simulated on lanes of T devices (see the module docstring); ``memory`` priced with
    ``sequence_parallel`` or not, which the layout records."""
    t = tensor_parallel
    share = recomputed_share(schedule, len(cuts) - 1, micro_batches, recompute)
    work = [m.work(cuts[k], cuts[k + 1], scale, share[k], t, cluster) for k in range(len(cuts) - 1)]
    lanes = cluster if t == 1 else dataclasses.replace(cluster, devices_per_node=cluster.devices_per_node // t)
    result = simulate_cluster_step(work, lanes, replicas=replicas, micro_batches=micro_batches,
                                   schedule=schedule, reduction=reduction)
    if t > 1:  # a lane is T devices: its ideal time is one device's / T, without the all-reduces in `work`
        whole = [m.work(cuts[k], cuts[k + 1], scale, share[k]) for k in range(len(cuts) - 1)]
        result.single_device_time = replicas * micro_batches * sum(w.forward + w.backward for w in whole) / (
            cluster.speed * t)
    result.memory = [mem.total for mem in memory]
    fits = cluster.memory is None or max(result.memory) <= cluster.memory
    return Layout(list(cuts), replicas, micro_batches, schedule, batch_size, result, fits, memory, zero, recompute,
                  tensor_parallel=t, sequence_parallel=sequence_parallel and t > 1)


def search_layouts(graph: CostGraph | nx.DiGraph, cluster: Cluster, *, batch_size: int,
                   profiled_batch: int, schedules: Sequence[str] = CLUSTER_SCHEDULES,
                   micro_batches: Sequence[int] = MICRO_BATCHES, max_stages: int | None = None,
                   reduction: Reduction = DEFAULT_REDUCTION, optimizer: str | float = "adam",
                   param_scale: float = 1.0, exhaustive_limit: int = 64, zeros: Sequence[int] = (0,),
                   recomputes: Sequence[str] = ("none",), tensor_parallel: int | str = 1,
                   sequence_parallel: bool = False) -> list[Layout]:
    """The best layout of every shape (stages, replicas, micro-batches, schedule, T), best first, each with
    the fastest, then least sharded, ZeRO level and recomputation setting that fits (see the module
    docstring for the search space). tensor_parallel: T, or "auto" for every T dividing the devices per node;
    sequence_parallel: every T > 1 runs sequence parallelism (its activations 1/T)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not profiled_batch > 0:
        raise ValueError(f"profiled_batch must be > 0 samples, got {profiled_batch!r}")
    if not zeros or any(z not in SEARCHED_ZERO for z in zeros):
        raise ValueError(f"zeros must list ZeRO levels among {', '.join(map(str, SEARCHED_ZERO))}, got {list(zeros)}")
    if not recomputes or any(r not in RECOMPUTE for r in recomputes):
        raise ValueError(f"recomputes must list settings among {', '.join(RECOMPUTE)}, got {list(recomputes)}")
    bad = [k for k in schedules if k not in CLUSTER_SCHEDULES]
    if bad:
        raise ValueError(f"schedules {bad} cannot be planned; choose from {CLUSTER_SCHEDULES}")
    copies = _state_copies(optimizer)
    # time grows with recomputation and not with sharding: the first fitting option is the fastest
    options = [(r, z) for r in sorted(set(recomputes), key=RECOMPUTE.index) for z in sorted(set(zeros))]
    model = _Model(graph)
    degrees_searched = degrees(tensor_parallel, cluster, model.splittable)
    positions = [c for c in range(1, model.chain.n) if model.chain.cuttable[c]]
    most = cluster.devices // min(degrees_searched)
    top = min(most, len(positions) + 1, max_stages or most)
    best: dict[tuple, Layout] = {}  # per shape (stages, replicas, micro-batches, schedule, T)
    # the search keeps thousands of schedules' actions alive and makes no reference cycles: the collector would
    # walk them again after every schedule built and simulated (gc_paused there re-enables it)
    with gc_paused():
        # the cuts do not depend on T: searched once per depth for every T
        cut_sets = {stages: _cut_candidates(model, positions, stages, top, cluster, exhaustive_limit)
                    for stages in range(1, top + 1)}
        for t, stages in itertools.product(degrees_searched, range(1, top + 1)):
            lanes = cluster.devices // t
            if stages > lanes:
                continue
            for cuts in cut_sets[stages]:
                for replicas in _replica_counts(lanes // stages):
                    if batch_size % replicas:
                        continue
                    for m in micro_batches:
                        if (batch_size // replicas) % m or m > max(32, MICRO_BATCHES_PER_STAGE * stages * t):
                            continue
                        scale = _micro_scale(batch_size, replicas, m, profiled_batch)
                        for kind in schedules:  # every schedule even with one stage: they differ in memory
                            recompute, zero, memory, needs = _cheapest_option(
                                model, cuts, replicas, m, kind, scale, copies, param_scale, options, cluster.memory,
                                t, sequence_parallel)
                            lay = _simulate(model, cluster, cuts, replicas, m, kind, batch_size, scale, reduction,
                                            memory, zero, recompute, t, sequence_parallel)
                            lay.needs = needs
                            shape = (stages, replicas, m, kind, t)
                            if shape not in best or lay.key() < best[shape].key():
                                best[shape] = lay
    if not best:
        raise ValueError(f"no layout splits batch_size={batch_size} over the allowed replicas and "
                         f"micro-batches {list(micro_batches)}; fix: use a batch size with small factors")
    return sorted(best.values(), key=Layout.key)


def _cheapest_option(m: _Model, cuts: Sequence[int], replicas: int, micro_batches: int, kind: str, scale: float,
                     copies: float, param_scale: float, options: list[tuple[str, int]],
                     limit: float | None, tensor_parallel: int = 1,
                     sequence_parallel: bool = False) -> tuple[str, int, list[StageMemory], str]:
    """The first (recompute, zero) option of a shape whose stages all fit `limit`, the one needing least
    memory when none does, and what the first option tried needs when it was not taken. Sharding needs
    replicas: with one, only zero=0 is tried."""
    priced = []
    for recompute, zero in options:
        if zero and replicas == 1:
            continue
        memory = _price(m, cuts, replicas, micro_batches, kind, scale, copies, param_scale, zero, recompute,
                        tensor_parallel, sequence_parallel)
        peak = max(mem.total for mem in memory)
        needs = f"zero={priced[0][2]} recompute={priced[0][1]} needs {format_bytes(priced[0][0])}" if priced else ""
        if limit is None or peak <= limit:
            return recompute, zero, memory, needs
        priced.append((peak, recompute, zero, memory))
    if not priced:  # only zero >= 1 was asked for and there is one replica
        recompute = options[0][0]
        memory = _price(m, cuts, replicas, micro_batches, kind, scale, copies, param_scale, 0, recompute,
                        tensor_parallel, sequence_parallel)
        return recompute, 0, memory, ""
    peak, recompute, zero, memory = min(priced, key=lambda p: p[0])
    return recompute, zero, memory, ""


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
            f"{_count(closest.stages, 'stage')} x {_count(closest.replicas, 'replica')}"
            f"{f' x T={closest.tensor_parallel}' if closest.tensor_parallel > 1 else ''} "
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


def _cut_candidates(model: _Model, positions: list[int], stages: int, top: int, cluster: Cluster,
                    limit: int) -> list[list[int]]:
    """Every split into `stages` when there are at most `limit`, else the "graph" partitioner's (top: the
    most stages searched, for which enough cheap boundaries are kept)."""
    n = model.chain.n
    if math.comb(len(positions), stages - 1) <= limit:
        return [[0, *inner, n] for inner in itertools.combinations(positions, stages - 1)]
    chain = model.cheap_chain(top - 1) if len(positions) > CHEAP_CUTS_ABOVE else model.chain
    try:  # the "graph" partitioner's optimal cuts, without building stage modules
        return [optimal_cuts(chain, stages, bandwidth=cluster.intra_bandwidth, replicas=[1] * stages,
                             rows=model.rows(chain))]
    except PartitionError:  # fewer (cheap) boundaries than stages
        return []


def explain_choice(layouts: Sequence[Layout], cluster: Cluster) -> str:
    """Why the first of ranked `layouts` beats the next: its step time against the next fitting one, or the
    next's peak over the device memory; what its cheaper options would have needed; and, when it splits
    stages over T > 1 ranks and the ranking has layouts without, why it beats those (_against_no_split)."""
    best = layouts[0]
    why = f"chosen {best.label()}"
    if len(layouts) > 1:
        nxt = layouts[1]
        if not nxt.fits:
            k = max(range(nxt.stages), key=nxt.result.memory.__getitem__)
            why += (f": the only layout that fits; the next, {nxt.label()}, puts {format_bytes(nxt.result.memory[k])} "
                    f"on stage {k} of {format_bytes(cluster.memory)}")
        elif nxt.step_time > best.step_time:
            why += f": {100 * (nxt.step_time / best.step_time - 1):.1f}% faster step than the next, {nxt.label()}"
        else:
            why += f": as fast as the next, {nxt.label()}, with less sharding, recomputation or fewer devices"
    if best.needs:
        why += f"; at this shape {best.needs} (over {format_bytes(cluster.memory)})"
    unsplit = [lay for lay in layouts if lay.tensor_parallel == 1]
    if best.fits and best.tensor_parallel > 1 and unsplit:
        why += ". " + _against_no_split(best, unsplit, cluster)
    return why


def _against_no_split(best: Layout, unsplit: Sequence[Layout], cluster: Cluster) -> str:
    """One sentence: why `best` (T > 1) beats the best of the ranked layouts `unsplit` (T = 1): the memory
    that one needs over the device's when none fits, else the step times."""
    shape = f"T={best.tensor_parallel} x {_count(best.stages, 'stage')} x {_count(best.replicas, 'replica')}"
    peak = max(best.result.memory)
    if not any(lay.fits for lay in unsplit):
        closest = min(unsplit, key=lambda lay: max(lay.result.memory))
        return (f"{shape} fits {format_bytes(peak)} per device where the best T=1 layout, {closest.label()}, needs "
                f"{format_bytes(max(closest.result.memory))} (over {format_bytes(cluster.memory)})")
    other = unsplit[0]
    return (f"{shape} takes {_seconds(best.step_time)} a step where the best T=1 layout, {other.label()}, takes "
            f"{_seconds(other.step_time)} ({other.step_time / best.step_time:.2f}x), with "
            f"{format_bytes(peak)} against {format_bytes(max(other.result.memory))} per device")


def _seconds(t: float) -> str:
    """'3,501 s' or '12.3 ms': a step time at the precision a comparison needs."""
    return f"{t:,.0f} s" if t >= 100 else f"{t:.3g} s" if t >= 1 else f"{1e3 * t:.3g} ms"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('h') else 's'}"


def format_stage_memory(layout: Layout, cluster: Cluster) -> str:
    """Table of each stage's predicted peak memory per device (weights, gradients, optimizer state,
    activations of the schedule's in-flight micro-batches) against the cluster's device memory; with
    tensor parallelism, a line first saying each device holds one of T shares."""
    lines = [] if layout.tensor_parallel == 1 else [
        f"tensor parallel T={layout.tensor_parallel}: each of a stage's {layout.tensor_parallel} devices holds "
        f"1/{layout.tensor_parallel} of its matrices' weights, gradients and optimizer state (norms and biases "
        f"whole) and {100 * activation_share(layout.tensor_parallel, layout.sequence_parallel):.1f}% of its "
        "activations (Korthikanti et al.: " + ("34/T / 34, sequence parallel)" if layout.sequence_parallel
                                               else "(10 + 24/T) / 34)")]
    lines += [f"{'stage':>5} {'graph nodes':>11} {'weights':>10} {'gradients':>10} {'optimizer':>10} "
             f"{'activations':>11} {'in flight':>9} {'total':>10} {'of device':>9}"]
    for k, mem in enumerate(layout.stage_memory):
        share = "-" if cluster.memory is None else f"{100 * mem.total / cluster.memory:.1f}%"
        nodes = f"{layout.cuts[k]}-{layout.cuts[k + 1] - 1}"
        lines.append(f"{k:>5} {nodes:>11} {format_bytes(mem.weights):>10} {format_bytes(mem.gradients):>10} "
                     f"{format_bytes(mem.optimizer):>10} {format_bytes(mem.activations):>11} {mem.in_flight:>9} "
                     f"{format_bytes(mem.total):>10} {share:>9}")
    return "\n".join(lines)


def format_ranking(layouts: Sequence[Layout], top: int = 10) -> str:
    """Table of the best `top` layouts: shape (stages, replicas, T), predicted step time, throughput,
    efficiency, memory."""
    lines = [f"{'rank':>4} {'stages':>6} {'replicas':>8} {'T':>2} {'devices':>7} {'micro':>5} {'schedule':>20} "
             f"{'step ms':>10} {'samples/s':>10} {'efficiency':>10} {'reduce ms':>9} {'mem GB':>7} fits"]
    for i, lay in enumerate(layouts[:top], 1):
        r = lay.result
        # one cell: the columns stay as they were
        schedule = (lay.schedule + (f"/zero{lay.zero}" if lay.zero else "")
                    + (f"/{lay.recompute}" if lay.recompute != "none" else ""))
        lines.append(f"{i:>4} {lay.stages:>6} {lay.replicas:>8} {lay.tensor_parallel:>2} {lay.devices:>7} "
                     f"{lay.micro_batches:>5} "
                     f"{schedule:>20} {1e3 * lay.step_time:>10.3f} {lay.throughput:>10.1f} "
                     f"{100 * r.scaling_efficiency:>9.1f}% {1e3 * max(r.reduction_exposed):>9.3f} "
                     f"{max(r.memory) / 1e9:>7.2f} {'yes' if lay.fits else 'NO'}")
    return "\n".join(lines)

"""Hybrid mode glue: each replica's shard of a mini-batch, and averaging a stage's gradients
over its replicas with the fused/hierarchical reducer (under ZeRO: which replica owns which tensor,
the reduce-scatter to the owners and the all-gather of what they stepped)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from pipetrain.allreduce.hierarchy import Hierarchy
from pipetrain.allreduce.reducer import MiB, GradientReducer
from pipetrain.allreduce.sharded import ShardedReducer
from pipetrain.allreduce.sharding import shard_owners
from pipetrain.allreduce.slices import shards_evenly, step_slices
from pipetrain.optim import smoothed_update
from pipetrain.runtime.batching import batch_size
from pipetrain.runtime.local_shards import local_bytes
from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.staleness import PREDICTING
from schedules.cluster import load_cluster
from schedules.cluster.reductions import Group, prefers_hierarchical

COMPRESS = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def replica_shard(batch: Any, replica: int, replicas: int, size: int | None = None) -> Any:
    """Replica ``replica``'s contiguous share of every batch-dimension tensor in ``batch``: those whose dim 0 is
    ``size`` (default: the first tensor's). Targets take the inputs' size: they may be None or hold no tensor
    (a model computing its own loss from labels among its inputs)."""
    size = batch_size(batch) if size is None else size
    if size < replicas:
        raise ValueError(f"a mini-batch of {size} samples cannot feed data_parallel={replicas} replicas; "
                         "use a larger batch")
    return pytree.tree_map(
        lambda v: torch.tensor_split(v, replicas)[replica]
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == size else v, batch)


def shard_weight(global_size: int, replica_size: int, replicas: int) -> float:
    """Factor on a replica's loss so that the replicas' mean gradient is the global-batch mean.

    Each replica differentiates (replicas * n_r / N) x its own mean loss; averaging the
    replicas then gives sum over all N samples / N even when shards are uneven.
    """
    return replicas * replica_size / global_size


def bucket_choice(cluster: str | None, hierarchy: Hierarchy | None) -> Callable[[int], bool] | None:
    """allreduce="hybrid": bucket bytes -> hierarchical? by the cluster cost model (None without a
    cluster: the reducer then goes hierarchical across nodes, the model's verdict when the links
    inside a node are at least as fast as those between nodes)."""
    if cluster is None or hierarchy is None:
        return None
    spec, group = load_cluster(cluster), Group(hierarchy.nodes, hierarchy.per_node)
    return lambda nbytes: prefers_hierarchical(nbytes, group, spec)


@dataclass(frozen=True)
class ReductionSettings:
    """How hybrid mode averages a stage's gradients over its replicas (wrap's options, reduced)."""

    bucket_mb: float
    algorithm: str                 # "hybrid" | "flat" | "hierarchical" | "per-tensor"
    compress: str | None           # "bf16" | "fp16": gradients sent in low precision
    cluster: str | None            # allreduce="hybrid": the cluster whose cost model picks per bucket
    overlap: bool                  # buckets reduced during the last backward
    zero: int = 0                  # 1: optimizer state sharded over the replicas; 2: gradients too
    shares_updates: bool = False   # zero with a predicting policy: lr * v all-gathered after each step
    even: bool = False             # zero with an elementwise optimizer: even ranges, cutting tensors

    @classmethod
    def of(cls, options: Any) -> ReductionSettings:
        # Hooks see gradients only when autograd accumulates them: not with staleness policies
        # (they add per-version gradients by hand), nor across interleaved chunks, nor when
        # zero-bubble W passes set the weight gradients.
        overlap = (options.overlap and options.staleness == "none" and options.chunks_per_device == 1
                   and not options.splits_backward)
        return cls(options.bucket_mb, options.allreduce, options.compress, options.cluster, overlap, options.zero,
                   bool(options.zero) and options.staleness in PREDICTING,
                   bool(options.zero) and shards_evenly(options.optimizer))


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of ``module`` that take gradients, in registration order (what ZeRO shards)."""
    return [p for p in module.parameters() if p.requires_grad]


def tied_owners(tied: list[list[tuple[int, str]]], stage: int, replicas: int) -> dict[str, int]:
    """Under ZeRO, by parameter name in ``stage``: the replica owning each tied parameter, the same on every
    stage holding a copy. That replica's ranks then hold every copy's reduced gradient, so the sum across
    stages (pipetrain.comm.tied) that both copies step with is exact; elsewhere it sums what nobody steps."""
    return {name: i % replicas for i, copies in enumerate(tied) for s, name in copies if s == stage}


def position_owners(modules: list[torch.nn.Module], indices: list[int], tied: list[list[tuple[int, str]]],
                  replicas: int) -> list[list[int]]:
    """Under ZeRO, per module of one pipeline position (its virtual stages ``indices``, in order), the replica
    owning each of ``trainable(module)``: balanced over the position's tensors together, tied copies fixed
    (`tied_owners`). The same answer on every replica, so the optimizers (built per stage) and the reducer
    (built per position) agree without talking."""
    named = [(v, n, p) for module, v in zip(modules, indices) for n, p in module.named_parameters() if p.requires_grad]
    fixed_names = {v: tied_owners(tied, v, replicas) for v in indices}
    fixed = {i: fixed_names[v][n] for i, (v, n, _) in enumerate(named) if n in fixed_names[v]}
    owners = shard_owners([p for _, _, p in named], replicas, fixed)
    out, start = [], 0
    for module in modules:
        count = len(trainable(module))
        out.append(owners[start:start + count])
        start += count
    return out


class StageReducer:
    """Averages one position's gradients over the replicas of its stage at the REDUCE action; with ZeRO
    (``settings.zero``) reduce-scatters them to the replicas owning each tensor, and all-gathers the
    stepped tensors at STEP (``gather``)."""

    def __init__(self, stages: list[StageRuntime], group, hierarchy, settings: ReductionSettings,
                 counter: CommCounter, tied: list[list[tuple[int, str]]] | None = None):
        self.params = [p for s in stages for p in trainable(s.module)]
        self.stage = stages[0].index
        self.counter = counter
        self.payload = sum(local_bytes(p) for p in self.params)  # a tensor-parallel rank sends its blocks
        common = dict(bucket_bytes=int(settings.bucket_mb * MiB), hierarchy=hierarchy, algorithm=settings.algorithm,
                      compress=COMPRESS[settings.compress],
                      choose_hierarchical=bucket_choice(settings.cluster, hierarchy))
        self.zero = settings.zero
        # A predicting policy (spectrain, nesterov) reads v of every parameter: its owner's, all-gathered.
        self.stages, self.shares_updates = stages, settings.shares_updates
        if not self.params:
            self.reducer = None
        elif self.zero and settings.even:
            alone = [s.module.get_parameter(name) for s in stages for copies in tied or [] for v, name in copies
                     if v == s.index]
            self.reducer = ShardedReducer(self.params, None, group, alone=alone, free_unowned=self.zero >= 2, **common)
            for s in stages:
                if s.optimizer is not None:
                    step_slices(s.optimizer, self.reducer.slices())
        elif self.zero:
            replicas = torch.distributed.get_world_size(group)
            per_stage = position_owners([s.module for s in stages], [s.index for s in stages], tied or [], replicas)
            owners = [o for shares in per_stage for o in shares]
            self.reducer = ShardedReducer(self.params, owners, group, free_unowned=self.zero >= 2, **common)
        else:
            self.reducer = GradientReducer(self.params, group, **common)
        self._groups = {id(p): (s.optimizer, g) for s in stages if s.optimizer is not None
                        for g in s.optimizer.param_groups for p in g["params"]}
        self.overlap = settings.overlap and self.reducer is not None
        if self.overlap:
            self.reducer.enable_overlap()

    def before_backward(self, final: bool) -> None:
        """Only the last backward before REDUCE may launch buckets (earlier ones accumulate)."""
        if self.overlap:
            self.reducer.prepare(final=final)

    def reduce(self, t: int) -> None:
        if self.reducer is None:
            return
        if self.overlap:
            self.reducer.finish()
        else:
            self.reducer.reduce_now()
        self.counter.add("data_parallel", self.stage, self.payload)

    def stepped(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """ZeRO: (tensor, its parameter) for each tensor this replica steps, holding its reduced gradient."""
        return [] if self.reducer is None else self.reducer.stepped()

    def gather(self) -> None:
        """ZeRO: after the owners stepped, every replica takes their updated tensors (nothing without ZeRO)."""
        if self.zero and self.reducer is not None:
            self.reducer.gather()
            self.share_updates()

    def share_updates(self) -> None:
        """ZeRO with spectrain or nesterov: every replica's policies get lr * v of every parameter from its
        owner (after each step, and after a checkpoint load); collective over the stage's replicas."""
        if self.shares_updates and self.reducer is not None:
            updates = self.reducer.gather_values(self._update_of)
            for s in self.stages:
                s.policy.receive_updates([updates[id(p)] for _, p in s.policy.params])

    def _update_of(self, stepped: torch.Tensor) -> torch.Tensor:
        """``lr * v`` of a tensor this replica steps (zeros before its first step: no prediction)."""
        optimizer, group = self._groups[id(stepped)]
        v = smoothed_update(optimizer, stepped, group)
        return torch.zeros_like(stepped) if v is None else v * group["lr"]

    def abandon(self) -> None:
        """A step raised: forget the buckets filled for it (all ranks abandon the same step)."""
        if self.reducer is not None:
            self.reducer.abandon()

    def close(self) -> None:
        """The pipeline ends: take the reducer's hooks off the parameters."""
        if self.reducer is not None:
            self.reducer.close()

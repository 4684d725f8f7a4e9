"""Data-parallel gradient reduction: fused buckets, hierarchical, hybrid.

`GradientReducer` averages the gradients of a set of parameters over a
data-parallel process group (gloo or NCCL). Gradients are packed into flat
per-dtype buckets (see `pipetrain.allreduce.buckets`) and each bucket is reduced with
one asynchronous chain of collectives (see `pipetrain.allreduce.algorithms`):

* ``"flat"``: one all-reduce per bucket over the group;
* ``"hierarchical"``: intra-node reduce-scatter, inter-node all-reduce of the
  shard, intra-node all-gather;
* ``"hybrid"`` (default): each bucket takes the algorithm `choose_hierarchical(bytes)` picks
  (pipetrain prices both with the cluster cost model, schedules.cluster.reductions); without
  one, every bucket is hierarchical across nodes, the cost model's verdict whenever the links
  inside a node are at least as fast as those between nodes (fewer slow-link latencies and no
  more bytes on them); on a single node every bucket is flat;
* ``"per-tensor"``: one all-reduce per tensor (the unfused baseline).

Use with overlap (hooks launch a bucket as soon as its last gradient is
accumulated, while the backward continues)::

    reducer = GradientReducer(stage.parameters(), dp_group)
    reducer.enable_overlap()
    for i, micro_batch in enumerate(micro_batches):
        reducer.prepare(final=(i == len(micro_batches) - 1))   # or: with reducer.no_sync(): ...
        backward(micro_batch)
    reducer.finish()          # waits, writes averaged grads into p.grad
    optimizer.step()

or without overlap: ``reducer.reduce_now()`` after the last backward.

Buckets are launched strictly in bucket order and every step of a chain
uses its own communicator, so all ranks issue the same collectives in the
same order on every group even though gradients become ready at different
times on different ranks.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from pipetrain.allreduce.buckets import BucketSpec, assign_buckets
from pipetrain.allreduce.algorithms import Step, flat_steps, hierarchical_steps
from pipetrain.allreduce.hierarchy import Hierarchy, build_hierarchy_groups
from pipetrain.allreduce.local import local

MiB = 1 << 20
ALGORITHMS = ("hybrid", "flat", "hierarchical", "per-tensor")


class _Bucket:
    """A flat buffer, the parameters packed into it and its reduction chain's progress."""

    def __init__(self, spec: BucketSpec, params: list[torch.Tensor], pad_to: int, compress: torch.dtype | None):
        self.params = [params[i] for i in spec.indices]
        self.offsets: list[int] = []
        offset = 0
        for p in self.params:
            self.offsets.append(offset)
            offset += local(p).numel()
        padded = -(-offset // pad_to) * pad_to
        device = self.params[0].device
        self.buffer = torch.zeros(padded, dtype=spec.dtype, device=device)
        self.comm = self.buffer if compress is None else torch.zeros(padded, dtype=compress, device=device)
        self.steps: list[Step] = []
        self.hierarchical = False  # reduced intra-node / inter-node / intra-node rather than by one ring
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.launched = 0  # steps launched so far
        self.work: dist.Work | None = None
        self.finish_step = None

    def view(self, k: int) -> torch.Tensor:
        p = self.params[k]
        return self.buffer[self.offsets[k] : self.offsets[k] + local(p).numel()]

    def fill(self, k: int, grad: torch.Tensor | None) -> None:
        if grad is None:
            self.view(k).zero_()  # this replica produced no gradient: it contributes zeros
        else:
            self.view(k).copy_(local(grad).reshape(-1))
        self.ready[k] = True
        self.pending -= 1

    @property
    def done(self) -> bool:
        return self.launched == len(self.steps) and self.work is None


def _sent_as(dtype: torch.dtype, compress: torch.dtype | None) -> torch.dtype | None:
    """The dtype a bucket of `dtype` travels in when `compress` is asked (None: its own)."""
    wider = dtype.is_floating_point and compress is not None and dtype.itemsize > compress.itemsize
    return compress if wider else None


class GradientReducer:
    """Averages gradients over a data-parallel group in flat buckets (see module docstring).

    Args:
        params: parameters whose gradients to reduce (those without
            requires_grad are skipped; duplicates count once).
        group: the data-parallel process group (None: the default group).
        bucket_bytes: bucket size cap (default 25 MiB, like DDP).
        first_bucket_bytes: cap of the first bucket (default 1 MiB, so the
            first reduction starts early in the backward).
        hierarchy: a `Hierarchy` from `build_hierarchy_groups` (required when
            several data-parallel groups exist, e.g. hybrid pipeline mode), or
            ``(nodes, per_node)``, or None to read LOCAL_WORLD_SIZE (torchrun).
            The last two create groups here, which is collective over the
            default group, so they are only allowed when `group` spans all ranks.
            Unused by "flat" and "per-tensor".
        algorithm: "hybrid" | "flat" | "hierarchical" | "per-tensor".
        compress: None, torch.bfloat16 or torch.float16: wider float buckets
            are sent in this dtype (gradients are pre-divided so fp16 sums do
            not overflow) and cast back.
        choose_hierarchical: for "hybrid": bucket bytes -> True to reduce that bucket
            hierarchically (None: always, across nodes).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        group: dist.ProcessGroup | None = None,
        *,
        bucket_bytes: int = 25 * MiB,
        first_bucket_bytes: int = 1 * MiB,
        hierarchy: Hierarchy | tuple[int, int] | None = None,
        algorithm: str = "hybrid",
        compress: torch.dtype | None = None,
        choose_hierarchical: Callable[[int], bool] | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"GradientReducer: unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
        if compress not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"GradientReducer: compress must be None, torch.bfloat16 or torch.float16, got {compress}")
        if not dist.is_initialized():
            raise RuntimeError("GradientReducer needs torch.distributed; call dist.init_process_group first")
        unique: dict[int, torch.Tensor] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        if not self.params:
            raise ValueError("GradientReducer: no parameter requires grad; nothing to reduce")
        self.group = group
        self.size = dist.get_world_size(group)
        self.algorithm = algorithm
        self.hierarchy = self._resolve_hierarchy(hierarchy) if algorithm in ("hybrid", "hierarchical") else None
        if algorithm == "per-tensor":
            specs = assign_buckets(self.params, 0, 0)
        else:
            specs = assign_buckets(self.params, bucket_bytes, first_bucket_bytes, self._alone())
        self.buckets = [self._make_bucket(spec, self._hierarchical(spec.nbytes, choose_hierarchical),
                                          _sent_as(spec.dtype, compress)) for spec in specs]
        self._where = {id(p): (b, k) for b in self.buckets for k, p in enumerate(b.params)}
        self.gradient_bytes = 0  # bytes of gradients held once the last reduction finished (measured)
        self._hooks: list = []
        self._reset_round()

    # --- set-up -------------------------------------------------------------
    def _alone(self) -> set[int]:
        """Indices into ``self.params`` that get a bucket of their own (none here; see pipetrain.allreduce.sharded)."""
        return set()

    def _make_bucket(self, spec: BucketSpec, hierarchical: bool, compress: torch.dtype | None) -> _Bucket:
        """A bucket of `spec` with its reduction chain (subclasses shard it: pipetrain.allreduce.sharded)."""
        bucket = _Bucket(spec, self.params, self.hierarchy.per_node if hierarchical else 1, compress)
        bucket.hierarchical = hierarchical
        bucket.steps = hierarchical_steps(bucket.comm, self.hierarchy) if hierarchical else flat_steps(bucket.comm, self.group)
        return bucket

    def _resolve_hierarchy(self, hierarchy: Hierarchy | tuple[int, int] | None) -> Hierarchy | None:
        if isinstance(hierarchy, Hierarchy):
            if hierarchy.nodes * hierarchy.per_node != self.size:
                raise ValueError(
                    f"GradientReducer: hierarchy {hierarchy.nodes}x{hierarchy.per_node} does not match group size {self.size}"
                )
            return hierarchy
        if hierarchy is None and os.environ.get("LOCAL_WORLD_SIZE") is None:
            if self.algorithm == "hybrid":
                return None  # one node: hybrid is flat
            raise ValueError(
                "GradientReducer: algorithm='hierarchical' needs hierarchy=(nodes, per_node), a Hierarchy from "
                "build_hierarchy_groups, or LOCAL_WORLD_SIZE (torchrun)"
            )
        if dist.get_world_size(self.group) != dist.get_world_size():
            raise ValueError(
                "GradientReducer: building hierarchy groups is collective over all ranks and the data-parallel group "
                "is a subgroup; build them up front on every rank with build_hierarchy_groups(...) for each "
                "data-parallel group and pass the Hierarchy"
            )
        ranks = list(range(dist.get_world_size()))
        built = build_hierarchy_groups(ranks, *hierarchy) if hierarchy is not None else build_hierarchy_groups(ranks)
        return built

    def _hierarchical(self, nbytes: int, choose: Callable[[int], bool] | None) -> bool:
        if self.algorithm == "hierarchical":
            return True
        if self.algorithm == "hybrid" and self.hierarchy is not None and self.hierarchy.nodes > 1:
            return True if choose is None else bool(choose(nbytes))
        return False

    # --- round state ----------------------------------------------------------
    def _reset_round(self) -> None:
        self._final = True
        self._factor = 1.0 / self.size
        self._next_launch = 0
        for b in self.buckets:
            b.reset()

    def prepare(self, final: bool = True, weight: float | None = None) -> None:
        """Declare whether the NEXT backward is the last one before `finish()`.

        Only the final backward launches communication; earlier ones just
        accumulate into p.grad. `weight` (e.g. this replica's sample count,
        may differ between replicas) makes the result ``sum_i w_i g_i / sum_i w_i``
        instead of the plain mean; it costs one scalar all-reduce (so every
        rank must pass a weight when one does).
        """
        if any(b.pending < len(b.params) for b in self.buckets):
            raise RuntimeError("GradientReducer.prepare: a reduction is in flight; call finish() first")
        self._final = final
        if weight is None:
            self._factor = 1.0 / self.size
            return
        if weight < 0:
            raise ValueError(f"GradientReducer: weight must be >= 0, got {weight}")
        total = torch.tensor([float(weight)], dtype=torch.float64, device=self.params[0].device)
        dist.all_reduce(total, group=self.group)
        if total.item() <= 0:
            raise ValueError("GradientReducer: the weights of all replicas sum to 0; at least one replica needs samples")
        self._factor = float(weight) / total.item()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside only accumulate gradients (no communication)."""
        previous = self._final
        self._final = False
        try:
            yield
        finally:
            self._final = previous

    # --- overlap -------------------------------------------------------------
    def enable_overlap(self) -> None:
        """Install post-accumulate-grad hooks that launch buckets during the final backward."""
        if self._hooks:
            return
        # The hooks hold the reducer weakly: a reducer dropped unclosed would otherwise live on (with its process
        # groups and their threads) through the model's parameters, in a cycle the collector cannot see.
        on_grad = weakref.WeakMethod(self._on_grad)

        def hook(param: torch.Tensor) -> None:
            reducer_on_grad = on_grad()
            if reducer_on_grad is not None:
                reducer_on_grad(param)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def close(self) -> None:
        """Remove the hooks from the parameters (they outlive the pipeline: they are the model's)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._final:
            return
        bucket, k = self._where[id(param)]
        if bucket.ready[k]:
            raise RuntimeError(
                "GradientReducer: a parameter's gradient was finalised twice in one reduction (two backwards "
                "without no_sync()/prepare(final=False)); mark earlier micro-batch backwards as non-final"
            )
        bucket.fill(k, param.grad)
        self._launch_ready()
        self._advance(block=False)

    # --- reduction -------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            bucket = self.buckets[self._next_launch]
            bucket.buffer.mul_(self._factor)  # pre-divide: fp16 sums stay in range
            if bucket.comm is not bucket.buffer:
                bucket.comm.copy_(bucket.buffer)
            self._next_launch += 1

    def _advance(self, block: bool) -> None:
        """Move every launched bucket's chain forward; with `block`, to the end.

        Step k of a bucket is launched only after step k of every earlier
        bucket, so each communicator sees buckets in the same order on all ranks.
        """
        limit = float("inf")
        for bucket in self.buckets[: self._next_launch]:
            while not bucket.done:
                if bucket.work is not None:
                    if block:
                        bucket.work.wait()
                    elif not bucket.work.is_completed():
                        break
                    bucket.work.wait()  # surfaces errors; no-op when completed
                    if bucket.finish_step is not None:
                        bucket.finish_step()
                    bucket.work = None
                if bucket.launched == len(bucket.steps) or bucket.launched >= limit:
                    break
                launch, bucket.finish_step = bucket.steps[bucket.launched]
                bucket.work = launch()
                bucket.launched += 1
            if bucket.launched < len(bucket.steps):
                limit = min(limit, bucket.launched)

    def finish(self) -> None:
        """Reduce what the hooks have not launched yet, wait for all buckets, write averages into p.grad.

        Parameters whose gradient never got finalised by a hook (no hooks,
        unused in the final backward, or never used) contribute their current
        p.grad, or zeros when it is None; afterwards every parameter's p.grad
        holds the group average.
        """
        self._complete_round()
        for bucket in self.buckets:
            for k, p in enumerate(bucket.params):
                reduced = bucket.comm[bucket.offsets[k] : bucket.offsets[k] + local(p).numel()].view_as(local(p))
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local(p.grad).copy_(reduced)
        self._note_gradient_bytes()
        self._reset_round()

    def _complete_round(self) -> None:
        """Launch the buckets the hooks have not, and wait for every one (the step's last reduction)."""
        if not self._final:
            raise RuntimeError(f"{type(self).__name__}.finish called inside no_sync()/prepare(final=False); "
                               "leave it first")
        for bucket in self.buckets:
            for k, p in enumerate(bucket.params):
                if not bucket.ready[k]:
                    bucket.fill(k, p.grad)
        self._launch_ready()
        self._advance(block=False)  # put every bucket on the wire before blocking on the first
        self._advance(block=True)

    def _note_gradient_bytes(self) -> None:
        # Measured when the reduced gradients are in place: the moment the optimizer steps them.
        self.gradient_bytes = sum(local(p.grad).nbytes for p in self.params if p.grad is not None)

    def abandon(self) -> None:
        """Forget the round in progress (the backward that filled it raised). A reduction already on the wire
        is not waited for: the replicas that did not raise may never join it."""
        self._reset_round()

    def reduce_now(self, weight: float | None = None) -> None:
        """Reduce after the backward without overlap (the comparison baseline)."""
        if self._hooks:
            raise RuntimeError("GradientReducer.reduce_now: overlap hooks are installed; call finish() instead")
        self.prepare(final=True, weight=weight)
        self.finish()

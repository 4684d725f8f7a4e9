"""ZeRO-3 on torch's FSDP2: every stage module ``fully_shard``-ed over its stage's replicas.

Each replica keeps 1/D of its stage's parameters, gradients and optimizer state between steps (the optimizer
is built over the sharded DTensor parameters and steps the local shards). Within a step the pipeline drives
FSDP2 as torch's own ``PipelineStage`` does: the parameters are all-gathered by the stage's first forward
and, by default, kept until the gradient reduction (one all-gather per step, not one per micro-batch); every
micro-batch's backward (the split B and W of the zero-bubble schedules, and the recomputed ones, included)
accumulates into the unsharded gradients without communicating; at the position's REDUCE action one
reduce-scatter per stage averages them over the replicas into each replica's shard, and the parameters are
freed. ``reshard_after_forward=True`` frees them after each micro-batch's forward and backward instead.

Across nodes (``hierarchy`` with more than one node) the mesh is 2-D, (node, replica in the node): HSDP, whose
shards are replicated across nodes and reduced there with an all-reduce, so the slow links carry 1/per_node
of the gradients.
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipetrain.allreduce.hierarchy import Hierarchy
from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.stage import StageRuntime


def replica_mesh(group, hierarchy: Hierarchy | None, device: torch.device) -> DeviceMesh:
    """The DeviceMesh of one stage's replicas: flat (sharded over all of them), or (node, replica in the node)
    when they span several nodes (sharded inside a node, replicated across nodes)."""
    ranks = torch.distributed.get_process_group_ranks(group)
    if hierarchy is None or hierarchy.nodes == 1 or hierarchy.inter is None or hierarchy.intra_reduce is None:
        return DeviceMesh.from_group(group, device.type, mesh=ranks, mesh_dim_names=(_dim_name("shard", group),))
    layout = torch.tensor(sorted(ranks)).view(hierarchy.nodes, hierarchy.per_node)
    return DeviceMesh.from_group([hierarchy.inter, hierarchy.intra_reduce], device.type, mesh=layout,
                                 mesh_dim_names=(_dim_name("replicate", hierarchy.inter),
                                                 _dim_name("shard", hierarchy.intra_reduce)))


def _dim_name(role: str, group) -> str:
    """A mesh dimension's name, unique to the process group behind it.

    DeviceMesh equality ignores the groups: two meshes over the same ranks with the same dimension names are
    equal, and DTensor's sharding caches, keyed by equality, hand back whichever came first. After a closed
    pipeline destroyed its groups, the next pipeline's DTensors would then run collectives on those
    ("Could not resolve the process group"). The group's name in the dimension's keeps the meshes apart."""
    return f"{role}-{group.group_name}"


def shard_module(module: torch.nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """Shard ``module``'s parameters over ``mesh`` (in place: they become DTensors) and make its backward
    accumulate until `FullyShardedReducer.reduce`. A module without parameters is left as it is."""
    if not any(True for _ in module.parameters()):
        return
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    _accumulate(module, reshard_after_forward)


def _accumulate(module: FSDPModule, reshard_after_forward: bool) -> None:
    """Backwards from now on add into the unsharded gradients; none of them ends the step."""
    module.set_requires_gradient_sync(False)
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(reshard_after_forward)


def counts_in_norm(hierarchy: Hierarchy | None) -> bool:
    """Whether this replica's gradient shards count in the global norm: under HSDP the replicas of other nodes
    hold the same shard, so node 0's alone count it."""
    return hierarchy is None or hierarchy.nodes == 1 or hierarchy.node == 0


class FullyShardedReducer:
    """A position's gradient reduction under zero=3 (the interface of `pipetrain.comm.replicas.StageReducer`):
    one reduce-scatter per stage module at REDUCE; each replica steps its shards, so it owns every parameter
    its optimizer holds and gathers nothing after the step (the next forward all-gathers)."""

    def __init__(self, stages: list[StageRuntime], counter: CommCounter, reshard_after_forward: bool):
        self.modules = [s.module for s in stages if isinstance(s.module, FSDPModule)]
        self.stage = stages[0].index
        self.counter = counter
        self.reshard_after_forward = reshard_after_forward
        # What the reduction averages: the unsharded gradients, as for the other levels.
        self.payload = sum(p.numel() * p.element_size() for m in self.modules for p in m.parameters() if p.requires_grad)
        self.reducer = None  # no bucketed reducer of pipetrain's own (Pipeline.gradient_reducer)

    def before_backward(self, final: bool) -> None:
        """Nothing to prepare: FSDP2 reduces at `reduce`, after the stage's last backward."""

    def reduce(self, t: int) -> None:
        """After the position's last backward of mini-batch ``t``: reduce-scatter every stage's gradients into
        the replicas' shards (averaged over them) and free the unsharded parameters and gradients."""
        for module in self.modules:
            module.set_is_last_backward(True)
            module.set_reshard_after_backward(True)
            module.set_requires_gradient_sync(True)
            state = fully_shard.state(module)
            for group in _param_groups(module):
                group.post_backward()
            # What autograd's end-of-backward callback does when FSDP2 drives the backward itself.
            state._root_post_backward_final_callback()
            _accumulate(module, self.reshard_after_forward)
        if self.modules:
            self.counter.add("data_parallel", self.stage, self.payload)

    def stepped(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, itself) for each parameter with a gradient: every replica steps its own shard of each
        (OptimizerStep's Shards protocol)."""
        return [(p, p) for m in self.modules for p in m.parameters() if p.grad is not None]

    def gather(self) -> None:
        """Nothing: the next forward all-gathers the stepped shards."""

    def share_updates(self) -> None:
        """Nothing: zero=3 runs no predicting staleness policy (async-1f1b is refused)."""

    def close(self) -> None:
        """FSDP2's hooks live on the stage modules, which end with the pipeline."""

    def abandon(self) -> None:
        """A step raised: drop the unsharded parameters and the gradients accumulated for it (all replicas
        abandon the same step; the stage runtime clears the sharded gradients)."""
        for module in self.modules:
            for group in _param_groups(module):
                for param in group.fsdp_params:
                    if hasattr(param, "_unsharded_param"):  # made at the first all-gather
                        param._unsharded_param.grad = None
                    param.sharded_param.grad = None
            module.reshard()
            _accumulate(module, self.reshard_after_forward)


def _param_groups(module: FSDPModule) -> list:
    """The FSDP2 parameter groups of ``module`` and of the modules sharded inside it."""
    return [group for inner in fully_shard.state(module)._state_ctx.all_states for group in inner._fsdp_param_groups]

"""What a checkpoint saves and restores of a running pipeline: its parts seen as a ``PipelineView``."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from pipetrain.assembly import Parts
from pipetrain.checkpoint.optimizer_state import merge_optimizer_shares
from pipetrain.checkpoint.view import CheckpointRole, PipelineView, StageState, agree_alone
from pipetrain.comm.peers import peers_answer
from pipetrain.runtime.local_shards import is_dtensor, local, whole


def pipeline_view(parts: Parts, updates: int, streaming: bool) -> PipelineView:
    """What a checkpoint saves and restores of the pipeline made of ``parts``, after ``updates`` steps."""
    stages = {v: StageState(rt.module, rt.optimizer, rt.policy,
                            parts.steppers[parts.topology.position_of(v)].scaler, rt.schedulers)
              for v, rt in sorted(parts.stages.items())}
    world = parts.engine.world
    if world is None:
        role = CheckpointRole(True, True, "local", agree_alone, streaming, 0)
    else:
        merge = None
        if parts.options.zero and world.tensor_parallel > 1 and parts.options.zero < 3:
            merge = _merge_blocks_over(world.data_parallel_group, world.lane, parts)
        elif parts.options.zero:  # zero=3 with tensor parallelism too: its DTensors are gathered over both dimensions
            merge = _merge_over(world.data_parallel_group, parts.options.zero)
        elif world.tensor_parallel > 1:
            merge = _merge_lanes(world.lane)
        role = CheckpointRole(world.replica == 0 and world.lane == 0, world.rank == 0, "distributed",
                              parts.engine.consensus.decide, streaming, world.rank, merge)
    return PipelineView(parts.plan, parts.options, updates, stages, role, parts.pretrained)


def _each_state_value(share: dict, value: Callable[[str, Any], Any]) -> dict:
    """``share`` with each per-parameter optimizer state value t (of parameter ``name``) replaced by
    ``value(name, t)`` for tensors (step counts that are numbers kept)."""
    return {**share, "state": {name: {k: value(name, t) if isinstance(t, torch.Tensor) else t for k, t in state.items()}
                               for name, state in share["state"].items()}}


def _merge_lanes(lane: int) -> Callable[[dict], dict | None]:
    """Tensor-parallel checkpoints: each lane holds its blocks of the split tensors' optimizer state, all-gathered
    whole (every lane takes part) onto lane 0, which writes the stage."""
    def merge(share: dict) -> dict | None:
        whole_share = _each_state_value(share, lambda name, t: whole(t))
        return whole_share if lane == 0 else None
    return merge


def _merge_blocks_over(group: dist.ProcessGroup, lane: int, parts: Parts) -> Callable[[dict], dict | None]:
    """ZeRO 1/2 with tensor parallelism: each lane's replicas hold slices of its blocks (or, for an optimizer
    stepping whole tensors, whole blocks): merged into the lane's blocks on replica 0, whose lanes then all-gather
    the blocks of the split tensors whole onto lane 0, which writes the stage."""
    params = {name: p for rt in parts.stages.values() for name, p in rt.module.named_parameters(remove_duplicate=False)}
    over_replicas = _merge_over(group, 1)

    def joined(name: str, t: Any) -> Any:
        p = params.get(name)
        if not is_dtensor(p) or t.shape != local(p).shape:
            return t  # a whole (unsplit) tensor's state, or a step count
        from torch.distributed.tensor import DTensor  # imported already: `p` is one

        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()).full_tensor()

    def merge(share: dict) -> dict | None:
        blocks = over_replicas(_each_state_value(share, lambda name, t: local(t)))
        if blocks is None:  # not replica 0: its shares are merged there
            return None
        whole_share = _each_state_value(blocks, joined)
        return whole_share if lane == 0 else None
    return merge


def _merge_over(group: dist.ProcessGroup, zero: int) -> Callable[[dict], dict | None]:
    """ZeRO checkpoints: gathers the replicas' optimizer shares onto replica 0 (group rank 0), merged; under
    zero=3 every replica holds a shard of every tensor, all-gathered whole."""
    def merge(share: dict) -> dict | None:
        if zero == 3:
            whole_share = _each_state_value(share, lambda name, t: whole(t))
            return whole_share if dist.get_rank(group) == 0 else None
        shares = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
        with peers_answer("save: the replicas' ZeRO optimizer shares gathered onto replica 0 (every rank saves)"):
            dist.gather_object(share, shares, group=group, group_dst=0)
        return merge_optimizer_shares(shares) if shares is not None else None
    return merge

"""What a checkpoint saves and restores of a running pipeline: its parts seen as a ``PipelineView``."""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from pipetrain.assembly import Parts
from pipetrain.checkpoint.optimizer_state import merge_optimizer_shares
from pipetrain.checkpoint.view import CheckpointRole, PipelineView, StageState, agree_alone
from pipetrain.comm.peers import peers_answer
from pipetrain.runtime.local_shards import whole


def pipeline_view(parts: Parts, updates: int, streaming: bool) -> PipelineView:
    """What a checkpoint saves and restores of the pipeline made of ``parts``, after ``updates`` steps."""
    stages = {v: StageState(rt.module, rt.optimizer, rt.policy,
                            parts.steppers[parts.topology.position_of(v)].scaler, rt.schedulers)
              for v, rt in sorted(parts.stages.items())}
    world = parts.engine.world
    if world is None:
        role = CheckpointRole(True, True, "local", agree_alone, streaming, 0)
    else:
        merge = _merge_over(world.data_parallel_group, parts.options.zero) if parts.options.zero else \
            _merge_lanes(world.lane) if world.tensor_parallel > 1 else None
        role = CheckpointRole(world.replica == 0 and world.lane == 0, world.rank == 0, "distributed",
                              parts.engine.consensus.decide, streaming, world.rank, merge)
    return PipelineView(parts.plan, parts.options, updates, stages, role, parts.pretrained)


def _merge_lanes(lane: int) -> Callable[[dict], dict | None]:
    """Tensor-parallel checkpoints: each lane holds its blocks of the split tensors' optimizer state, all-gathered
    whole (every lane takes part) onto lane 0, which writes the stage."""
    def merge(share: dict) -> dict | None:
        whole_share = {**share, "state": {name: {k: whole(t) for k, t in state.items()}
                                          for name, state in share["state"].items()}}
        return whole_share if lane == 0 else None
    return merge


def _merge_over(group: dist.ProcessGroup, zero: int) -> Callable[[dict], dict | None]:
    """ZeRO checkpoints: gathers the replicas' optimizer shares onto replica 0 (group rank 0), merged; under
    zero=3 every replica holds a shard of every tensor, all-gathered whole."""
    def merge(share: dict) -> dict | None:
        if zero == 3:
            whole_share = {**share, "state": {name: {k: whole(t) for k, t in state.items()}
                                              for name, state in share["state"].items()}}
            return whole_share if dist.get_rank(group) == 0 else None
        shares = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
        with peers_answer("save: the replicas' ZeRO optimizer shares gathered onto replica 0 (every rank saves)"):
            dist.gather_object(share, shares, group=group, group_dst=0)
        return merge_optimizer_shares(shares) if shares is not None else None
    return merge

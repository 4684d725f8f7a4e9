"""A tensor-parallel stage's parameters: each planned one cut into this rank's block, held as a DTensor.

The cut tensors are DTensors on the stage's tensor-parallel mesh (``Shard(dim)``), so what already reads sharded
parameters reads them too: checkpoints save them whole (`pipetrain.runtime.local_shards.whole`) and cut what they
load to the rank's block (``shard_like``), whatever T wrote them; norms and checks read the local blocks. The
stage's graph reads each through ``to_local()``, whose gradient arrives as a DTensor of the same placement.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from pipetrain.tensor_parallel.placement import ParameterSplit


def lanes_mesh(group: dist.ProcessGroup, device: torch.device) -> DeviceMesh:
    """The one-dimensional DeviceMesh of a stage's tensor-parallel ranks. Its dimension is named after the group:
    DTensor's caches key meshes by ranks and names, and a closed pipeline's groups must not be found again."""
    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, device.type, mesh=ranks, mesh_dim_names=(f"tensor-{group.group_name}",))


def cut_parameters(module: nn.Module, splits: dict[str, ParameterSplit], mesh: DeviceMesh) -> None:
    """Replace each split parameter of ``module`` by this rank's block of it, a DTensor on ``mesh``, under every name it
    has (a tied one stays tied). Every rank holds the whole tensor and keeps its block: no communication."""
    aliases: dict[int, list[str]] = {}
    for alias, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(alias)
    for name, split in splits.items():
        if split.dim is None:
            continue
        whole = module.get_parameter(name)
        block = nn.Parameter(distribute_tensor(whole.detach(), mesh, [Shard(split.dim)], src_data_rank=None),
                             requires_grad=whole.requires_grad)
        for alias in aliases[id(whole)]:
            owner_name, _, attr = alias.rpartition(".")
            setattr(module.get_submodule(owner_name) if owner_name else module, attr, block)


def is_split(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor cut over a tensor-parallel mesh (not a ZeRO-3 shard)."""
    mesh = getattr(t, "device_mesh", None)
    return mesh is not None and any(name.startswith("tensor-") for name in (mesh.mesh_dim_names or ()))

"""Replicas of a stage start from the same tensors: replica 0's, as DistributedDataParallel does.

A model built without seeding every rank alike gives each replica other initial weights; the gradient
average would then train replicas that never meet, and a checkpoint (replica 0's) would drop what the
others learnt. When every replica read its tensors from the same source (``weights=``, or a meta-device
model each module initialises from ``seed``), a digest per stage is compared instead of sending them.
"""
from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _sync_module_states

from pipetrain.comm.peers import peers_answer

BUCKET_BYTES = 250 * 2 ** 20  # DDP's broadcast bucket at construction


def state_digest(module: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``module``'s parameters and buffers."""
    digest = hashlib.sha256()
    for name, t in module.state_dict(keep_vars=True).items():
        t = t.detach()
        digest.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        digest.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def start_replicas_equal(modules: dict[int, nn.Module], group: dist.ProcessGroup, same_source: bool) -> None:
    """Make this rank's stage ``modules`` equal to replica 0's (group rank 0 of ``group``, the replicas of
    this pipeline position). ``same_source``: compare digests first and send nothing when they agree."""
    with peers_answer("the replicas' initial weights (every replica of a stage takes replica 0's)"):
        if same_source:
            digests = [None] * dist.get_world_size(group)
            dist.all_gather_object(digests, {v: state_digest(m) for v, m in sorted(modules.items())}, group=group)
            if all(d == digests[0] for d in digests):
                return
            if dist.get_rank(group) == 0:
                warnings.warn("the replicas of a stage read different initial tensors from the same source (a "
                              "weights= file that differs between machines?); every replica now starts from "
                              "replica 0's", stacklevel=2)
        for v, module in sorted(modules.items()):
            _sync_module_states(module, group, BUCKET_BYTES, src=0, params_and_buffers_to_ignore=())


def check_replicas_read_alike(digests: dict[int, str], group: dist.ProcessGroup) -> None:
    """A sharded build of a model without data (zero=3, tensor parallelism): every rank of ``group`` made only its own
    shards, so none holds another's to send; the digests of the whole tensors each read
    (``StageTensors.materialise_shards``) must agree instead."""
    with peers_answer("the replicas' initial weights (digests of the whole tensors each replica read)"):
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digests, group=group)
    if any(d != gathered[0] for d in gathered):
        raise RuntimeError("the replicas of a stage read different initial tensors from the same source (a weights= "
                           "file that differs between machines?), and a sharded build (zero=3, tensor_parallel) "
                           "keeps no whole copy to send them: give every machine the same checkpoint")

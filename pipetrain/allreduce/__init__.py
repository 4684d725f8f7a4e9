"""Gradient all-reduce for data parallelism: fused buckets, flat or hierarchical.

A standalone library over torch.distributed: `GradientReducer` packs gradients into buckets
(`buckets`), reduces them with a flat ring or intra-node / inter-node / intra-node steps
(`algorithms`, over the groups of `hierarchy`), optionally while the backward still runs.
`ShardedReducer` is its ZeRO form (`sharded`): each replica owns an even range of every bucket and an
elementwise optimizer steps flat slices of the tensors in it (`slices`), or for other optimizers whole
tensors (`sharding`); gradients are reduce-scattered and the stepped ranges all-gathered. It imports
nothing else of pipetrain.
"""
from pipetrain.allreduce.reducer import ALGORITHMS, MiB, GradientReducer
from pipetrain.allreduce.sharded import ShardedReducer
from pipetrain.allreduce.sharding import shard_owners
from pipetrain.allreduce.slices import shards_evenly, step_slices

__all__ = ["ALGORITHMS", "GradientReducer", "MiB", "ShardedReducer", "shard_owners", "shards_evenly", "step_slices"]

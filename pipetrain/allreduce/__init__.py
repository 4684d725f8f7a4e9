"""Gradient all-reduce for data parallelism: fused buckets, flat or hierarchical.

A standalone library over torch.distributed: `GradientReducer` packs gradients into buckets
(`buckets`), reduces them with a flat ring or intra-node / inter-node / intra-node steps
(`algorithms`, over the groups of `hierarchy`), optionally while the backward still runs.
`ShardedReducer` is its ZeRO form: whole tensors owned per replica (`sharding`), gradients
reduce-scattered and the stepped tensors all-gathered (`sharded`). It imports nothing else of pipetrain.
"""
from pipetrain.allreduce.reducer import ALGORITHMS, MiB, GradientReducer
from pipetrain.allreduce.sharded import ShardedReducer
from pipetrain.allreduce.sharding import shard_owners

__all__ = ["ALGORITHMS", "GradientReducer", "MiB", "ShardedReducer", "shard_owners"]

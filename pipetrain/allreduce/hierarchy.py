"""Process groups for two-level (intra-node / inter-node) gradient reduction.

`torch.distributed.new_group` is collective over the default group: every
rank must create the same groups in the same order, even groups it is not a
member of. So all hierarchy groups are built up front here, by every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Hierarchy:
    """This rank's view of a (nodes x per_node) layout of one data-parallel group.

    `intra_reduce` and `intra_gather` hold the same ranks (this rank's node);
    they are separate groups so that reduce-scatters and all-gathers of
    different buckets, issued at times that differ between ranks, never
    interleave on one communicator. `inter` links the ranks with this rank's
    local index on every node. Groups of size 1 are None.
    """

    nodes: int
    per_node: int
    node: int
    local_rank: int
    intra_reduce: dist.ProcessGroup | None
    intra_gather: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


def _node_lists_from_env(ranks: list[int]) -> list[list[int]]:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        raise ValueError(
            "hierarchy unknown: LOCAL_WORLD_SIZE is not set (launch with torchrun); "
            "pass nodes and per_node explicitly"
        )
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // int(local), []).append(r)
    return [by_node[n] for n in sorted(by_node)]


def build_hierarchy_groups(
    group_ranks: Sequence[int], nodes: int | None = None, per_node: int | None = None,
    timeout: timedelta | None = None,
) -> Hierarchy | None:
    """Create the hierarchy groups of the data-parallel group `group_ranks`.

    Call on EVERY rank of the default group, with the same arguments, in the
    same order (e.g. once per data-parallel group in hybrid pipeline mode);
    returns the Hierarchy on members of `group_ranks` and None elsewhere.
    With `nodes`/`per_node` given, node n holds ``sorted(group_ranks)[n*per_node:(n+1)*per_node]``
    (so one machine can emulate several nodes); otherwise nodes come from
    LOCAL_WORLD_SIZE (torchrun: node = global rank // LOCAL_WORLD_SIZE).
    """
    ranks = sorted(group_ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"build_hierarchy_groups: duplicate ranks in {list(group_ranks)}")
    if nodes is None and per_node is None:
        node_lists = _node_lists_from_env(ranks)
    else:
        if nodes is None or per_node is None or nodes * per_node != len(ranks):
            raise ValueError(
                f"build_hierarchy_groups: nodes x per_node = {nodes} x {per_node} must equal the group size "
                f"{len(ranks)}; give both"
            )
        node_lists = [ranks[n * per_node : (n + 1) * per_node] for n in range(nodes)]
    sizes = {len(members) for members in node_lists}
    if len(sizes) != 1:
        raise ValueError(
            f"build_hierarchy_groups: every node must hold the same number of group ranks, got {node_lists}; "
            "use algorithm='flat' for irregular layouts"
        )
    per = sizes.pop()
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup | None] = {"intra_reduce": None, "intra_gather": None, "inter": None}
    node = local_rank = -1
    for n, members in enumerate(node_lists):
        reduce_group = dist.new_group(members, timeout=timeout) if per > 1 else None
        gather_group = dist.new_group(members, timeout=timeout) if per > 1 else None
        if me in members:
            node, local_rank = n, members.index(me)
            mine["intra_reduce"], mine["intra_gather"] = reduce_group, gather_group
    for local in range(per):
        members = [node_lists[n][local] for n in range(len(node_lists))]
        inter_group = dist.new_group(members, timeout=timeout) if len(node_lists) > 1 else None
        if me in members:
            mine["inter"] = inter_group
    if node < 0:
        return None
    return Hierarchy(len(node_lists), per, node, local_rank, **mine)

"""Keeping tied parameters equal when their copies live on different stages.

Each copy's gradient is replaced by the sum over all copies before the optimizer step,
so identical copies with identical optimizer state stay identical.
"""
from __future__ import annotations

import functools
import operator
from typing import Iterator

import torch
import torch.distributed as dist

from pipetrain.comm import recording
from pipetrain.comm.peers import peers_answer
from pipetrain.runtime.local_shards import is_dtensor, local as local_shard
from pipetrain.runtime.progress import BLOCKED
from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.stage import StageRuntime


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


class LocalTiedSync:
    """All stages in one process: the step of a position waits until every copy's gradient is in."""

    def __init__(self, tied: list[list[tuple[int, str]]], runtimes: dict[int, StageRuntime], counter: CommCounter):
        self.tied = tied
        self.runtimes = runtimes
        self.counter = counter
        self.deposits: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        self.totals: dict[tuple[int, int], list] = {}  # (group, step) -> [sum, copies not yet served]

    def sync(self, stages: list[int], t: int) -> Iterator[str]:
        mine = [(i, [(s, n) for s, n in copies if s in stages]) for i, copies in enumerate(self.tied)]
        mine = [(i, c) for i, c in mine if c]
        for i, copies in mine:
            box = self.deposits.setdefault((i, t), {})
            for s, name in copies:
                box[s] = _grad(self.runtimes[s].module.get_parameter(name)).clone()
                self.counter.add("tied_grads", s, box[s].numel() * box[s].element_size())
        for i, copies in mine:
            key = (i, t)
            while key not in self.totals and len(self.deposits[key]) < len(self.tied[i]):
                yield BLOCKED
            if key not in self.totals:
                box = self.deposits.pop(key)
                # Sum in stage order (the order the two-rank all_reduce of the distributed engine adds in),
                # on the first copy's device: with several devices the copies live on different ones.
                first = box[min(box)].device
                total = functools.reduce(operator.add, [box[s].to(first) for s in sorted(box)])
                self.totals[key] = [total, len(self.tied[i])]
            entry = self.totals[key]
            for s, name in copies:
                param = self.runtimes[s].module.get_parameter(name)
                param.grad = entry[0].to(param.device, copy=True)
            entry[1] -= len(copies)
            if entry[1] == 0:
                del self.totals[key]

    def abandon(self) -> None:
        """A step raised: drop the gradients deposited for it."""
        self.deposits.clear()
        self.totals.clear()


class DistributedTiedSync:
    """Copies on several ranks: one all_reduce (sum) per tied parameter over its owners."""

    def __init__(self, tied: list[list[tuple[int, str]]], runtimes: dict[int, StageRuntime],
                 groups: dict[int, object], counter: CommCounter):
        self.tied = tied
        self.runtimes = runtimes
        self.groups = groups
        self.counter = counter
        self.recorder = recording.active()  # None unless a test records what is posted

    def abandon(self) -> None:
        """Nothing is kept between steps."""

    def sync(self, stages: list[int], t: int) -> Iterator[str]:
        for i, copies in enumerate(self.tied):
            local = [(s, n) for s, n in copies if s in stages]
            if not local:
                continue
            params = [self.runtimes[s].module.get_parameter(n) for s, n in local]
            # zero=3: every copy is sharded alike over its stage's replicas, so the group of this replica's ranks
            # sums the same shard of each.
            total = functools.reduce(operator.add, [local_shard(_grad(p)) for p in params]).clone()
            if i in self.groups:
                if self.recorder is not None:
                    self.recorder.collective(("tied", i), dist.get_process_group_ranks(self.groups[i]), dist.get_rank())
                with peers_answer(f"the gradient sum of tied parameter {copies[0][1]!r} over the stages holding it"):
                    dist.all_reduce(total, group=self.groups[i])
                self.counter.add("tied_grads", local[0][0], total.numel() * total.element_size())
            for p in params:
                if is_dtensor(p):
                    p.grad = _grad(p)
                    local_shard(p.grad).copy_(total)
                else:
                    p.grad = total.clone()
        return iter(())

"""The STEP action: make tied copies agree, unscale (fp16), decide skip-or-step everywhere, step.

Every device runs this at its STEP of mini-batch t. The decisions that need more than one
device (tied gradients, fp16 overflow) are made by an agreement object: in one process the
devices wait for each other inside the executor loop; across processes it is a collective.
"""
from __future__ import annotations

from typing import Iterator

import torch.distributed as dist

from pipetrain.executor import BLOCKED
from pipetrain.precision import DynamicLossScaler
from pipetrain.stage import StageRuntime


class LocalOverflowAgreement:
    """All devices in one process: the step of mini-batch t waits until every device reported."""

    def __init__(self, devices: int):
        self.devices = devices
        self.flags: dict[int, list[bool]] = {}
        self.read: dict[int, int] = {}

    def agree(self, t: int, found_inf: bool) -> Iterator[str]:
        flags = self.flags.setdefault(t, [])
        flags.append(found_inf)
        while len(self.flags[t]) < self.devices:
            yield BLOCKED
        decision = any(self.flags[t])
        self.read[t] = self.read.get(t, 0) + 1
        if self.read[t] == self.devices:
            del self.flags[t], self.read[t]
        return decision


class DistributedOverflowAgreement:
    """The scaler's own all-reduce (MAX) over every rank already agreed; nothing to add."""

    def agree(self, t: int, found_inf: bool) -> Iterator[str]:
        yield from ()
        return found_inf


class OptimizerStep:
    """What one device does at STEP t for all of its stages."""

    def __init__(self, stages: list[StageRuntime], tied, scaler: DynamicLossScaler | None, agreement):
        self.stages = stages
        self.indices = [s.index for s in stages]
        self.tied = tied
        self.scaler = scaler
        self.agreement = agreement
        self.skipped: list[int] = []  # which of this device's steps (0-based, over its lifetime) overflowed
        self.steps_seen = 0

    def __call__(self, t: int) -> Iterator[str]:
        yield from self.tied.sync(self.indices, t)
        found_inf = False
        if self.scaler is not None:
            params = [p for s in self.stages for p in s.module.parameters() if p.grad is not None]
            found_inf = self.scaler.unscale_(params)
            found_inf = yield from self.agreement.agree(t, found_inf)
            self.scaler.update(found_inf)
        if found_inf:
            self.skipped.append(self.steps_seen)
        self.steps_seen += 1
        for s in self.stages:
            if s.optimizer is not None:
                if not found_inf:
                    s.optimizer.step()
                s.optimizer.zero_grad(set_to_none=True)
            if not found_inf:
                s.policy.on_step()


def make_scaler(precision: str, distributed: bool) -> DynamicLossScaler | None:
    """fp16 needs loss scaling; in one process the scaler must not look for a process group."""
    if precision != "fp16":
        return None
    return DynamicLossScaler(groups=None if distributed and dist.is_initialized() else [])

"""The STEP action: make tied copies agree, unscale (fp16), decide skip-or-step everywhere, step.

Every device runs this at its STEP of mini-batch t. The decisions that need more than one
device (tied gradients, fp16 overflow) are made by objects the engine gives it
(pipetrain.comm): in one process the devices wait for each other inside the executor loop;
across processes it is a collective.
"""
from __future__ import annotations

from typing import Iterator, Protocol

from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.stage import StageRuntime


class TiedSync(Protocol):
    """Makes the copies of tied parameters agree before the step (pipetrain.comm.tied)."""

    def sync(self, stages: list[int], t: int) -> Iterator[str]: ...


class OverflowAgreement(Protocol):
    """Makes every device take the same skip-or-step decision (pipetrain.comm.overflow)."""

    def agree(self, t: int, found_inf: bool) -> Iterator[str]: ...


class OptimizerStep:
    """What one device does at STEP t for all of its stages."""

    def __init__(self, stages: list[StageRuntime], tied: TiedSync, scaler: DynamicLossScaler | None,
                 agreement: OverflowAgreement):
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

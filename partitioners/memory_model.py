"""The predicted peak memory of each stage of a split, and which recomputation setting fits a limit.

A stage of P parameter bytes holds its weights, their optimizer state (``state_per_param_byte`` x P:
1 for SGD with momentum, 2 for Adam; divided by the replicas sharing it under ZeRO) and its extra
weight versions (``weight_versions[k]`` x P: stashing, 2BW, SpecTrain), and on top of that, at the moments the schedule makes its held bytes
peak, its gradients (P, absent until the step's first backward) and the activations it holds: a
micro-batch kept whole costs its activation bytes, one that will be recomputed its boundary bytes
(chain.py). The moments come from the action lists (``schedules.held_activations.held_activations``), as
(whole, boundary-only, gradients present) counts per recomputation setting.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from schedules.held_activations import RECOMPUTE

SETTINGS = RECOMPUTE  # cheapest (no recomputation) first

Moments = list[tuple[int, int, int]]


@dataclass(frozen=True)
class MemoryModel:
    """Per stage and recomputation setting, the moments its held bytes may peak; plus the resident
    state. ``recompute`` is a setting for every stage, or "auto": per stage the cheapest that fits."""

    moments: dict[str, list[Moments]]  # setting -> per stage
    state_per_param_byte: float = 1.0
    weight_versions: tuple[float, ...] | None = None
    recompute: str = "none"

    def stage_bytes(self, k: int, setting: str, params, activations, boundary):
        """Predicted peak bytes of stage k (numpy arrays or floats broadcast together)."""
        versions = self.weight_versions[k] if self.weight_versions is not None else 0.0
        resident = params * (1.0 + self.state_per_param_byte + versions)
        held = [w * activations + b * boundary + g * params for w, b, g in self.moments[setting][k]]
        return resident + (np.maximum.reduce(held) if held else 0.0)

    def settings(self) -> tuple[str, ...]:
        """The recomputation settings the planner may use."""
        return SETTINGS if self.recompute == "auto" else (self.recompute,)

    def least_bytes(self, k: int, params, activations, boundary):
        """The smallest predicted peak of stage k over the allowed settings (what must fit a limit)."""
        return np.minimum.reduce([self.stage_bytes(k, s, params, activations, boundary) for s in self.settings()])

    def choose(self, k: int, params: float, activations: float, boundary: float,
               limit: float | None) -> tuple[str, float]:
        """The cheapest allowed setting of stage k that fits ``limit`` (the most frugal one when none
        does) and its predicted peak."""
        options = [(s, float(self.stage_bytes(k, s, params, activations, boundary))) for s in self.settings()]
        for setting, peak in options:
            if limit is None or peak <= limit:
                return setting, peak
        return min(options, key=lambda o: o[1])

"""Mixed-precision policy and the fp16 dynamic loss scaler.

The scaler keeps the scale and decides nothing alone: each position reports its found-inf flag
(``unscale_local_``) to the skip-or-step agreement (pipetrain/comm/overflow_agreement.py), the one
all-reduce per step that also carries the non-finite checks of every precision, and every position
then calls ``update`` with the agreed decision. So every rank of every stage and replica skips
the same steps and keeps the same scale. (torch.amp.GradScaler decides per process, hence this
small scaler.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.runtime.local_shards import local_grads
from pipetrain.runtime.nonfinite import check_and_unscale_


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a precision name means for the runtime.

    `autocast_dtype`: compute dtype under autocast (None: plain fp32); the capture and the stages
    run under it. Parameters and optimizer state stay fp32 in every policy, and values cross stage
    boundaries in the dtype autocast gave them (pipetrain/runtime/executor.py).
    """

    name: str
    autocast_dtype: torch.dtype | None


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", None),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16),
    "fp16": PrecisionPolicy("fp16", torch.float16),
}


PRECISIONS = tuple(_POLICIES)


def precision_policy(name: str) -> PrecisionPolicy:
    """The policy for "fp32" | "bf16" | "fp16"."""
    if name not in _POLICIES:
        raise ValueError(f"unknown precision {name!r}; choose one of {sorted(_POLICIES)}")
    return _POLICIES[name]


class DynamicLossScaler:
    """Loss scaling for fp16; the overflow decision is the skip-or-step agreement's.

    Once per mini-batch at every position: the last stage's backward starts from the loss times
    ``scale_value`` (gradients sent back to earlier stages then carry the same scale);
    ``unscale_local_`` divides the position's gradients by it and returns its found-inf flag; the
    agreement maximises the flags over every position; ``update`` with the agreed decision backs
    the scale off or grows it, the same everywhere.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0 or growth_interval < 1:
            raise ValueError(
                "DynamicLossScaler: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, "
                f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # consecutive steps without overflow

    def unscale_local_(self, params: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """Divide the gradients of `params` by the scale in place; return this process's found-inf flag
        as a one-element tensor (on `device`, default the first gradient's), for the agreement."""
        grads = local_grads(params)
        if device is None:
            device = grads[0].device if grads else torch.device("cpu")
        return check_and_unscale_(grads, 1.0 / self.scale_value, device)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after `growth_interval` clean steps in a row."""
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale_value,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "good_steps": self.good_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self.good_steps = state["good_steps"]

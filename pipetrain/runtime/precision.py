"""Mixed-precision policy and a dynamic loss scaler that agrees across ranks.

In a pipeline every stage holds a slice of the gradients, and in hybrid mode
every replica too. If one stage overflows and skips its step while another
stage steps, the model is torn; so the overflow decision of
`DynamicLossScaler` is an all-reduce (MAX) of the found-inf flag over the
given process groups, and every rank skips the same steps and keeps the same
scale. (torch.amp.GradScaler decides per process, hence this small scaler.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.nonfinite import check_and_unscale_


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a precision name means for the runtime.

    `autocast_dtype`: compute dtype under autocast (None: plain fp32).
    `activation_dtype`: dtype of activations and activation-gradients sent
    between stages. `needs_loss_scaling`: fp16 gradients underflow without it.
    Parameters and optimizer state stay fp32 in every policy.
    """

    name: str
    autocast_dtype: torch.dtype | None
    activation_dtype: torch.dtype
    needs_loss_scaling: bool

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Autocast context for `device_type` ("cpu", "cuda"); a no-op for fp32."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", None, torch.float32, False),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16, torch.bfloat16, False),
    "fp16": PrecisionPolicy("fp16", torch.float16, torch.float16, True),
}


def precision_policy(name: str) -> PrecisionPolicy:
    """The policy for "fp32" | "bf16" | "fp16"."""
    if name not in _POLICIES:
        raise ValueError(f"unknown precision {name!r}; choose one of {sorted(_POLICIES)}")
    return _POLICIES[name]


Group = dist.ProcessGroup | None


class DynamicLossScaler:
    """Loss scaling for fp16 with a cross-rank overflow decision.

    Usage on every rank (every stage, every replica), once per mini-batch::

        loss = scaler.scale(loss)        # on the last stage only; gradients sent back
                                         # to earlier stages then carry the same scale
        ...backwards, data-parallel gradient reduction...
        found_inf = scaler.unscale_(stage_params)  # agreed: True on all ranks or on none
        if not found_inf:
            optimizer.step()
        scaler.update(found_inf)             # same decision, so the same scale everywhere

    or ``stepped = scaler.step(optimizer)`` for the three lines above.

    `groups`: process groups whose ranks must agree; the flag is all-reduced
    (MAX) over each in turn, so e.g. ``[pipeline_group, data_parallel_group]``
    reaches every rank of a stages x replicas grid. None: the default group
    when torch.distributed is initialised, else this process alone.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        groups: Sequence[Group] | None = None,
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
        self.groups = groups
        self.good_steps = 0  # consecutive steps without overflow

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current scale (backward this instead of the loss)."""
        return loss * self.scale_value

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients of `params` by the scale in place; return the AGREED found_inf.

        Collective over `groups`: every rank must call it once per step.
        """
        found = self.unscale_local_(params)
        for group in self._agreement_groups():
            if dist.get_backend(group) == "nccl" and found.device.type == "cpu":
                found = found.cuda()  # a rank without gradients still joins; NCCL needs a device tensor
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        return bool(found.item() > 0)

    def unscale_local_(self, params: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """`unscale_` without the agreement: this process's found-inf flag as a one-element tensor (on
        `device`, default the first gradient's). For callers that agree on it together with other
        flags in one collective of their own (the pipeline runtime)."""
        grads = [p.grad for p in params if p.grad is not None]
        if device is None:
            device = grads[0].device if grads else torch.device("cpu")
        return check_and_unscale_(grads, 1.0 / self.scale_value, device)

    def _agreement_groups(self) -> Sequence[Group]:
        if self.groups is not None:
            return self.groups
        return [None] if dist.is_available() and dist.is_initialized() else []

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

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the optimizer's gradients, step unless any rank overflowed, update; True if stepped."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

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

"""Finding non-finite gradients and losses cheaply, and the error that says what to do about them.

The check is the fused kernel torch's GradScaler uses (one call per device and dtype over all
gradients of a step); with inv_scale 1.0 it only looks. The decision itself (skip or raise) must be
the same on every stage and replica, so the runtime turns the local finding into a small code that
the engine's agreement maximises over every position (pipetrain.comm.overflow_agreement):

    code[0] = positions - (first position whose gradients are not finite), 0 when none
    code[1] = positions - (first position whose losses are not finite), 0 when none

so the agreed code says both whether and where (the lowest position) it happened.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from pipetrain.runtime.local_shards import local

NONFINITE = ("raise", "skip")


class NonFiniteError(FloatingPointError):
    """A loss or gradient was NaN or infinite at an optimizer step (``nonfinite="raise"``)."""


def check_and_unscale_(grads: Iterable[torch.Tensor], inv_scale: float, device: torch.device) -> torch.Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place (1.0: leave them) and return a one-element float
    tensor on ``device``: 1 if any of them holds a NaN or an infinity, else 0. One fused call per
    (device, dtype) group, as torch.amp.GradScaler does; no host synchronisation."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    found = torch.zeros(1, device=device)
    for (dev, _), group in groups.items():
        flag = torch.zeros(1, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, torch.full((1,), inv_scale, device=dev))
        found = torch.maximum(found, flag.to(device))
    return found


def losses_nonfinite(losses: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1 (as a one-element float tensor on ``device``) if any of ``losses`` is NaN or infinite, else 0."""
    if not losses:
        return torch.zeros(1, device=device)
    first = losses[0]
    if all(l.dtype == first.dtype and l.device == first.device and l.dim() == 0 for l in losses):
        values = torch.stack([l.detach() for l in losses]).to(device)  # the usual case: one stack, one copy
    else:
        values = torch.stack([l.detach().float().reshape(()).to(device) for l in losses])
    return (~torch.isfinite(values).all()).float().reshape(1)


def first_nonfinite(modules: Iterable[tuple[int, nn.Module]]) -> tuple[int, str] | None:
    """(stage, parameter name) of the first parameter whose gradient is not finite, in stage and
    parameter order; names are the original model's (stage modules keep them). Only called after a
    step was found bad, so its cost does not matter."""
    for stage, module in modules:
        for name, p in module.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(local(p.grad)).all()):
                return stage, name
    return None


def advice(precision: str) -> str:
    """What to try, for a message about a non-finite loss or gradient."""
    hints = ["lower the learning rate (or add warm-up / gradient clipping)",
             "check the data of this mini-batch for NaN/inf or out-of-range targets",
             "or pass nonfinite='skip' to skip such updates on every stage and keep training"]
    if precision == "bf16":
        hints.append("bf16 has fp32's range, so precision rarely causes this: if precision='fp32' "
                     "trains, look for an operation that loses too much with 8 bits of mantissa")
    elif precision == "fp16":
        hints.append("in fp16 a non-finite gradient is a loss-scale overflow and is skipped anyway; "
                     "a non-finite loss means the forward overflowed fp16's range (65504): use "
                     "precision='bf16' (fp32's range) or 'fp32'")
    else:
        hints.append("bf16/fp16 would only make this likelier")
    return "; ".join(hints)

"""Large-batch learning-rate schedules: linear scaling, warm-up, polynomial or cosine decay.

Goyal et al. (2017): scale the learning rate linearly with the batch size and
ramp it up linearly over the first steps; You et al. (LARS) decay it with a
polynomial of power 2 afterwards, as Jia et al. (2018) do; language models
decay on a cosine instead. The schedulers are `LambdaLR`s, so they save/load
and step like any torch scheduler (call ``scheduler.step()`` once per
optimizer step).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def linear_scaling_rule(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """Learning rate for `batch_size` given `base_lr` tuned at `base_batch_size`."""
    if batch_size <= 0 or base_batch_size <= 0:
        raise ValueError(f"linear_scaling_rule: batch sizes must be > 0, got {batch_size} and {base_batch_size}")
    return base_lr * batch_size / base_batch_size


def warmup_factor(step: int, warmup_steps: int, start_factor: float) -> float:
    """Multiplier at `step`: linear from `start_factor` (step 0) to 1 (step `warmup_steps`), then 1."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    return start_factor + (1.0 - start_factor) * step / warmup_steps


def poly_factor(step: int, total_steps: int, power: float = 2.0, end_factor: float = 0.0) -> float:
    """Multiplier at `step`: ``end + (1 - end) * (1 - step / total) ** power``, `end_factor` after `total_steps`."""
    if step >= total_steps:
        return end_factor
    return end_factor + (1.0 - end_factor) * (1.0 - step / total_steps) ** power


def _check(warmup_steps: int, start_factor: float) -> None:
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= start_factor <= 1.0:
        raise ValueError(f"start_factor must be in [0, 1], got {start_factor}")


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int, start_factor: float = 0.0) -> LambdaLR:
    """Goyal et al. gradual warm-up: lr grows linearly to the base lr over `warmup_steps`, then stays.

    Goyal et al. start at the small-batch rate, i.e. ``start_factor = base_batch / batch``.
    """
    _check(warmup_steps, start_factor)
    return LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps, start_factor))


def warmup_poly_decay(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    power: float = 2.0,
    start_factor: float = 0.0,
    end_factor: float = 0.0,
) -> LambdaLR:
    """Linear warm-up for `warmup_steps`, then polynomial decay to `end_factor` at `total_steps`."""
    _check(warmup_steps, start_factor)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"warmup_poly_decay: total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps}); "
            "lengthen training or shorten the warm-up"
        )
    decay_steps = total_steps - warmup_steps

    def factor(step: int) -> float:
        if step < warmup_steps:
            return warmup_factor(step, warmup_steps, start_factor)
        return poly_factor(step - warmup_steps, decay_steps, power, end_factor)

    return LambdaLR(optimizer, factor)


def warmup_cosine_decay(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int) -> LambdaLR:
    """Linear warm-up reaching the base lr at update `warmup_steps` (its first update already at
    ``1 / warmup_steps`` of it), then a cosine to 0 at `total_steps`: the language models' schedule."""
    _check(warmup_steps, 0.0)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))))

    return LambdaLR(optimizer, factor)

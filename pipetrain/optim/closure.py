"""The closure a ``torch.optim.Optimizer.step`` may take: the loss re-evaluated before the step."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What ``step(closure)`` returns: the closure's loss, evaluated with gradients enabled (steps run under
    ``torch.no_grad``), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

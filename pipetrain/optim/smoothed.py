"""The optimizer's smoothed update direction, which weight prediction extrapolates.

`smoothed_update(optimizer, param)` returns the direction ``v`` such that the
optimizer's next update is approximately ``W <- W - lr * v``. SpecTrain weight
prediction (``W_hat = W - s * lr * v``) reads it; it is defined for SGD with
momentum, Adam/AdamW, LARS, LAMB, Muon and a CombinedOptimizer of them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pipetrain.optim.combined import CombinedOptimizer
from pipetrain.optim.lamb import LAMB
from pipetrain.optim.lars import LARS
from pipetrain.optim.muon import muon_update


def _group_of(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise ValueError("smoothed_update: the parameter is not managed by this optimizer; pass a parameter from optimizer.param_groups")


_NO_SMOOTHED = (
    "has no smoothed update direction for weight prediction; use "
    "torch.optim.SGD(momentum > 0), torch.optim.Adam, torch.optim.AdamW, torch.optim.Muon, "
    "pipetrain.optim.LARS or pipetrain.optim.LAMB (or a pipetrain.optim.CombinedOptimizer of them), or choose staleness='stash' / 'vanilla' which need none"
)


def smoothed_update(optimizer: torch.optim.Optimizer, param: Tensor,
                    group: dict[str, Any] | None = None) -> Tensor | None:
    """Direction ``v`` with next update ``W <- W - lr * v`` (approximately).

    The estimate assumes the next gradient equals the optimizer's current
    running average (the stationarity assumption of SpecTrain/XPipe), which
    makes it exact for the parts the optimizer already knows:

    * SGD: the next buffer is ``momentum * buf + (1 - dampening) * d`` with ``d``
      estimated as ``buf * (1 - momentum) / (1 - dampening)``, i.e. ``buf``
      itself; with nesterov the update ``d + momentum * buf`` is again ``buf``.
      Weight decay (and ``maximize``, which negates the gradient) are folded
      into ``d`` by SGD, so they are already in ``buf``.
    * Adam/AdamW: ``m_hat / (sqrt(v_hat) + eps)`` with the bias corrections of
      the steps taken (amsgrad uses the running max of ``v``), plus
      ``weight_decay * W`` when the decay is decoupled (AdamW). L2 decay of
      Adam (and ``maximize``) are in ``m`` already.
    * LARS: its scaled momentum buffer.
    * LAMB: Adam's direction (decay added, 1-D tensors excluded) times its trust ratio at the current weights.
    * Muon: the orthogonalised momentum buffer, scaled and decayed as its step does (`muon.muon_update`).
    * CombinedOptimizer: the direction of the inner optimizer that steps ``param``.

    Returns None before the parameter's first step (no history yet; predict
    ``W_hat = W``). Raises TypeError for optimizers without a running
    average (e.g. SGD without momentum), naming the working choices.
    ``group``: the parameter's group when the caller knows it (saves a scan of every group).
    """
    if isinstance(optimizer, CombinedOptimizer):
        return smoothed_update(optimizer.optimizer_of(param), param, group)
    if isinstance(optimizer, torch.optim.Muon):
        group = group or _group_of(optimizer, param)
        return muon_update(param, optimizer.state[param] if param in optimizer.state else {}, group)
    if isinstance(optimizer, LARS):
        if group is None:
            _group_of(optimizer, param)
        return optimizer.smoothed_update(param)
    if isinstance(optimizer, LAMB):
        return optimizer.smoothed_update(param, group or _group_of(optimizer, param))
    if isinstance(optimizer, torch.optim.SGD):
        group = group or _group_of(optimizer, param)
        if group["momentum"] == 0:
            raise TypeError(f"torch.optim.SGD without momentum {_NO_SMOOTHED}")
        buf = optimizer.state[param].get("momentum_buffer") if param in optimizer.state else None
        if buf is None:
            return None
        return buf
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        group = group or _group_of(optimizer, param)
        state = optimizer.state[param] if param in optimizer.state else {}
        if "exp_avg" not in state:
            return None
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m_hat = state["exp_avg"] / (1 - beta1**step)
        second = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
        v_hat = second / (1 - beta2**step)
        direction = m_hat / (v_hat.sqrt() + group["eps"])
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        if decoupled and group["weight_decay"] != 0:
            direction = direction + group["weight_decay"] * param.detach()
        return direction
    raise TypeError(f"{type(optimizer).__name__} {_NO_SMOOTHED}")

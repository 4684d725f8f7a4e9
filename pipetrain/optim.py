"""LARS/LARC optimizer and the optimizer's smoothed update direction.

`LARS` is layer-wise adaptive rate scaling (You et al., 2017) with the
LARC clipping option (NVIDIA apex): each non-excluded parameter tensor gets
its own step size from the ratio of its weight norm to its gradient norm, so
very large batches can train with one global learning rate.

`smoothed_update(optimizer, param)` returns the direction ``v`` such that the
optimizer's next update is approximately ``W <- W - lr * v``. SpecTrain weight
prediction (``W_hat = W - s * lr * v``) and XPipe read it; it is defined for
SGD with momentum, Adam/AdamW and LARS.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


class LARS(torch.optim.Optimizer):
    """Momentum SGD whose per-tensor step is scaled by a trust ratio.

    For a parameter ``w`` with gradient ``g`` (per tensor):

    * ``trust = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)``,
      or 1 when ``||w||`` or ``||g||`` is 0 (a fresh zero-initialised tensor or
      an unused one must still move like plain SGD);
    * ``local = trust`` (LARS), or with ``clip=True`` ``local = min(trust / lr, 1)``
      (LARC "clip" mode: the adaptive rate never exceeds the global rate);
    * ``buf = momentum * buf + local * (g + weight_decay * w)`` (on the first
      step ``buf`` starts as the scaled gradient, like torch's SGD);
    * ``w <- w - lr * buf``.

    Excluded tensors get plain momentum SGD (``buf = momentum * buf + g + wd * w``,
    ``w <- w - lr * buf``): every tensor of a param group with
    ``lars_exclude=True`` (with that group's weight_decay), and, when
    ``exclude_1d`` is set (default), every 1-D tensor (biases, normalisation
    scales) with NO weight decay, the usual large-batch recipe.

    The momentum buffer lives in ``state[p]["momentum_buffer"]`` like SGD's and
    already includes the adaptive scaling, so `smoothed_update` returns it.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        clip: bool = False,
        exclude_1d: bool = True,
    ) -> None:
        if lr <= 0.0:
            raise ValueError(f"LARS: lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"LARS: weight_decay must be >= 0, got {weight_decay}")
        if trust_coefficient <= 0.0:
            raise ValueError(f"LARS: trust_coefficient must be > 0, got {trust_coefficient}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            clip=clip,
            exclude_1d=exclude_1d,
            lars_exclude=False,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimizer step (optionally re-evaluating the loss via closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = group["lr"]
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("LARS: sparse gradients are not supported; use dense embeddings")
                update = self._scaled_gradient(p, group)
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    state["momentum_buffer"] = update.clone()
                    buf = state["momentum_buffer"]
                else:
                    buf.mul_(momentum).add_(update)
                p.add_(buf, alpha=-lr)
        return loss

    def _scaled_gradient(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """The gradient (plus weight decay) times the local adaptive rate."""
        g = p.grad
        wd = group["weight_decay"]
        auto_excluded = group["exclude_1d"] and p.dim() == 1
        if auto_excluded:
            return g
        update = g.add(p, alpha=wd) if wd != 0 else g
        if group["lars_exclude"]:
            return update
        w_norm = torch.linalg.vector_norm(p)
        g_norm = torch.linalg.vector_norm(g)
        trust = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
        # torch.where keeps this free of host syncs on accelerators.
        trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
        if group["clip"]:
            trust = torch.clamp(trust / group["lr"], max=1.0)
        return update * trust

    def smoothed_update(self, param: Tensor) -> Tensor | None:
        """The scaled momentum buffer of `param` (None before its first step)."""
        return self.state[param].get("momentum_buffer") if param in self.state else None


def _group_of(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, Any]:
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return group
    raise ValueError("smoothed_update: the parameter is not managed by this optimizer; pass a parameter from optimizer.param_groups")


_NO_SMOOTHED = (
    "has no smoothed update direction for weight prediction; use "
    "torch.optim.SGD(momentum > 0), torch.optim.Adam, torch.optim.AdamW or "
    "pipetrain.optim.LARS, or choose staleness='stash' / 'vanilla' which need none"
)


def smoothed_update(optimizer: torch.optim.Optimizer, param: Tensor) -> Tensor | None:
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

    Returns None before the parameter's first step (no history yet; predict
    ``W_hat = W``). Raises TypeError for optimizers without a running
    average (e.g. SGD without momentum), naming the working choices.
    """
    if isinstance(optimizer, LARS):
        _group_of(optimizer, param)
        return optimizer.smoothed_update(param)
    if isinstance(optimizer, torch.optim.SGD):
        group = _group_of(optimizer, param)
        if group["momentum"] == 0:
            raise TypeError(f"torch.optim.SGD without momentum {_NO_SMOOTHED}")
        buf = optimizer.state[param].get("momentum_buffer") if param in optimizer.state else None
        if buf is None:
            return None
        return buf
    if isinstance(optimizer, torch.optim.Adam):  # AdamW subclasses Adam
        group = _group_of(optimizer, param)
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

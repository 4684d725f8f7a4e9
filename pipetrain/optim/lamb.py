"""LAMB optimizer.

`LAMB` is You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 Minutes"
(Algorithm 2): Adam's moments with their bias corrections, decoupled weight decay, and each tensor's step
rescaled by a trust ratio, so that one global learning rate trains at batches of 32K-64K.

Written here rather than taken from a package: the one installed (timm's ``Lamb``, a dev extra only) clips by
the gradient norm over all of the optimizer's parameters by default (a pipeline stage's, not the model's),
keeps one step count per group, and leaves 1-D tensors out of the adaptation only through groups without
weight decay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pipetrain.optim.closure import closure_loss
from pipetrain.optim.whole_norms import local_part, whole_norms


class LAMB(torch.optim.Optimizer):
    """Adam whose per-tensor step is scaled by ``||w|| / ||r||``.

    For a parameter ``w`` with gradient ``g`` at step ``t`` (per tensor):

    * ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g**2``;
    * ``r = m / (1 - beta1**t) / (sqrt(v / (1 - beta2**t)) + eps) + weight_decay * w``;
    * ``trust = ||w|| / ||r||`` (the paper's phi is the identity), or 1 when either norm is 0 (a fresh
      zero-initialised tensor must still move);
    * ``w <- w - lr * trust * r``.

    With ``exclude_1d`` (default) every 1-D tensor (biases, normalisation scales) gets plain Adam, without
    weight decay or trust ratio, as the BERT recipe excludes LayerNorm and bias.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        exclude_1d: bool = True,
    ) -> None:
        if lr <= 0.0:
            raise ValueError(f"LAMB: lr must be > 0, got {lr}")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"LAMB: betas must be in [0, 1), got {betas}")
        if eps <= 0.0:
            raise ValueError(f"LAMB: eps must be > 0, got {eps}")
        if weight_decay < 0.0:
            raise ValueError(f"LAMB: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, exclude_1d=exclude_1d)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimizer step (optionally re-evaluating the loss via closure)."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise TypeError("LAMB: sparse gradients are not supported; use dense embeddings")
            for p in params:
                state = self.state[p]
                if not state:
                    # A 0-dim step count on the CPU, as torch's Adam keeps it: checkpoints treat it alike.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            updates = {p: self._update(p, group) for p in params}
            adaptive = [p for p in params if self._adapts(p, group)]
            # The whole tensors' norms (sharded ones: one all-reduce per process group for all of them).
            norms = whole_norms([*adaptive, *(updates[p] for p in adaptive)])
            trusts = {p: _trust(w, r) for p, w, r in zip(adaptive, norms, norms[len(adaptive):])}
            for p in params:
                r = local_part(updates[p])  # element-wise from here on: each rank steps its own part
                local_part(p).add_(r * trusts[p] if p in trusts else r, alpha=-group["lr"])
        return loss

    @staticmethod
    def _adapts(p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` gets decay and a trust ratio (not a 1-D tensor under ``exclude_1d``)."""
        return not (group["exclude_1d"] and p.dim() == 1)

    def _update(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """``r``, Adam's bias-corrected step plus decoupled weight decay (no decay for a tensor without a trust
        ratio), from the current moments."""
        state = self.state[p]
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        v_hat = state["exp_avg_sq"] / (1 - beta2**step)
        r = state["exp_avg"] / (1 - beta1**step) / (v_hat.sqrt() + group["eps"])
        if self._adapts(p, group) and group["weight_decay"] != 0:
            r = r.add(p, alpha=group["weight_decay"])
        return r

    def _direction(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """``trust * r`` from the current moments: the step is ``w <- w - lr * direction`` (one tensor's norms, a
        DTensor's by DTensor's own reduction)."""
        r = self._update(p, group)
        if not self._adapts(p, group):
            return r
        return r * _trust(torch.linalg.vector_norm(p), torch.linalg.vector_norm(r))

    def smoothed_update(self, param: Tensor, group: dict[str, Any]) -> Tensor | None:
        """The direction of the last step from the current moments and weights (None before the first step):
        the next step's if the next gradient equals the running average, as for Adam."""
        return self._direction(param, group) if param in self.state and self.state[param] else None


def _trust(w_norm: Tensor, r_norm: Tensor) -> Tensor:
    """``||w|| / ||r||``, or 1 when either is 0; torch.where keeps it free of host syncs (and works on DTensors)."""
    return torch.where((w_norm > 0) & (r_norm > 0), w_norm / r_norm, torch.ones_like(w_norm))

"""LARS/LARC optimizer.

`LARS` is layer-wise adaptive rate scaling (You et al., 2017) with the
LARC clipping option (NVIDIA apex): each non-excluded parameter tensor gets
its own step size from the ratio of its weight norm to its gradient norm, so
very large batches can train with one global learning rate.

"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from pipetrain.optim.closure import closure_loss
from pipetrain.optim.whole_norms import local_part, whole_norms


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

    Every tensor is adapted by default, as in You et al.'s layer-wise rule. Excluded tensors get plain momentum
    SGD at the global rate (``buf = momentum * buf + g + wd * w``, ``w <- w - lr * buf``): every tensor of a param
    group with ``lars_exclude=True`` (with that group's weight_decay), and with ``exclude_1d=True`` every 1-D tensor
    (biases, normalisation scales) with NO weight decay, MLPerf's ResNet variant. The global rate is ~1/trust
    coefficient (1000x) an SGD rate, so exclude only tensors that tolerate it, such as batch normalisation's: a CNN
    without normalisation (MNIST-1D, batch 2,048, 10 epochs) ends at 49% with its biases excluded and 94% without
    (docs/results.md, "Large batches").

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
        exclude_1d: bool = False,
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
        loss = closure_loss(closure)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise TypeError("LARS: sparse gradients are not supported; use dense embeddings")
            adaptive = [p for p in params if self._adapts(p, group)]
            # The whole tensors' norms (sharded ones: one all-reduce per process group for all of them).
            norms = whole_norms([*adaptive, *(p.grad for p in adaptive)])
            trusts = {p: self._trust(w, g, group) for p, w, g in zip(adaptive, norms, norms[len(adaptive):])}
            for p in params:
                # Element-wise from here on: each rank updates its own part of a sharded tensor.
                update = self._update(local_part(p), local_part(p.grad), group, trusts.get(p))
                state = self.state[p]
                if "momentum_buffer" not in state:  # like torch's SGD, the buffer starts as the first update
                    state["momentum_buffer"] = torch.zeros_like(p)
                    local_part(state["momentum_buffer"]).copy_(update)
                else:
                    local_part(state["momentum_buffer"]).mul_(group["momentum"]).add_(update)
                local_part(p).add_(local_part(state["momentum_buffer"]), alpha=-group["lr"])
        return loss

    @staticmethod
    def _adapts(p: Tensor, group: dict[str, Any]) -> bool:
        """Whether ``p`` gets a trust ratio (not 1-D tensors under ``exclude_1d``, nor ``lars_exclude`` groups)."""
        return not group["lars_exclude"] and not (group["exclude_1d"] and p.dim() == 1)

    @staticmethod
    def _trust(w_norm: Tensor, g_norm: Tensor, group: dict[str, Any]) -> Tensor:
        """The local adaptive rate from the whole tensor's weight and gradient norms."""
        wd = group["weight_decay"]
        trust = group["trust_coefficient"] * w_norm / (g_norm + wd * w_norm + group["eps"])
        # torch.where keeps this free of host syncs on accelerators.
        trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
        if group["clip"]:
            trust = torch.clamp(trust / group["lr"], max=1.0)
        return trust

    @staticmethod
    def _update(w: Tensor, g: Tensor, group: dict[str, Any], trust: Tensor | None) -> Tensor:
        """The gradient plus weight decay, times the trust ratio; a 1-D tensor under ``exclude_1d`` gets its
        gradient alone (no decay)."""
        if group["exclude_1d"] and w.dim() == 1:
            return g
        wd = group["weight_decay"]
        update = g.add(w, alpha=wd) if wd != 0 else g
        return update if trust is None else update * trust

    def smoothed_update(self, param: Tensor) -> Tensor | None:
        """The scaled momentum buffer of `param` (None before its first step)."""
        return self.state[param].get("momentum_buffer") if param in self.state else None

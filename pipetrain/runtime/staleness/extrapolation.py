"""Extrapolating a stage's weights along the optimizer's smoothed update: W - s * lr * v.

This runs before every forward (and, for spectrain, every backward) of an asynchronous
stage, so it is built for the hot path: the parameter -> group map is made once, each
parameter's smoothed update v is computed once per optimizer step (Adam's
m_hat / (sqrt(v_hat) + eps) costs as much as a prediction) and reused until the next step, and
the writes are a few ``torch._foreach_*`` calls per parameter group.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from pipetrain.optim import smoothed_update
from pipetrain.optim.muon import is_muon_group


def require_smoothed_update(optimizer: torch.optim.Optimizer | None) -> None:
    """Fail now, naming the optimizers that work, if ``optimizer`` has no smoothed update."""
    if optimizer is None:  # a stage without parameters predicts nothing
        return
    for group in optimizer.param_groups:
        for p in group["params"][:1]:
            smoothed_update(optimizer, p)


def momentum_of(group: dict) -> float:
    """The momentum coefficient of a parameter group: SGD's and LARS's ``momentum``, Adam's and LAMB's beta1."""
    if "betas" in group:
        return float(group["betas"][0])
    return float(group["momentum"])


def update_decay(group: dict) -> float:
    """The factor a parameter group's update shrinks by at each step that brings no new gradient: its momentum,
    but 1 for Muon, whose Newton-Schulz orthogonalisation is scale-invariant, so the update of a decaying
    momentum buffer keeps its size."""
    return 1.0 if is_muon_group(group) else momentum_of(group)


class Extrapolation:
    """Writes W - s * lr * v for a fixed list of parameters of one optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]):
        require_smoothed_update(optimizer)
        self.optimizer = optimizer
        self.params = params
        index = {id(p): i for i, p in enumerate(params)}
        self.groups = [(group, [index[id(p)] for p in group["params"] if id(p) in index])
                       for group in optimizer.param_groups]
        self.groups = [(group, members) for group, members in self.groups if members]
        self._directions: list[torch.Tensor | None] | None = None
        self._updates: list[torch.Tensor] | None = None  # ZeRO: lr * v of every parameter, from its owner
        # The factor the next steps scale the groups' rates by (PipeMare's per-stage rates): predictions
        # extrapolate the updates as the optimizer will apply them.
        self.lr_scale: Callable[[], float] = lambda: 1.0

    def invalidate(self) -> None:
        """The optimizer stepped (or its state was loaded): recompute v at the next use."""
        self._directions = None

    def provide(self, updates: list[torch.Tensor]) -> None:
        """ZeRO: each parameter's ``lr * v``, computed by the replica that steps it and all-gathered (this
        replica's optimizer holds the state of its own tensors only); used from now on instead of the
        optimizer's state, until the next ``provide``."""
        self._updates = updates

    def _lr(self, group: dict) -> float:
        return 1.0 if self._updates is not None else group["lr"] * self.lr_scale()  # provided ones carry their lr

    def directions(self) -> list[torch.Tensor | None]:
        """Each parameter's smoothed update (None before its first step)."""
        if self._updates is not None:
            return self._updates
        if self._directions is None:
            directions: list[torch.Tensor | None] = [None] * len(self.params)
            for group, members in self.groups:
                for i in members:
                    directions[i] = smoothed_update(self.optimizer, self.params[i], group)
            self._directions = directions
        return self._directions

    def write(self, outs: list[torch.Tensor], steps: Callable[[dict], float]) -> None:
        """``outs[i] = W_i - steps(group) * lr * v_i``; ``steps`` gives the distance for a parameter
        group (it may depend on the group's momentum). Writes through ``.data`` (see the package), in place:
        autograd saved these very storages for the backward. A moving weight is written in one pass (W and
        v read, the result written: copying W first and adding in place would read and write it twice
        more), the others are copies of W."""
        directions = self.directions()
        still = set(range(len(outs)))
        with torch.no_grad():
            for group, members in self.groups:
                alpha = -steps(group) * self._lr(group)
                moving = [i for i in members if directions[i] is not None]
                if alpha != 0.0 and moving:
                    for i in moving:
                        torch.add(self.params[i].detach(), directions[i], alpha=alpha, out=outs[i].data)
                    still.difference_update(moving)
            if still:
                kept = sorted(still)
                torch._foreach_copy_([outs[i].data for i in kept], [self.params[i].detach() for i in kept])

    def update_norm(self) -> torch.Tensor:
        """|lr * v| over all the parameters (a device scalar): the size of the next update, the unit of
        the diagnostics; 0 before the first step."""
        directions = self.directions()
        squares = [torch.zeros((), device=self.params[0].device)]
        for group, members in self.groups:
            moving = [directions[i] for i in members if directions[i] is not None]
            if moving:
                squares.append((self._lr(group) * torch.linalg.vector_norm(torch.stack(torch._foreach_norm(moving)))) ** 2)
        return torch.stack(squares).sum().sqrt()

"""Muon for a stage's matrices and AdamW for the rest, and the update Muon's next step applies.

`torch.optim.Muon` (Keller Jordan's optimizer, shipped with torch) orthogonalises each 2-D parameter's momentum
with a Newton-Schulz iteration and steps along the result; torch documents it for the matrices of hidden layers,
with a standard method such as AdamW for every other parameter (biases, normalisation scales, embeddings), and
Keller Jordan's recipe also keeps the output head on AdamW. `muon_with_adamw` builds that pair for each stage.

Orthogonalising the parts of a matrix is not orthogonalising the matrix, so where a rank holds part of one
(FSDP2's shards under zero=3, tensor parallelism's blocks: DTensors) `Muon` all-gathers the whole update, runs the
iteration on it and keeps this rank's part.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
# Muon's own learning-rate adjustment and Newton-Schulz iteration, so that the steps of a sharded matrix and the
# predicted update are bit for bit what torch's Muon computes on the whole matrix (torch keeps them private;
# pinned with torch in pyproject).
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.optimizer import _to_scalar

from pipetrain.optim.closure import closure_loss
from pipetrain.optim.combined import CombinedOptimizer, combine, inner_optimizers
from pipetrain.optim.whole_norms import is_dtensor


def is_matrix(param: Tensor) -> bool:
    """`muon_with_adamw`'s default split: every 2-D parameter goes to Muon."""
    return param.dim() == 2


def orthogonalise(matrix: Tensor, group: dict[str, Any]) -> Tensor:
    """Muon's Newton-Schulz orthogonalisation of ``matrix`` with ``group``'s settings. A DTensor (a shard or block
    of a matrix) is all-gathered first and this rank's part of the result kept, placed as ``matrix`` is: every
    rank holding part of the matrix computes the whole iteration, on the same values, as the unsplit model does."""
    settings = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    if not is_dtensor(matrix):
        return _zeropower_via_newtonschulz(matrix, *settings)
    from torch.distributed.tensor import distribute_tensor  # only where DTensors exist (start-up: test_startup)

    whole = _zeropower_via_newtonschulz(matrix.full_tensor(), *settings)
    # src_data_rank=None: each rank cuts its own part from its own (identical) result, with no communication.
    return distribute_tensor(whole, matrix.device_mesh, matrix.placements, src_data_rank=None)


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` (the same arguments, state and update) that also steps matrices split over ranks:
    the parameters of zero=3 (FSDP2) and tensor parallelism are DTensors, and each step orthogonalises the whole
    matrix (`orthogonalise`). The price: one all-gather of each split matrix's update per step, and the iteration
    computed on every rank holding part of it. On whole matrices it steps as torch's Muon does."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Muon step of every parameter with a gradient (the closure, if given, is evaluated first)."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            buffers: list[Tensor] = []
            self._init_group(group, params, grads, buffers)
            lr, momentum = _to_scalar(group["lr"]), group["momentum"]
            # torch's single-tensor Muon step, the orthogonalisation reading whole matrices.
            for param, grad, buffer in zip(params, grads, buffers):
                if grad.ndim != 2:
                    raise ValueError("Muon steps 2-D parameters only; give the others to AdamW (muon_with_adamw)")
                buffer.lerp_(grad, 1 - momentum)
                update = orthogonalise(grad.lerp(buffer, momentum) if group["nesterov"] else buffer, group)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


def muon_with_adamw(*, lr: float, adamw_lr: float, momentum: float = 0.95, nesterov: bool = True,
                    weight_decay: float = 0.1, ns_steps: int = 5, adjust_lr_fn: str | None = None,
                    adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                    adamw_weight_decay: float = 0.01, muon_for: Callable[[Tensor], bool] = is_matrix,
                    ) -> Callable[[list[nn.Parameter]], CombinedOptimizer]:
    """An optimizer factory for ``pipetrain.wrap(optimizer=...)``: per stage, `Muon` (torch's, on any layout; ``lr``,
    ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``, ``adjust_lr_fn``; torch's defaults) over the
    parameters ``muon_for`` selects and ``torch.optim.AdamW`` (the ``adamw_*`` arguments) over the others, as one
    `CombinedOptimizer` whose groups are [Muon's, AdamW's] on every stage (either may be empty), so checkpoints
    resume at any stage count.

    The default ``muon_for`` takes every 2-D parameter. Embedding tables and output heads are 2-D as well, and
    torch's documentation and Keller Jordan recommend AdamW for them; a parameter list does not say which
    matrix is an embedding, so pass a rule that does, by name, e.g.
    ``muon_for=lambda p: p.dim() == 2 and not (pipetrain.parameter_name(p) or "").startswith(("embed", "lm_head"))``
    (``wrap`` also probes the factory with scratch tensors, which have no name).
    Use ``nesterov=False`` with ``staleness="nesterov"``, which makes the look-ahead itself.
    """
    muon = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn)
    adamw = dict(lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)

    def factory(params: list[nn.Parameter]) -> CombinedOptimizer:
        matrices = [p for p in params if muon_for(p)]
        others = [p for p in params if not muon_for(p)]
        # Group dicts, so that an empty list is accepted: a stage without matrices keeps the same two groups.
        return CombinedOptimizer([Muon([{"params": matrices}], **muon),
                                  torch.optim.AdamW([{"params": others}], **adamw)])

    return factory


def muon_update(param: Tensor, state: dict[str, Any], group: dict[str, Any]) -> Tensor | None:
    """Muon's next update direction ``v`` (its step is ``W <- W - lr * v``) when the next gradient equals the
    momentum buffer (SpecTrain's stationarity): the buffer then stays, the Nesterov blend of gradient and buffer
    is the buffer, and the step applies ``ratio * NS(buffer) + weight_decay * W`` (NS: Muon's Newton-Schulz
    orthogonalisation, ratio: its shape-dependent learning-rate adjustment). None before the first step."""
    buf = state.get("momentum_buffer")
    if buf is None:
        return None
    orthogonal = orthogonalise(buf, group)
    ratio = _adjust_lr(1.0, group["adjust_lr_fn"], param.shape)
    direction = orthogonal.to(param.dtype) * ratio
    if group["weight_decay"] != 0:
        direction = direction + group["weight_decay"] * param.detach()
    return direction


def is_muon_group(group: dict[str, Any]) -> bool:
    """Whether a parameter group is Muon's (it carries the Newton-Schulz settings)."""
    return "ns_steps" in group and "ns_coefficients" in group


def orthogonalises(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` (or one of a combination's) is Muon, which reads each matrix whole."""
    return any(isinstance(o, torch.optim.Muon) for o in inner_optimizers(optimizer))


def factory_cuts_matrices_for_muon(factory: Callable[[list[nn.Parameter]], Any]) -> bool:
    """Whether ``factory`` builds torch's own Muon, which orthogonalises whatever part of a matrix a rank holds
    (pipetrain's `Muon` gathers it), probed on a scratch matrix and vector, so that a factory splitting matrices
    from the rest builds both optimizers: every rank decides alike, before building anything."""
    made = combine(factory([nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))]))
    return isinstance(made, torch.optim.Optimizer) and any(
        isinstance(o, torch.optim.Muon) and not isinstance(o, Muon) for o in inner_optimizers(made))

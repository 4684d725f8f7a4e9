"""What pipetrain needs of ``loss_fn``: one scalar tensor per micro-batch, computed from the model's output.

Checked where it is cheap: the default loss against the captured output when the pipeline is built,
and each loss's type and shape (metadata: no read of the device) where it is computed, before any
backward, so a wrong loss_fn fails with its name and its fix rather than deep inside autograd.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F


def check_default_loss(loss_fn: Callable, example_output: Any, model: str) -> None:
    """Refuse ``cross_entropy(output, target)`` (the default loss_fn) for a model whose output is not a tensor."""
    if loss_fn is F.cross_entropy and not isinstance(example_output, torch.Tensor):
        raise TypeError(
            f"loss_fn is cross_entropy(output, target) (the default), but {model} returns a "
            f"{type(example_output).__name__}, not a tensor; fix: give a loss_fn that takes the tensor out of "
            "the output, e.g. loss_fn=lambda out, y: F.cross_entropy(out[0], y) (a tuple) or "
            "F.cross_entropy(out.logits, y) (a ModelOutput), or loss_fn=pipetrain.model_loss when the model "
            "computes its own loss from labels among its inputs")


def compute_loss(loss_fn: Callable, output: Any, target: Any) -> torch.Tensor:
    """``loss_fn(output, target)``, refused unless it is a 0-dim tensor (what the backward and the
    per-sample weighting of micro-batches need)."""
    try:
        loss = loss_fn(output, target)
    except TypeError as exc:
        if isinstance(output, torch.Tensor):
            raise
        raise TypeError(
            f"loss_fn raised TypeError: {exc}; it gets the model's output in the model's own structure, here a "
            f"{type(output).__name__}; fix: take the tensor out of it in loss_fn (e.g. out[0] or out.logits)"
        ) from exc
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned a {type(loss).__name__}, not a tensor: the backward needs the loss in the autograd "
            "graph; fix: return the loss tensor itself (no .item() or float())")
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not a scalar: pipetrain weighs each "
            "micro-batch's mean loss by its samples; fix: return the mean over the micro-batch "
            "(reduction='mean', the default, or .mean())")
    return loss

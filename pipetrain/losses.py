"""Loss functions for models that compute their own loss."""
from __future__ import annotations

from typing import Any

import torch


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The loss the model returned: ``output.loss`` (Hugging Face ``ModelOutput`` when ``labels`` are
    among the inputs), ``output["loss"]``, or a scalar tensor output. ``target`` is unused: train with
    ``pipe.step({"input_ids": ids, "labels": ids})``, the labels being one of the model's inputs."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss_fn=model_loss found no loss in the model's {type(output).__name__} output; fix: "
                        "pass the labels among the inputs (e.g. {'input_ids': ids, 'labels': ids}) so that the "
                        "model computes its loss, or give a loss_fn(output, target)")
    return loss

"""Capture for training: the first of torch.fx, torch.export and the top-level chain that accepts the model."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import TraceError
from .graph import CostGraph
from .trace import trace
from .training_switches import training_switches

CAPTURES = ("fx", "export", "chain")


def trace_for_training(model: nn.Module, example_inputs: Any, profile: bool,
                       autocast: torch.dtype | None = None) -> CostGraph:
    """Capture ``model`` in training mode with torch.fx; where fx cannot follow forward(), with torch.export
    (non-strict); failing both, as the chain of its top-level children, which is accepted only when running
    them in order reproduces the model's output. When none works: one TraceError saying why each failed.
    ``autocast``: the dtype the stages compute in under torch.autocast (see ``trace``). The modules' own
    modes are restored afterwards."""
    errors = []
    modes = {m: m.training for m in model.modules()}
    model.train()  # capture what training runs (a model from_pretrained() comes in eval mode)
    try:
        for capture in CAPTURES:
            try:
                return trace(model, example_inputs, profile=profile, capture=capture, autocast=autocast)
            except TraceError as error:
                errors.append((capture, error))
    finally:
        for m, training in modes.items():
            m.training = training
    children = [name for name, _ in model.named_children()]
    why = "\n".join(f"  {capture}: {str(error).strip()}".replace("\n", "\n    ") for capture, error in errors)
    switches = training_switches(model)
    if switches:
        configs = [s.split(" = ")[0] for s in switches if s.startswith("config.")]
        example = f" (e.g. model.{configs[0]} = 0.0)" if configs else ""
        why += (f"\n  on in this model: code under self.training that draws its randomness in Python (random "
                f"layer drop, masking), which no capture follows: {', '.join(switches)}; fix: set "
                f"{'it' if len(switches) == 1 else 'each'} to 0 for pipeline training{example}")
    raise TraceError(
        f"pipetrain cannot capture {type(model).__name__}:\n{why}\n  fix: make the failing code capturable (no "
        f"Python control flow on tensor values: torch.where), or build the model so that its top-level children "
        f"{children} run in order (nn.Sequential) and split it between them with partitioner=[<child names>]"
    ) from errors[0][1]

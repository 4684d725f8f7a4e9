"""A model whose own activation checkpointing is on (Hugging Face ``gradient_checkpointing_enable()``, or any
module with ``gradient_checkpointing = True``): its checkpointed blocks become pipetrain's recomputation.

The capture records the computation, not the checkpoint calls around it, so left on, the model's own
checkpointing would be dropped without a word (and ``use_reentrant=True`` breaks the first backward). It is
turned off while the model is captured, and unless ``recompute=`` says otherwise every stage recomputes its
forward in the backward (``recompute="always"``): it keeps no more activations than the checkpointed model
(each stage holds only its inputs per micro-batch in flight) and never changes the result.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Iterator

from torch import nn

from pipetrain.options import PipelineOptions


def checkpointed_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose own activation checkpointing is on."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


def honour_model_checkpointing(model: nn.Module, options: PipelineOptions) -> PipelineOptions:
    """``options`` with recompute="always" where the model checkpoints its activations and recompute= is unset."""
    if not checkpointed_modules(model) or options.recompute != "none":
        return options
    warnings.warn(f"{type(model).__name__} has activation checkpointing on (gradient_checkpointing_enable()): "
                  "pipetrain recomputes each stage's forward in its backward instead (recompute='always'; same "
                  "result, activations kept no larger). Pass recompute='except-last' or 'auto' (with memory_limit) "
                  "to choose otherwise, or call gradient_checkpointing_disable() to keep every activation",
                  stacklevel=4)
    return dataclasses.replace(options, recompute="always")


@contextlib.contextmanager
def checkpointing_off(model: nn.Module) -> Iterator[None]:
    """The model's own checkpointing off while it is captured (the capture records the plain computation)."""
    modules = checkpointed_modules(model)
    for m in modules:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in modules:
            m.gradient_checkpointing = True

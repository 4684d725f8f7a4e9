"""The original model's name of each parameter a stage's optimizer factory receives.

A factory gets the stage's own tensors, not the model's, so it cannot look their names up in the model;
a factory that groups parameters by name (weight decay off for biases and norm weights, as Hugging
Face's Trainer does) asks ``parameter_name`` instead. Weakly held: a dropped pipeline's tensors go."""
from __future__ import annotations

from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

_NAMES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def name_parameters(module: nn.Module) -> None:
    """Record the names of a stage module's parameters (the original model's, as its state dict has them)."""
    for name, param in module.named_parameters():
        _NAMES[param] = name


def parameter_name(param: nn.Parameter) -> str | None:
    """The original model's name of a parameter of a pipeline stage (what ``Pipeline.state_dict`` calls it),
    or None for a tensor no stage holds (wrap probes the factory once with such a tensor)."""
    return _NAMES.get(param)

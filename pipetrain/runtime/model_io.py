"""The model's call as the pipeline runs it: which inputs its first stage takes, and whether its output
can be assembled from micro-batches.

The capture fixes the model's inputs: an argument the example inputs did not give is baked into the
graph as its default, so a mini-batch that passes it would silently run without it. Every mini-batch
is therefore checked against what was captured, by name; what that needs of ``forward``'s signature
is read once, when the pipeline is built, so the check per mini-batch is a few set operations.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class ModelIO:
    """What a pipeline's model takes and returns, as the capture fixed it."""

    model: str                     # the model's class name, for messages
    names: tuple[str, ...]         # forward() arguments the first stage takes, in its order
    parameters: tuple[str, ...]    # forward()'s named parameters
    positional: tuple[str, ...]    # the parameters a tuple of inputs binds to, in order
    var_keyword: bool              # forward() also takes **kwargs
    splits_by_sample: bool         # every output tensor is per sample (dim 0 is the batch)

    @classmethod
    def of(cls, model: str, forward: Callable, names: list[str], example_output: Any, samples: int,
           mixes_samples: bool = False) -> ModelIO:
        """The call of ``forward`` captured with the arguments ``names`` on an example of ``samples``
        samples that gave ``example_output``; ``mixes_samples``: the capture found an output dimension past
        dim 0 that follows the batch (partitioners.input_sizes.outputs_mix_samples)."""
        params = inspect.signature(forward).parameters.values()
        named = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        positional = tuple(p.name for p in params if p.kind in _POSITIONAL)
        return cls(model, tuple(names), named, positional, any(p.kind is p.VAR_KEYWORD for p in params),
                   not mixes_samples and splits_by_sample(example_output, samples))

    def arrange(self, inputs: Any) -> tuple:
        """``inputs`` (a tensor, a tuple in argument order or a Mapping of keyword arguments) as the first
        stage's positional arguments; an argument that is not one the capture took is an error."""
        by_position = not isinstance(inputs, Mapping)
        given = dict(inputs) if not by_position else self._bind(
            tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
        if len(given) != len(self.names) or any(n not in given for n in self.names):
            self._refuse(given, by_position)
        return tuple(given[n] for n in self.names)

    def _bind(self, values: tuple) -> dict[str, Any]:
        if len(values) > len(self.positional):
            raise TypeError(
                f"the inputs are {len(values)} positional arguments, but {self.model}.forward takes at most "
                f"{len(self.positional)} by position ({', '.join(self.positional)}); fix: pass the inputs "
                f"the pipeline was wrapped with: {self._wrapped()}")
        return dict(zip(self.positional, values))

    def _refuse(self, given: dict[str, Any], by_position: bool) -> None:
        bound = f" (inputs given by position bind to forward's parameters in order: {', '.join(given)})" \
            if by_position else ""
        unknown = [k for k in given if k not in self.parameters and k not in self.names]
        if unknown:
            extra = (" (it also takes **kwargs, but the pipeline passes only the inputs the example gave)"
                     if self.var_keyword else "")
            raise TypeError(
                f"{self.model}.forward has no parameter {_listed(unknown)}; its named parameters are "
                f"{', '.join(self.parameters)}{extra}; fix: correct the name, or, if the model reads it, "
                f"wrap with example_inputs that include it")
        uncaptured = [k for k in given if k not in self.names]
        if uncaptured:
            raise ValueError(
                f"the inputs give {_listed(uncaptured)}, which {self.model}.forward takes but the example_inputs "
                f"given to wrap() did not: the pipeline was captured without it and would run as if it were "
                f"not passed{bound}; fix: wrap with example_inputs that include {_listed(uncaptured)}, or pass "
                f"the inputs the pipeline was wrapped with: {self._wrapped()}")
        missing = [n for n in self.names if n not in given]
        raise ValueError(f"the inputs lack {_listed(missing)}, which the pipeline was wrapped with; they give "
                         f"{', '.join(map(str, given)) or 'nothing'}{bound}; fix: pass {self._wrapped()}")

    def _wrapped(self) -> str:
        return "{" + ", ".join(f"'{n}': ..." for n in self.names) + "}"


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def splits_by_sample(output: Any, samples: int) -> bool:
    """Whether every tensor in ``output`` (computed on ``samples`` samples) has the batch as dim 0, so the
    outputs of micro-batches concatenate into the whole batch's. A 0-dim tensor is a value reduced over
    the batch (a loss), which the micro-batches' values do not give in general."""
    return all(t.dim() > 0 and t.shape[0] == samples for t in pytree.tree_leaves(output)
               if isinstance(t, torch.Tensor))

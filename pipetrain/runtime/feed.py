"""The micro-batches a pipeline works on, addressed by global micro-batch index.

Micro-batch g belongs to mini-batch g // micro_batches (the numbering schedules use).
A streaming feed pulls mini-batches from the user's iterable only as the schedule asks
for them, so async-1f1b never needs to know the stream's length up front.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable, Iterator

import torch
from torch.utils import _pytree as pytree

from partitioners import input_sizes
from pipetrain.runtime.batching import batch_size, split_micro_batches


class Feed:
    """Mini-batches split into micro-batches, with the loss weight of each micro-batch. Inputs come as
    the first stage's positional arguments (``ModelIO.arrange``).

    ``limits``: per input position, its name and the sizes the capture runs with
    (partitioners.input_sizes), checked for every micro-batch as it is added, before anything runs."""

    def __init__(self, micro_batches: int, limits: dict[int, tuple[str, dict[int, input_sizes.SizeLimit]]] | None = None):
        self.micro_batches = micro_batches
        self.limits = limits or {}
        self._inputs: dict[int, list] = {}
        self._shapes: dict[int, list[tuple]] = {}
        self._targets: dict[int, list] = {}
        self._sizes: dict[int, list[int]] = {}
        self._weights: dict[int, list[float]] = {}
        self._grad_scale: dict[int, float] = {}

    def add(self, t: int, x: tuple, y: Any = None, grad_scale: float = 1.0) -> None:
        """Register mini-batch ``t``; ``grad_scale`` multiplies its loss in the backward only
        (hybrid mode: this replica's share of the global batch)."""
        self._grad_scale[t] = grad_scale
        xs = split_micro_batches(x, self.micro_batches)
        for values in xs:
            for i, (name, limits) in self.limits.items():
                input_sizes.check(name, values[i], limits)
        self._inputs[t] = xs
        self._shapes[t] = [_shapes(v) for v in xs]
        sizes = self._sizes[t] = [batch_size(v) for v in xs]
        total = sum(sizes)
        self._weights[t] = [n / total for n in sizes]
        self._targets[t] = split_micro_batches(y, self.micro_batches) if y is not None else [None] * self.micro_batches

    def release(self, t: int) -> None:
        for d in (self._inputs, self._shapes, self._targets, self._sizes, self._weights, self._grad_scale):
            d.pop(t, None)

    def _at(self, g: int) -> tuple[int, int]:
        return divmod(g, self.micro_batches)

    def inputs(self, g: int) -> tuple:
        t, j = self._at(g)
        return self._inputs[t][j]

    def target(self, g: int) -> Any:
        t, j = self._at(g)
        return self._targets[t][j]

    def size(self, g: int) -> int:
        t, j = self._at(g)
        return self._sizes[t][j]

    def shapes(self, g: int) -> tuple:
        """Shape and dtype of each tensor input of micro-batch ``g``: every rank of a pipeline computes the
        same from the same mini-batch, and the boundary shapes follow from them (the transport's shape key)."""
        t, j = self._at(g)
        return self._shapes[t][j]

    def mini_batch_shapes(self, t: int) -> list[tuple]:
        """``shapes`` of each micro-batch of mini-batch ``t``."""
        return self._shapes[t]

    def weight(self, g: int) -> float:
        """Share of micro-batch ``g`` in its mini-batch's mean loss (uneven splits weigh by size)."""
        t, j = self._at(g)
        return self._weights[t][j]

    def grad_weight(self, g: int) -> float:
        """Factor on micro-batch ``g``'s loss for the backward."""
        return self.weight(g) * self._grad_scale[g // self.micro_batches]

    def mini_batch_size(self, t: int) -> int:
        return sum(self._sizes[t])


def _shapes(inputs: tuple) -> tuple[Hashable, ...]:
    if type(inputs) is tuple and all(isinstance(v, torch.Tensor) for v in inputs):  # no tree walk per micro-batch
        return tuple((tuple(v.shape), v.dtype) for v in inputs)
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(inputs))


class StreamFeed(Feed):
    """A feed that pulls (x, y) pairs from an iterable on demand."""

    def __init__(self, batches: Iterable, micro_batches: int,
                 prepare: Callable[[Any, Any], tuple[Any, Any, float]] | None = None,
                 limits: dict[int, tuple[str, dict[int, input_sizes.SizeLimit]]] | None = None):
        super().__init__(micro_batches, limits)
        self._source: Iterator = iter(batches)
        self._prepare = prepare or (lambda x, y: (x, y, 1.0))
        self._next = 0
        self.exhausted = False

    def has(self, t: int) -> bool:
        """Whether mini-batch ``t`` exists, reading the stream up to it if needed."""
        while self._next <= t and not self.exhausted:
            try:
                item = next(self._source)
            except StopIteration:
                self.exhausted = True
                break
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise TypeError("train() expects an iterable of (inputs, targets) pairs")
            self.add(self._next, *self._prepare(*item))
            self._next += 1
        return t < self._next

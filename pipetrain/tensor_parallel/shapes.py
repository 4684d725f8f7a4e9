"""The whole (unsplit) shape of every value of a traced model, from its example inputs on fake tensors.

Splitting a stage over tensor-parallel ranks maps a split dimension through reshapes, which needs the shapes the
model computes with; the stage graphs carry none. One run of the traced graph on fake tensors gives them without
computing anything (a model on the meta device included).
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import partitioners


class _FakeRun(fx.Interpreter):
    """Runs the graph on fake tensors; parameters and buffers (real or meta) enter as fake tensors on ``device``."""

    def __init__(self, module: fx.GraphModule, device: torch.device):
        super().__init__(module)
        self.device = device
        self.shapes: dict[str, tuple[int, ...]] = {}

    def run_node(self, node: fx.Node) -> Any:
        value = super().run_node(node)
        if isinstance(value, torch.Tensor):
            self.shapes[node.name] = tuple(_concrete(size) for size in value.shape)
        return value

    def get_attr(self, target: str, args: tuple, kwargs: dict) -> Any:
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: str, args: tuple, kwargs: dict) -> Any:
        layer = self.fetch_attr(target)
        tensors = {name: self._fake(t) for name, t in itertools.chain(layer.named_parameters(), layer.named_buffers())}
        return torch.func.functional_call(layer, tensors, args, kwargs)

    def _fake(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=self.device,
                                       requires_grad=value.requires_grad)
        return value


def _concrete(size: Any) -> int:
    """A dimension's size; a symbolic one by the value it has on the example inputs."""
    return int(size) if isinstance(size, int) else int(size.node.hint)


def whole_shapes(module: fx.GraphModule, example_inputs: Any) -> dict[str, tuple[int, ...]]:
    """Node name -> shape of the tensor it computes when ``module`` (a traced model) runs on ``example_inputs``."""
    inputs = partitioners.placeholder_values(module, example_inputs)
    # The graph names the device it was captured on (arange(device=...)): every tensor runs there.
    named = {a for node in module.graph.nodes for a in (*node.args, *node.kwargs.values())
             if isinstance(a, torch.device)}
    meta = torch.device("meta")
    device = meta if meta in named else next(iter(named), next(
        (t.device for t in inputs if isinstance(t, torch.Tensor) and t.device != meta), torch.device("cpu")))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(t.shape, dtype=t.dtype, device=device) if isinstance(t, torch.Tensor) else t
                for t in inputs]
        run = _FakeRun(module, device)
        run.run(*fake)
    return run.shapes

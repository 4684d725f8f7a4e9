"""The cost graph: a traced model as a networkx DiGraph with per-node costs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import networkx as nx
import torch.fx as fx
import torch.nn as nn

from . import input_sizes
from .meta import holds_meta_tensors, with_meta_tensors
from .state_names import StateNames


@dataclass
class CostGraph:
    """A model traced by torch.fx, one networkx node per fx node.

    Node attributes: op, target, order (fx position), fwd_time, bwd_time (seconds),
    param_bytes (a parameter shared by several nodes counts once, at its first user),
    act_bytes (output bytes), params (qualified names of the parameters the node uses),
    tied (the node shares a parameter with another node), kind of value it outputs
    ("tensor", "container" holding tensors, or "other"), scope (innermost module path),
    requires_grad (the value is a tensor autograd differentiates when the model trains: not integer
    indices, nor floating values computed from the inputs alone, such as rotary tables or counts).
    Edge attribute: bytes (of the value the edge moves). ``example_output`` is the model's output on
    the example inputs in its own structure, its tensors on the meta device (shapes and dtypes, no data).
    """

    graph: nx.DiGraph
    module: fx.GraphModule
    model: nn.Module
    auto_leaves: list[str] = field(default_factory=list)
    tied_params: dict[str, list[str]] = field(default_factory=dict)
    example_output: Any = None

    @cached_property
    def without_data(self) -> bool:
        """The model is on the meta device (built without data): its stages must be given tensors."""
        return holds_meta_tensors(self.model)

    def on_meta(self) -> CostGraph:
        """This graph over meta stand-ins of the model's tensors: the same nodes, names and costs, holding no
        memory of the model (what a plan keeps once the stages are built)."""
        if self.without_data:
            return self
        module, model = with_meta_tensors((self.module, self.model), self.module, self.model)
        return dataclasses.replace(self, module=module, model=model)

    @property
    def order(self) -> list[str]:
        """Node names in fx (topological) order."""
        return [n.name for n in self.module.graph.nodes]

    @cached_property
    def state_names(self) -> StateNames:
        """The original model's alias groups and state-dict keys (for stage modules)."""
        return StateNames(self.model)

    @cached_property
    def input_limits(self) -> dict[str, dict[int, input_sizes.SizeLimit]]:
        """Per model input, the dimensions the capture fixed to the example's size or bounded (input_sizes.py);
        an input or dimension not named takes any size."""
        return input_sizes.of_graph(self.module)

    def total_time(self) -> float:
        """Sum of forward and backward seconds over all nodes."""
        g = self.graph
        return sum(g.nodes[n]["fwd_time"] + g.nodes[n]["bwd_time"] for n in g)

    def __len__(self) -> int:
        return self.graph.number_of_nodes()

"""The plan for a model that declares none: Megatron-LM's pairs in chains of linear layers.

A linear layer whose output reaches exactly one other linear layer through elementwise operations alone (an
activation, dropout, a dtype change) makes a pair: the first colwise, the second rowwise. The split features never
leave the pair, so each pair costs one all-reduce in forward and one in backward. A linear layer left without a
partner (a classifier head) is colwise with its output gathered, when its outputs divide over the ranks: one
all-gather, and each rank holds 1/T of it. Pairs are found in each stage's own graph, so no pair straddles a stage
boundary. Anything else (convolutions, norms, attention) stays whole; `TensorParallelPlan.source` says the plan
was made this way.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from pipetrain.tensor_parallel.placement import is_elementwise
from pipetrain.tensor_parallel.styles import COLWISE, COLWISE_GATHERED, ROWWISE, TensorParallelPlan

SOURCE = "the automatic plan (pairs of linear layers, the others gathered)"


def linear_pairs(module: fx.GraphModule, lanes: int, tied: frozenset[str] = frozenset()) -> TensorParallelPlan:
    """The colwise/rowwise pairs of consecutive linear layers in a stage graph, and its other linear layers colwise
    and gathered where their outputs divide over ``lanes`` ranks, as a plan naming each layer. Layers whose weight
    is in ``tied`` (a copy another stage holds too, such as a language model's head tied to its embedding) stay
    whole: the other copy is not split by this stage's plan."""
    patterns: dict[str, str] = {}
    alone: list[str] = []
    shared = {id(module.get_parameter(name)) for name in tied}  # by identity: a tied tensor has several names
    whole = lambda layer: id(module.get_parameter(f"{layer}.weight")) in shared  # noqa: E731
    for node in module.graph.nodes:
        first = _linear_layer(module, node)
        if first is None or first in patterns or whole(first):
            continue
        alone.append(first)
        value = node
        while len(value.users) == 1:
            (user,) = value.users
            second = _linear_layer(module, user)
            if second is not None and not whole(second):
                divides = module.get_parameter(f"{first}.weight").shape[0] % lanes == 0
                if user.args[0] is value and second not in patterns and divides:
                    patterns[first], patterns[second] = COLWISE, ROWWISE
                break
            if not is_elementwise(module, user) or len(user.all_input_nodes) != 1:
                break
            value = user
    for layer in alone:
        if layer not in patterns and module.get_parameter(f"{layer}.weight").shape[0] % lanes == 0:
            patterns[layer] = COLWISE_GATHERED
    return TensorParallelPlan(patterns, SOURCE, exact=True)


def _linear_layer(module: fx.GraphModule, node: fx.Node) -> str | None:
    """The module name of the nn.Linear ``node`` calls (as a module, or as an ATen linear on its weight)."""
    if node.op == "call_module" and isinstance(module.get_submodule(node.target), nn.Linear):
        return str(node.target)
    if node.op == "call_function" and node.target is torch.ops.aten.linear.default:
        weight = node.args[1]
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            return str(weight.target).rpartition(".")[0]
    return None

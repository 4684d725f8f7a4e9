"""One stage of a plan as an fx.GraphModule.

The stage graph copies the stage's fx nodes in order. Its placeholders are the values
it receives (stage 0: the model's own placeholders, defaults included); it returns the
values later stages need, as a tuple (the last stage returns the model's output as is).
Values of any type (tensors, ints from x.size(0), tuples) pass through unchanged.
Parameters read with get_attr are copied into every stage that reads them. A received
value that the stage modifies in place (ReLU(inplace=True), `x += y`) is cloned first:
the runtime hands stages autograd leaves, which must not be modified in place. A received
tensor the model does not differentiate (node attribute ``requires_grad``) is detached first:
the runtime makes every floating input a leaf, and some ops refuse a leaf that requires grad
where the unsplit model passes none (``cumsum(counts, dtype=torch.int32)`` over a float
histogram of expert choices); detached, it also costs no backward.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.fx.node import map_aggregate
import torch.nn as nn

from .graph import CostGraph


_INPLACE_FUNCTIONS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                      operator.imatmul, operator.setitem}


_VIEW_METHODS = {"view", "view_as", "reshape", "flatten", "unflatten", "transpose", "permute", "squeeze",
                 "unsqueeze", "expand", "contiguous", "t", "narrow", "select", "unfold", "as_strided"}


def mutates_first_arg(node: fx.Node, owner: fx.GraphModule) -> bool:
    """Whether `node` may modify its first argument in place."""
    if node.op == "call_module":
        return bool(getattr(owner.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("__")
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):  # torch.export's ATen calls
        args = node.target._schema.arguments
        return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return (node.target in _INPLACE_FUNCTIONS or bool(node.kwargs.get("inplace"))
                or (name.endswith("_") and not name.startswith("_")))
    return False


def _aliases_first_arg(node: fx.Node, owner: fx.GraphModule) -> bool:
    """Whether `node` may return its first argument or a view of it (nn.Identity, x.view(...))."""
    if node.op == "call_module":
        return isinstance(owner.get_submodule(str(node.target)), nn.Identity)
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    return node.op == "call_function" and getattr(node.target, "__name__", "") in _VIEW_METHODS


def modified_in_place(value: fx.Node, members: set[str], owner: fx.GraphModule, depth: int = 8) -> bool:
    """Whether a node of the stage (`members`) may modify `value` in place, directly or through an
    alias of it (nn.Identity before a ReLU(inplace=True), a view before `add_`)."""
    for user in value.users:
        if user.name not in members or not user.args or user.args[0] is not value:
            continue
        if mutates_first_arg(user, owner):
            return True
        if depth and _aliases_first_arg(user, owner) and modified_in_place(user, members, owner, depth - 1):
            return True
    return False


def stage_graph_module(cg: CostGraph, members: set[str], inputs: list[str],
                       outputs: list[str] | None, name: str) -> fx.GraphModule:
    """GraphModule of one stage, sharing (not copying) the traced model's submodules.

    members: node names in the stage; inputs: values received (ignored for the stage that
    holds the placeholders); outputs: values to return, or None for the last stage."""
    src = cg.module.graph
    nodes = {n.name: n for n in src.nodes}
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env and n.op == "get_attr":
            env[n] = g.get_attr(n.target)  # parameters are replicated, never sent
        return env[n]

    if not any(nodes[m].op == "placeholder" for m in members):
        for value in inputs:
            src_node = nodes[value]
            env[src_node] = g.placeholder(value)
            attrs = cg.graph.nodes[value]
            if attrs["kind"] == "tensor" and not attrs["requires_grad"]:
                env[src_node] = g.call_method("detach", (env[src_node],))
            if modified_in_place(src_node, members, cg.module):
                env[src_node] = g.call_method("clone", (env[src_node],))
    for n in src.nodes:
        if n.name not in members or n.op == "get_attr":
            continue
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], lookup))
        else:
            env[n] = g.node_copy(n, lookup)
    if outputs is not None:
        g.output(tuple(lookup(nodes[v]) for v in outputs))
    stage = fx.GraphModule(cg.module, g, name)
    if outputs is None:  # the last stage also keeps the state no node reads
        cg.state_names.hold_unread(stage, cg.module)
    cg.state_names.apply(stage)
    return stage


def retarget_devices(stage: fx.GraphModule, device: torch.device) -> None:
    """Make the devices ``stage``'s graphs name as constants (``arange(..., device=...)``: torch.export records
    the device of the capture, the meta device for a model built without data) the stage's own ``device``."""
    for module in stage.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        moved = []

        def target(value: object) -> object:
            if isinstance(value, torch.device) and value != device:
                moved.append(value)
                return device
            return value

        for node in module.graph.nodes:
            node.args, node.kwargs = map_aggregate(node.args, target), map_aggregate(node.kwargs, target)
        if moved:
            module.recompile()

"""Zero-bubble backward split: a stage's input gradients now (B), its weight gradients later (W).

B walks the autograd graph from the stage's outputs to its inputs only and keeps the gradients
that reach the nodes where the weights join the input's path; W goes on from those nodes to the
weights. Both are torch.distributed.pipelining's graph helpers, so W runs the same backward
kernels a full backward would (nothing is recomputed) and only the order of work changes.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch


def _graph():
    """torch.distributed.pipelining's graph helpers, imported at first use: the package brings torch._dynamo
    (~0.5 s of every process's start-up) and only the zero-bubble schedules need it."""
    return importlib.import_module("torch.distributed.pipelining._backward")


def split_is_complete(outputs: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether W can reach all of every weight's gradient from what B keeps: every path from a
    weight to an output must join a node an input also reaches. A weight with a path of its own
    (say, an output made of parameters alone) would lose that part of its gradient in a split,
    so such a stage runs its backward whole."""
    if not inputs:
        return False
    graph = _graph()
    roots = [n for n in map(graph._get_grad_fn_or_grad_acc, outputs) if n is not None]
    reverse_edges = graph.construct_reverse_graph(roots)
    inputs_closure, _ = graph.reverse_closure([graph._get_grad_fn_or_grad_acc(t) for t in inputs], set(),
                                              reverse_edges)
    for weight in map(graph._get_grad_fn_or_grad_acc, params):
        if weight not in reverse_edges and weight not in roots:
            continue  # the outputs do not depend on it: no gradient either way
        own, joins = graph.reverse_closure([weight], inputs_closure, reverse_edges)
        if not joins or own & set(roots):
            return False
    return True


def backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None,
                   inputs: list[torch.Tensor], params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """B: accumulate the gradients of ``inputs`` into their ``.grad``; returns what W needs."""
    # The helper detaches the outputs in place once B is done (freeing their graph), which a view cannot
    # be (a Linear on 3-D input returns one): such an output enters as a copy, freed with B's graph.
    outputs = [t.clone() if t._base is not None else t for t in outputs]
    _, groups = _graph().stage_backward_input(outputs, output_grads, inputs, iter(params))
    return groups


def backward_weight(params: list[torch.Tensor], groups: list[dict[str, Any]]) -> None:
    """W: accumulate the gradients of ``params`` into their ``.grad``."""
    _graph().stage_backward_weight(iter(params), groups)

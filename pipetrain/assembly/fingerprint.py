"""What every rank agrees on at ``wrap`` before any compute: the options that must match, the captured model
(graph, boundary sizes, parameter names, shapes and dtypes), the example inputs and the optimizer.

Each rank describes its own setup as short strings, one per field; rank 0 compares them (`differences`) and
every rank raises the same error when one differs, naming the fields and the ranks. Rank 0's plan is then
rebuilt over graphs known to be equal, so every stage boundary has the same shapes and dtypes everywhere.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import torch
from torch import nn

import partitioners
from pipetrain.assembly.stages import make_optimizer

# Options that may differ between ranks: where rank 0 logs, the local engine's devices, and the path each rank
# reads its tensors from (their content is compared when the replicas start: comm.replica_start).
PER_RANK_OPTIONS = ("logdir", "devices", "weights")


def _callable_name(f: Callable) -> str:
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', type(f).__name__)}"


def _option_text(value: Any) -> str:
    return _callable_name(value) if callable(value) else repr(value)


def _tensors_text(value: Any) -> str:
    """Shapes and dtypes of the tensors in ``value`` (a tensor, or a tuple, list or dict of them)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_tensors_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_tensors_text(v) for v in value) + ")"
    return type(value).__name__


def _graph_text(graph: partitioners.CostGraph) -> str:
    """The captured computation and the bytes of every value it makes and every edge it moves (boundary
    tensors among them): equal text, equal stage boundaries under one plan."""
    g = graph.graph
    digest = hashlib.sha256(graph.module.code.encode())
    for n in graph.order:
        digest.update(f"{n} {g.nodes[n]['op']} {g.nodes[n]['target']} {g.nodes[n]['act_bytes']};".encode())
    for u, v, nbytes in sorted(g.edges(data="bytes")):
        digest.update(f"{u}>{v} {nbytes};".encode())
    return f"{len(g)} nodes, sha256 {digest.hexdigest()[:16]}"


def _parameters_text(model: nn.Module) -> str:
    digest, count, elements = hashlib.sha256(), 0, 0
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, t in named:
        digest.update(f"{name} {t.dtype} {tuple(t.shape)};".encode())
        count, elements = count + 1, elements + t.numel()
    return f"{count} tensors, {elements} elements, sha256 {digest.hexdigest()[:16]}"


def _optimizer_text(factory: Callable) -> str:
    """The optimizer the factory makes (class and hyper-parameters), probed on a one-element parameter."""
    optimizer = make_optimizer([nn.Parameter(torch.zeros(1))], factory)  # a factory of something else fails here
    groups = [{k: v for k, v in sorted(g.items()) if k != "params"} for g in optimizer.param_groups]
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__} {groups}"


def fingerprint(options: Any, graph: partitioners.CostGraph, example_inputs: Any) -> dict[str, str]:
    """This rank's description of what it trains, one short string per field."""
    fields = {f"option {f.name}": _option_text(getattr(options, f.name)) for f in dataclasses.fields(options)
              if f.name not in PER_RANK_OPTIONS}
    fields["example inputs (shapes, dtypes)"] = _tensors_text(example_inputs)
    fields["captured model (graph, value and boundary sizes)"] = _graph_text(graph)
    fields["parameter and buffer names, shapes, dtypes"] = _parameters_text(graph.model)
    fields["optimizer (class, hyper-parameters)"] = _optimizer_text(options.optimizer)
    return fields


def differences(per_rank: list[dict[str, str]]) -> str | None:
    """The error every rank raises when their fingerprints differ (None when they agree): each field that
    differs, with rank 0's value and each other value and the ranks that have it."""
    reference = per_rank[0]
    lines = []
    for field in sorted(set().union(*per_rank)):
        values = [found.get(field, "(absent)") for found in per_rank]
        if all(v == values[0] for v in values):
            continue
        by_value: dict[str, list[int]] = {}
        for rank, v in enumerate(values):
            by_value.setdefault(v, []).append(rank)
        lines.append(f"  {field}: " + "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                                                for v, r in by_value.items()))
    if not lines:
        return None
    return ("wrap(): the ranks would not train the same thing, so none starts (nothing was computed). These differ "
            f"between ranks ({len(per_rank)} ranks; rank 0 has {reference.get('option stages')} stages):\n"
            + "\n".join(lines)
            + "\nFix: run the same script with the same arguments on every rank (build the model and its options "
              "from the same config; only logdir, devices and the weights path may differ per rank).")

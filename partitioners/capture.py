"""Capture a model with ``torch.export`` (non-strict) as the same kind of fx graph torch.fx gives.

torch.fx cannot follow much of what real models do (Hugging Face's ``forward(**kwargs)``, shape
arithmetic in Python, masks built from ``input.shape``); non-strict ``torch.export`` runs the
Python code with fake tensors and records ATen calls, as ``torch.distributed.pipelining`` does.
The result is turned into a plain ``fx.GraphModule`` the partitioner, stage builder and runtime
already consume:

- parameters and buffers keep their original qualified names and are the model's own tensors
  (``get_attr`` nodes, each moved just before its first user so a stage holds what it reads);
- placeholders are the forward arguments by name (tensors; every dimension dynamic that the model
  allows, the rest fixed to the example's size and recorded in ``input_sizes.META_KEY``);
- the output is the model's own structure (``ModelOutput``, dict, tuple), rebuilt by the last node;
- export's input guards and pytree codegen are removed (the runtime feeds flat arguments);
- so are its tensor metadata assertions: they check the dtype and device each ``.to()`` input had in the
  capture, which a stage need not share (it may run on another device, or under another autocast).
  They compute nothing; the casts themselves stay.
"""
from __future__ import annotations

import builtins
import contextlib
import inspect
import sys
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils import _pytree as pytree

from . import input_sizes
from .profiling import storage_key

# Keyword arguments a capture for training sets when forward() takes them and the inputs do not:
# a Hugging Face decoder would otherwise return its key/value cache, an inference-only object.
TRAINING_DEFAULTS = {"use_cache": False}
_KEPT_META = ("nn_module_stack", "stack_trace", "scope")


class Restructure(nn.Module):
    """The model's output structure around the graph's flat outputs (the last node of a capture)."""

    def __init__(self, spec: pytree.TreeSpec):
        super().__init__()
        self.spec = spec

    def forward(self, *leaves: Any) -> Any:
        return pytree.tree_unflatten(list(leaves), self.spec)


def bind_inputs(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """Example inputs (tensor, tuple in argument order, or dict of keyword arguments) as forward()'s
    keyword arguments, in the order given."""
    if isinstance(inputs, dict):
        return dict(inputs)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    try:
        bound = inspect.signature(model.forward).bind_partial(*args)
    except TypeError as exc:
        raise TypeError(f"example_inputs do not match {type(model).__name__}.forward{inspect.signature(model.forward)}: "
                        f"{exc}; fix: pass a dict of keyword arguments") from exc
    if any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(model.forward).parameters.values()
           if p.name in bound.arguments):
        raise TypeError(f"{type(model).__name__}.forward takes *args; fix: pass a dict of keyword arguments")
    return dict(bound.arguments)


def training_call(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the TRAINING_DEFAULTS forward() takes and ``kwargs`` does not set. A forward that takes
    ``**kwargs`` (a PEFT model, a wrapper) takes one where the model's config has it: the wrapped model's."""
    params = inspect.signature(model.forward).parameters
    passes_on = any(p.kind is p.VAR_KEYWORD for p in params.values())
    config = getattr(model, "config", None)
    takes = lambda k: k in params or (passes_on and hasattr(config, k))  # noqa: E731
    return {**kwargs, **{k: v for k, v in TRAINING_DEFAULTS.items() if takes(k) and k not in kwargs}}


def export_capture(model: nn.Module, call: dict[str, Any], given: set[str]) -> fx.GraphModule:
    """``model(**call)`` captured by non-strict torch.export as a plain fx.GraphModule (module doc);
    only the arguments named in ``given`` (the user's) stay inputs, the others are constants.

    Raises what torch.export raises when it cannot capture the model."""
    # Every dimension may vary (the batch, a sequence length): export keeps dynamic what the model
    # allows and fixes the rest to the example's size; input_sizes records which, for a clear error.
    dynamic = {k: ({d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) and v.dim() > 0
                   else None) for k, v in call.items()}
    with _symbolic_len(), _attention_masks_as_eager(given):
        program = torch.export.export(model, (), _unaliased(call), strict=False, dynamic_shapes=dynamic)
    limits = input_sizes.from_export(program)
    mixes_samples = input_sizes.outputs_mix_samples(program)
    out_spec = program.call_spec.out_spec
    gm = program.module()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target) == "_guards_fn":
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    _drop_metadata_assertions(gm)
    for node in list(graph.nodes):
        if node.op == "placeholder" and not isinstance(call.get(node.name), torch.Tensor):
            if node.users:
                raise TypeError(f"torch.export kept the non-tensor input {node.name!r} as an input; "
                                "fix: pass it as a tensor or leave it out of the inputs")
            if node.name not in given:
                graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    leaves = output.args[0]
    gm.add_submodule("_pipetrain_output", Restructure(out_spec))
    with graph.inserting_before(output):
        structured = graph.call_module("_pipetrain_output", tuple(leaves))
    structured.meta["scope"] = ""
    output.args = (structured,)
    _move_get_attrs_to_first_use(graph)
    for node in graph.nodes:
        node.meta = {k: v for k, v in node.meta.items() if k in _KEPT_META}  # fake tensors are not needed
        if node.op == "placeholder" and node.name in limits:
            node.meta[input_sizes.META_KEY] = limits[node.name]
    output.meta[input_sizes.MIXES_SAMPLES_KEY] = mixes_samples
    graph._codegen = fx.graph.CodeGen()  # plain positional placeholders, no pytree flattening
    # A plain GraphModule over the same tensors: export's module refuses train()/eval().
    return fx.GraphModule(gm, graph, type(model).__name__)


@contextlib.contextmanager
def _symbolic_len() -> Iterator[None]:
    """``len(tensor)`` as the symbolic size of its dimension 0 while export traces.

    Python's len() must return an int, so ``Tensor.__len__`` fixes the batch size of the example
    (CLIP's contrastive loss builds its labels as ``arange(len(logits))``); torch.export replaces
    ``max``/``min`` the same way for tensors."""
    original = builtins.len

    def symbolic_len(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj).__len__ is torch.Tensor.__len__ and obj.dim() > 0:
            return obj.shape[0]
        return original(obj)

    builtins.len = symbolic_len
    try:
        yield
    finally:
        builtins.len = original


@contextlib.contextmanager
def _attention_masks_as_eager(given: set[str]) -> Iterator[None]:
    """Hugging Face's mask builders decide as they do in eager mode while export traces, where no input
    makes the decision depend on values.

    Eager, a decoder given neither ``attention_mask`` nor ``position_ids`` builds no mask: SDPA runs with
    ``is_causal=True`` and, with grouped-query attention, ``enable_gqa=True`` on the key/value heads as they
    are. Under export the builders keep a mask (an exported program might later decode one token, where
    ``is_causal`` is wrong; a pipeline's captured graph is the training forward alone) and so repeat the
    key/value heads: the same values, rounded otherwise (2e-6 relative after 6 AdamW steps on a small
    grouped-query Llama). The builders read ``position_ids`` for packed sequences: the model's own
    (none given) are never packed. A mask given as input stays a mask: eager drops it only after
    reading that no token is padded, a decision on values the captured graph cannot take."""
    masking = sys.modules.get("transformers.masking_utils")  # imported with any Hugging Face model
    if masking is None or not hasattr(masking, "is_torchdynamo_exporting") or "attention_mask" in given:
        yield
        return
    exporting, packed = masking.is_torchdynamo_exporting, getattr(masking, "find_packed_sequence_indices", None)
    masking.is_torchdynamo_exporting = lambda: False
    if "position_ids" not in given and packed is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting = exporting
        if packed is not None:
            masking.find_packed_sequence_indices = packed


def _unaliased(call: dict[str, Any]) -> dict[str, Any]:
    """``call`` with each tensor input on its own storage: export reads one placeholder for inputs that
    alias each other (``{"input_ids": ids, "labels": ids}``), which later mini-batches need not repeat."""
    seen: set[int] = set()
    out = {}
    for k, v in call.items():
        if isinstance(v, torch.Tensor):
            key = storage_key(v)
            v = v.clone() if key in seen else v
            seen.add(key)
        out[k] = v
    return out


def _drop_metadata_assertions(gm: fx.GraphModule) -> None:
    """Erase the ``aten._assert_tensor_metadata`` calls of ``gm`` and of the graphs nested in it (the
    bodies of autocast regions)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in list(module.graph.nodes):
                if node.target is torch.ops.aten._assert_tensor_metadata.default:
                    module.graph.erase_node(node)
            module.recompile()


def _move_get_attrs_to_first_use(graph: fx.Graph) -> None:
    """export reads every parameter at the top of the graph; the partitioner places a get_attr at
    its position, so each goes just before its first user (and unused ones go)."""
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if not node.users:
            graph.erase_node(node)
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        first.prepend(node)

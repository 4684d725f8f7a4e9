"""model + example inputs -> CostGraph (torch.fx trace, example values, costs)."""
from __future__ import annotations

import copy
import inspect
import os
import traceback
import warnings
from typing import Any, Iterable

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .profiling import estimate, measure, value_bytes
from .errors import TraceError
from .graph import CostGraph

_TORCH_DIR = os.path.dirname(torch.__file__)


class _Tracer(fx.Tracer):
    """fx tracer with extra leaves, TransformerEncoder unrolled into its layers, and a
    record of the submodule being traced (to name the culprit when tracing fails)."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves
        self.stack: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        qualname = self.path_of_module(m)
        if (isinstance(m, nn.TransformerEncoder) and qualname not in self.leaves
                and len(args) == 1 and all(v is None or v is False for v in kwargs.values())):
            # Without masks the encoder just applies its layers in turn; unrolling makes
            # every layer a node the partitioner can cut between.
            x = args[0]
            for layer in m.layers:
                x = self.call_module(layer, layer.forward, (x,), {})
            return self.call_module(m.norm, m.norm.forward, (x,), {}) if m.norm is not None else x
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        self.stack.append(qualname)
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()
        return out


def _user_frame(exc: BaseException) -> str:
    """'file:line: code' of the innermost frame outside torch where exc was raised."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return "<inside torch>"
    f = frames[-1]
    return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"


def _concrete_args(model: nn.Module, n_inputs: int) -> dict[str, Any]:
    """Defaults of forward() arguments the example inputs do not give: tracing them as
    constants keeps `if mask is not None` branches correct for this call."""
    params = list(inspect.signature(model.forward).parameters.values())[n_inputs:]
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _symbolic_trace(model: nn.Module, n_inputs: int, leaves: Iterable[str]
                    ) -> tuple[fx.GraphModule, list[str]]:
    """Trace; a submodule whose forward fx cannot trace becomes a leaf (and is reported)."""
    forced = set(leaves)
    auto: list[str] = []
    concrete = _concrete_args(model, n_inputs)
    while True:
        tracer = _Tracer(forced)
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as exc:  # fx raises many types; all mean "cannot trace this code"
            if not tracer.stack:
                raise TraceError(
                    f"torch.fx cannot trace {type(model).__name__}.forward: {exc}\n"
                    f"  failing code: {_user_frame(exc)}\n"
                    "  fix: make that code traceable (no Python control flow on tensor values; "
                    "use torch.where), or trace with chain=True if the model is a chain of its "
                    "top-level children, or wrap it as nn.Sequential, or keep the offending "
                    "submodules whole with leaves=[...]") from exc
            culprit = tracer.stack[-1]
            forced.add(culprit)
            auto.append(culprit)
            warnings.warn(f"partitioners.trace: {culprit} ({_user_frame(exc)}) cannot be traced by "
                          f"torch.fx ({exc}); it is kept whole as one node", stacklevel=3)
            continue
        return fx.GraphModule(tracer.root, graph, type(model).__name__), auto


def _chain_trace(model: nn.Module) -> fx.GraphModule:
    """The model as the chain of its top-level children, each child one node."""
    graph = fx.Graph()
    first = next(iter(inspect.signature(model.forward).parameters), "x")
    x = graph.placeholder(first)
    for name, _ in model.named_children():
        x = graph.call_module(name, (x,))
    graph.output(x)
    return fx.GraphModule(model, graph, type(model).__name__)


def _as_tuple(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of forward() arguments, "
                    f"got {type(example_inputs).__name__}; fix: pass (x,) or (x, mask)")


def _to(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, value)


def _same(a: Any, b: Any) -> bool:
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                            for x, y in zip(la, lb))


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    leaves, _ = tree_flatten(value)
    return "container" if any(isinstance(t, torch.Tensor) for t in leaves) else "other"


def _scope(node: fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    return paths[-1] if paths else ""


def _node_params(gm: fx.GraphModule, node: fx.Node) -> list[tuple[str, nn.Parameter]]:
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return list(mod.named_parameters(prefix=str(node.target), remove_duplicate=False))
    if node.op == "get_attr":
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        if isinstance(obj, nn.Parameter):
            return [(str(node.target), obj)]
    return []


def trace(model: nn.Module, example_inputs: Any, *, device: str | torch.device = "cpu",
          profile: bool = True, repeats: int = 5, leaves: Iterable[str] = (),
          chain: bool = False) -> CostGraph:
    """Trace `model` with torch.fx and attach costs to every node.

    profile=True times each node's forward and backward on `device` (median of
    `repeats` runs); profile=False estimates them from FLOPs and bytes. `leaves`
    names submodules to keep whole; chain=True treats the model as the chain of its
    top-level children (for models fx cannot trace). The model's parameters, buffers
    and the RNG state are left as they were.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    inputs = _as_tuple(example_inputs)
    dev = torch.device(device)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            return _trace(model, inputs, dev, profile, repeats, leaves, chain)
    finally:
        # Running the model (BatchNorm in train mode) must not change the user's model.
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])


def _trace(model: nn.Module, inputs: tuple, dev: torch.device, profile: bool, repeats: int,
           leaves: Iterable[str], chain: bool) -> CostGraph:
    runner = model
    if any(p.device != dev for p in model.parameters()):
        runner = copy.deepcopy(model).to(dev)  # profile a copy on the target device
    dev_inputs = _to(inputs, dev)
    try:
        with torch.no_grad():
            expected = runner(*dev_inputs)
    except Exception as exc:
        raise ValueError(f"example_inputs do not fit {type(model).__name__}: "
                         f"{type(exc).__name__}: {exc}; fix: pass one micro-batch exactly as "
                         "forward() takes it (a tensor, or a tuple in argument order)") from exc
    if chain:
        gm = _chain_trace(model)
        auto: list[str] = []
    else:
        gm, auto = _symbolic_trace(model, len(inputs), leaves)
    run_gm = gm if runner is model else fx.GraphModule(runner, copy.deepcopy(gm.graph))
    interp = fx.Interpreter(run_gm, garbage_collect_values=False)
    with torch.no_grad():
        got = interp.run(*dev_inputs)
    if chain and not _same(got, expected):
        raise TraceError(f"chain=True: running the top-level children of {type(model).__name__} "
                         "in order does not reproduce its output; fix: pass split points or make "
                         "forward() traceable")
    return _build(model, gm, run_gm, interp, dev, profile, repeats, auto)


def _build(model: nn.Module, gm: fx.GraphModule, run_gm: fx.GraphModule, interp: fx.Interpreter,
           dev: torch.device, profile: bool, repeats: int, auto: list[str]) -> CostGraph:
    g = nx.DiGraph()
    seen: dict[int, str] = {}  # id(parameter) -> first name
    users_of: dict[str, list[str]] = {}  # first param name -> nodes using it
    run_nodes = dict(zip((n.name for n in gm.graph.nodes), run_gm.graph.nodes))
    for idx, node in enumerate(gm.graph.nodes):
        value = interp.env.get(run_nodes[node.name])
        named = _node_params(gm, node)
        new_bytes = 0
        for name, p in named:
            if id(p) not in seen:
                seen[id(p)] = name
                new_bytes += p.numel() * p.element_size()
            users = users_of.setdefault(seen[id(p)], [])
            if node.name not in users:
                users.append(node.name)
        fwd = bwd = 0.0
        if node.op in ("call_module", "call_function", "call_method"):
            rnode = run_nodes[node.name]
            args, kwargs = interp.fetch_args_kwargs_from_env(rnode)
            fn = _callable(interp, rnode)
            module = run_gm.get_submodule(str(node.target)) if node.op == "call_module" else None
            params = list(module.parameters()) if module is not None else []
            if profile:
                fwd, bwd = measure(fn, args, kwargs, params, dev, repeats)
            else:
                pbytes = sum(p.numel() * p.element_size() for p in params)
                fwd, bwd = estimate(fn, args, kwargs, module, value, pbytes, dev)
        g.add_node(node.name, op=node.op, target=_target_name(node), order=idx,
                   fwd_time=fwd, bwd_time=bwd, param_bytes=new_bytes,
                   act_bytes=0 if node.op in ("get_attr", "output") else value_bytes(value),
                   params=[n for n, _ in named], tied=False, kind=_kind(value),
                   scope=_scope(node))
    for node in gm.graph.nodes:
        nbytes = 0 if node.op == "get_attr" else g.nodes[node.name]["act_bytes"]
        for user in node.users:
            g.add_edge(node.name, user.name, bytes=nbytes)
    tied = {name: users for name, users in users_of.items() if len(users) > 1}
    for users in tied.values():
        for u in users:
            g.nodes[u]["tied"] = True
    return CostGraph(graph=g, module=gm, model=model, auto_leaves=auto, tied_params=tied)


def _callable(interp: fx.Interpreter, node: fx.Node) -> Any:
    method = getattr(interp, node.op)
    return lambda *a, **k: method(node.target, a, k)


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)

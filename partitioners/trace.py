"""model + example inputs -> CostGraph (captured graph, example values, costs).

Three captures give the same kind of fx graph: torch.fx symbolic tracing (module calls stay
nodes), torch.export non-strict (ATen calls; see capture.py) and the chain of top-level children.
Calls that depend on the training mode follow the stage module's train()/eval() (modes.py), and
every capture is checked to reproduce the model's eval-mode output.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import re
import traceback
import warnings
from typing import Any, Iterable

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .capture import bind_inputs, export_capture, training_call
from .profiling import estimate, measure, saved_activations, storage_key, value_bytes
from .errors import TraceError
from .graph import CostGraph
from .meta import holds_meta_tensors, saved_on_device, with_meta_tensors
from .modes import follow_training_flag

_TORCH_DIR = os.path.dirname(torch.__file__)


@functools.cache
def _reads_training_flag(cls: type) -> bool:
    """Whether ``cls.forward`` reads ``self.training`` (stochastic depth, hand-written dropout)."""
    try:
        return "self.training" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


class _Tracer(fx.Tracer):
    """fx tracer with extra leaves, TransformerEncoder unrolled into its layers, and a
    record of the submodule being traced (to name the culprit when tracing fails).

    Buffers are proxied (``self.num_batches_tracked.add_(1)`` is recorded, not run at trace
    time), and a module without children whose forward branches on ``self.training`` (timm's
    DropPath) stays a leaf, so its branch follows the stage's mode."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.proxy_buffer_attributes = True
        self.leaves = leaves
        self.stack: list[str] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (qualname in self.leaves or super().is_leaf_module(m, qualname)
                or (not any(True for _ in m.children()) and _reads_training_flag(type(m))))

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


def _concrete_args(model: nn.Module, n_inputs: int, given: Iterable[str] = ()) -> dict[str, Any]:
    """Defaults of forward() arguments the example inputs do not give: tracing them as
    constants keeps `if mask is not None` branches correct for this call."""
    params = list(inspect.signature(model.forward).parameters.values())[n_inputs:]
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty and p.name not in given
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _symbolic_trace(model: nn.Module, n_inputs: int, leaves: Iterable[str], given: Iterable[str] = ()
                    ) -> tuple[fx.GraphModule, list[str]]:
    """Trace; a submodule whose forward fx cannot trace becomes a leaf (and is reported)."""
    forced = set(leaves)
    auto: list[str] = []
    concrete = _concrete_args(model, n_inputs, given)
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
        _drop_constant_placeholders(graph, set(concrete))
        return fx.GraphModule(tracer.root, graph, type(model).__name__), auto


def _drop_constant_placeholders(graph: fx.Graph, concrete: set[str]) -> None:
    """fx keeps a placeholder (and an assert on its value) for every argument traced as a constant;
    the constant replaces it, so the graph's inputs are exactly the arguments the example inputs give,
    as the runtime feeds them."""
    for node in [n for n in graph.nodes if n.op == "placeholder"
                 and re.sub(r"_\d+$", "", str(n.target)) in concrete]:  # fx names it mask_1
        value = node.args[0] if node.args else None
        for user in list(node.users):
            if user.op == "call_function" and getattr(user.target, "__name__", "") == "_assert_is_none":
                graph.erase_node(user)
            else:
                user.args = fx.map_arg(user.args, lambda n: value if n is node else n)
                user.kwargs = fx.map_arg(user.kwargs, lambda n: value if n is node else n)
        graph.erase_node(node)


def _chain_trace(model: nn.Module) -> fx.GraphModule:
    """The model as the chain of its top-level children, each child one node."""
    graph = fx.Graph()
    first = next(iter(inspect.signature(model.forward).parameters), "x")
    x = graph.placeholder(first)
    for name, _ in model.named_children():
        x = graph.call_module(name, (x,))
    graph.output(x)
    return fx.GraphModule(model, graph, type(model).__name__)


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """(positional, keyword) forward() arguments of the example inputs."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    if isinstance(example_inputs, dict) and all(isinstance(k, str) for k in example_inputs):
        return (), dict(example_inputs)
    raise TypeError(f"example_inputs must be a tensor, a tuple of forward() arguments or a dict of "
                    f"keyword arguments, got {type(example_inputs).__name__}; fix: pass x, (x, mask) "
                    "or {'input_ids': ids, 'attention_mask': mask}")


def _placeholder_values(gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The example values of the graph's placeholders, in order (positional first, then by name)."""
    names = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))


def placeholder_values(gm: fx.GraphModule, example_inputs: Any) -> tuple:
    """The values of a traced graph's placeholders, in order, from the example inputs it was traced with."""
    return _placeholder_values(gm, *_split_inputs(example_inputs))


def _close(a: Any, b: Any) -> bool:
    """Same structure, dtypes, shapes and values up to float rounding (ATen calls may group sums differently)."""
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb:
        return False
    return all(_close_tensor(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def _close_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    # The dtype too: under autocast a capture that misses an autocast region computes in another dtype.
    return x.dtype == y.dtype and x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-6, equal_nan=True)


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
    if "scope" in node.meta:  # a call replaced by a TrainingSwitch keeps the module it came from
        return node.meta["scope"]
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


CAPTURES = ("fx", "export", "chain")


def trace(model: nn.Module, example_inputs: Any, *, device: str | torch.device = "cpu",
          profile: bool = True, repeats: int = 5, leaves: Iterable[str] = (),
          chain: bool = False, capture: str = "fx", autocast: torch.dtype | None = None) -> CostGraph:
    """Capture `model` as an fx graph and attach costs to every node.

    example_inputs: one micro-batch as forward() takes it: a tensor, a tuple in argument
    order or a dict of keyword arguments. capture: "fx" (torch.fx symbolic tracing; `leaves`
    names submodules to keep whole), "export" (torch.export non-strict, for code fx cannot
    follow) or "chain" (the model's top-level children in order; chain=True is the same).
    The capture follows the model's current mode (train() for a graph to train) and calls that
    depend on it follow the mode of the stage modules built from it (modes.py).
    profile=True times each node's forward and backward on `device` (median of `repeats`
    runs); profile=False estimates them from FLOPs and bytes. autocast: the dtype of the
    ``torch.autocast`` the stages will run under (None: none). The capture, its checks and the
    profile then run under it too, so the graph records what the model's Python code does there
    (``.to(x.dtype)``, autocast-disabled regions, ``torch.is_autocast_enabled()`` branches) and the
    costs see each value in the dtype it really has. The model's parameters, buffers, training mode
    and the RNG state are left as they were.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    capture = "chain" if chain else capture
    if capture not in CAPTURES:
        raise ValueError(f"unknown capture {capture!r}; choose one of {', '.join(CAPTURES)}")
    args, kwargs = _split_inputs(example_inputs)
    dev = torch.device(device)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    modes = {m: m.training for m in model.modules()}
    try:
        precision = torch.autocast(dev.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), precision:
            return _trace(model, args, kwargs, dev, profile, repeats, leaves, capture)
    finally:
        # Running the model (BatchNorm in train mode) must not change the user's model.
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        for m, training in modes.items():
            m.training = training


def _capture(model: nn.Module, args: tuple, kwargs: dict[str, Any], leaves: Iterable[str], capture: str,
             given: set[str]) -> tuple[fx.GraphModule, list[str]]:
    if capture == "chain":
        if kwargs or len(args) != 1:
            raise TraceError(f"capture='chain' passes one input through the children of {type(model).__name__}, "
                             f"but the inputs are {len(args)} positional and {sorted(kwargs)} keyword arguments")
        return _chain_trace(model), []
    if capture == "export":
        try:
            return export_capture(model, kwargs, given), []
        except Exception as exc:  # torch.export raises many types; all mean "cannot capture this code"
            raise TraceError(
                f"torch.export cannot capture {type(model).__name__}.forward: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
                f"  failing code: {_user_frame(exc)}") from exc
    return _symbolic_trace(model, len(args), leaves, given=kwargs)


def _trace(model: nn.Module, args: tuple, kwargs: dict[str, Any], dev: torch.device, profile: bool,
           repeats: int, leaves: Iterable[str], capture: str) -> CostGraph:
    # A model on the meta device has shapes and no values: it is captured and costed from shapes alone
    # (profile=False's estimate), and the checks that compare values (the plain run, eval mode, the chain)
    # cannot run.
    meta = holds_meta_tensors(model)
    runner, run_dev = model, dev
    if meta:
        if capture == "chain":
            raise TraceError(f"{type(model).__name__} is on the meta device: the chain capture must check its "
                             "children against the model's output, which needs values; fix: make forward() "
                             "capturable by torch.fx or torch.export")
        model = runner = with_meta_tensors(model, model)  # buffers accelerate's init_empty_weights leaves real
        run_dev, profile = torch.device("meta"), False
    elif any(p.device != dev for p in model.parameters()):
        runner = copy.deepcopy(model).to(dev)  # profile a copy on the target device
    given = set(kwargs)
    if capture == "export":  # export takes keyword arguments, and runs as a training call (no KV cache)
        kwargs = bind_inputs(model, args) if args else kwargs
        args, given = (), set(kwargs)
        kwargs = training_call(model, kwargs)
    dev_args, dev_kwargs = _to((args, kwargs), run_dev)
    training = model.training
    expected = None
    try:
        if not meta:  # on the meta device Python code that reads values (mask checks) would fail
            with torch.no_grad():
                expected = runner(*dev_args, **dev_kwargs)
    except Exception as exc:
        raise ValueError(f"example_inputs do not fit {type(model).__name__}: "
                         f"{type(exc).__name__}: {exc}; fix: pass one micro-batch exactly as "
                         "forward() takes it (a tensor, a tuple in argument order or a dict of "
                         "keyword arguments)") from exc
    gm, auto = _capture(model, dev_args, dev_kwargs, leaves, capture, given)
    follow_training_flag(gm)
    run_gm = gm if runner is model else fx.GraphModule(runner, copy.deepcopy(gm.graph))
    inputs = _placeholder_values(gm, dev_args, dev_kwargs)
    interp = fx.Interpreter(run_gm, garbage_collect_values=False)
    try:
        # With autograd recording, as in training: which values require grad (what the profiler makes
        # grad leaves, what stages differentiate) is then read off the values. Holding that graph
        # costs about what one training forward of the model holds.
        with torch.enable_grad():
            got = interp.run(*inputs)
    except Exception as exc:  # e.g. a child that takes more than its predecessor's output
        fix = ("; fix: operations whose output shape depends on values (nonzero, boolean indexing: mixture-of-"
               "experts routing) cannot run without data: wrap the model materialised" if meta else "")
        raise TraceError(f"the {capture} capture of {type(model).__name__} fails on the example inputs: "
                         f"{type(exc).__name__}: {exc}\n  failing code: {_user_frame(exc)}{fix}") from exc
    if not meta:
        if capture == "chain" and not _same(got, expected):
            raise TraceError(f"chain=True: running the top-level children of {type(model).__name__} "
                             "in order does not reproduce its output; fix: pass split points or make "
                             "forward() traceable")
        _check_eval_mode(runner, run_gm, dev_args, dev_kwargs, inputs, capture, training)
    graph = _build(model, gm, run_gm, interp, dev, profile, repeats, auto, meta)
    graph.example_output = torch.utils._pytree.tree_map(
        lambda v: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v,
        got if meta else expected)
    return graph


def _check_eval_mode(runner: nn.Module, run_gm: fx.GraphModule, args: tuple, kwargs: dict[str, Any],
                     inputs: tuple, capture: str, training: bool) -> None:
    """The captured graph in eval mode must give the model's eval output (what predict returns);
    afterwards both are in the mode of the capture again."""
    runner.eval()
    run_gm.eval()
    try:
        with torch.no_grad():
            expected, got = runner(*args, **kwargs), run_gm(*inputs)
    except Exception as exc:
        raise TraceError(f"the {capture} capture of {type(runner).__name__} fails in eval mode: "
                         f"{type(exc).__name__}: {exc}\n  failing code: {_user_frame(exc)}") from exc
    finally:
        runner.train(training)
        run_gm.train(training)
    if not _close(got, expected):
        raise TraceError(
            f"the {capture} capture of {type(runner).__name__} in eval mode does not reproduce the model's "
            "eval-mode output: its forward branches on self.training in a way the capture cannot follow "
            "(e.g. stochastic depth written as `if self.training:`), or, under autocast, changes autocast in "
            "a region the capture does not record (torch.fx keeps no `with torch.autocast(...)` block); fix: "
            "pass split points on the model's top-level children, or make the branch a module call")


def _build(model: nn.Module, gm: fx.GraphModule, run_gm: fx.GraphModule, interp: fx.Interpreter,
           dev: torch.device, profile: bool, repeats: int, auto: list[str], on_meta: bool) -> CostGraph:
    g = nx.DiGraph()
    # Parameters and buffers are passed to the profiler as they are: only activations become grad
    # leaves (a buffer made to require grad breaks F.batch_norm(x, self.running_mean, ...)).
    state = {id(t) for t in run_gm.parameters()} | {id(t) for t in run_gm.buffers()}
    weights = {storage_key(t) for t in (*run_gm.parameters(), *run_gm.buffers())}
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
        saved, saves = 0, []
        if node.op in ("call_module", "call_function", "call_method"):
            rnode = run_nodes[node.name]
            args, kwargs = interp.fetch_args_kwargs_from_env(rnode)
            fn = _callable(interp, rnode)
            module = run_gm.get_submodule(str(node.target)) if node.op == "call_module" else None
            params = list(module.parameters()) if module is not None else []
            params += [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, nn.Parameter)]
            if profile:
                fwd, bwd = measure(fn, args, kwargs, params, dev, repeats, keep=state)
            else:
                pbytes = sum(p.numel() * p.element_size() for p in params)
                fwd, bwd = estimate(fn, args, kwargs, module, value, pbytes, dev, keep=state)
            saving = saved_on_device(node.target, fn) if on_meta else fn
            saved, saves = _saved_values(interp, rnode, saving, args, kwargs, state, weights)
        g.add_node(node.name, op=node.op, target=_target_name(node), order=idx,
                   fwd_time=fwd, bwd_time=bwd, param_bytes=new_bytes,
                   act_bytes=0 if node.op in ("get_attr", "output") else value_bytes(value),
                   params=[n for n, _ in named], tied=False, kind=_kind(value),
                   scope=_scope(node), saved_bytes=saved, saves=saves,
                   requires_grad=isinstance(value, torch.Tensor) and value.requires_grad)
    for node in gm.graph.nodes:
        nbytes = 0 if node.op == "get_attr" else g.nodes[node.name]["act_bytes"]
        for user in node.users:
            g.add_edge(node.name, user.name, bytes=nbytes)
    tied = {name: users for name, users in users_of.items() if len(users) > 1}
    for users in tied.values():
        for u in users:
            g.nodes[u]["tied"] = True
    return CostGraph(graph=g, module=gm, model=model, auto_leaves=auto, tied_params=tied)


def _saved_values(interp: fx.Interpreter, node: fx.Node, fn: Any, args: tuple, kwargs: dict,
                  keep: set[int], weights: set[int]) -> tuple[int, list[str]]:
    """What autograd saves of ``node`` for its backward: bytes it creates and saves, and the names of
    the values (its inputs', its own) it saves. A view of a parameter (an expert's weight transposed
    for a grouped matmul) is the parameter's memory, not an activation: it is not named."""
    owner = {storage_key(t): n.name for n in node.all_input_nodes
             for t in tree_flatten(interp.env.get(n))[0]
             if isinstance(t, torch.Tensor) and storage_key(t) not in weights}
    internal, positions, saves_output = saved_activations(fn, args, kwargs, keep, weights)
    flat = tree_flatten((args, kwargs))[0]
    names = {owner[key] for key in (storage_key(flat[i]) for i in positions) if key in owner}
    return internal, sorted(names) + ([node.name] if saves_output else [])


def _callable(interp: fx.Interpreter, node: fx.Node) -> Any:
    method = getattr(interp, node.op)
    return lambda *a, **k: method(node.target, a, k)


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)

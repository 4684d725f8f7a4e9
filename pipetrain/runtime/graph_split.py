"""Zero-bubble backward split at graph level: a stage's forward (F), input-gradient (B) and
weight-gradient (W) graphs, derived from its joint forward+backward graph.

``pipetrain.runtime.split_backward`` splits the backward by walking the eager autograd graph twice,
which a compiled stage (one opaque autograd node) does not allow. Here the stage is traced once into
its functional joint graph (AOTAutograd: weights, buffers and inputs are graph inputs), partitioned
into forward and backward as torch.compile partitions it (min-cut), and the backward cut in two: B is
every node the input gradients need, its outputs the input gradients and the intermediates W reads;
W is the rest, its outputs the weight gradients. So between B and W a micro-batch keeps only what W
reads (the forward's saved tensors only B reads are dropped after B). Each graph may then be compiled
with inductor. The graphs hold no autograd state: the caller passes tensors in and gets tensors out.

A graph fixes its input shapes and dtypes (``signature``): the caller derives one per signature. ``derive`` raises ``GraphSplitUnsupported`` with the reason where a stage cannot be split
this way (random draws, writes to buffers, a forward that does not trace), and the caller falls back
to the eager split.
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from pipetrain.runtime.loss_checks import compute_loss


class GraphSplitUnsupported(Exception):
    """The stage cannot be split at graph level; the message says why (shown to the user)."""


def signature(tensors: list[torch.Tensor]) -> tuple:
    """What a derived graph is specialised to: each tensor's shape, dtype and whether it takes a gradient."""
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


@dataclass
class GraphSplit:
    """The three graphs of one stage for one input signature, and how their values connect.

    ``forward(*weights, *constants, *inputs, *target) -> (*outputs, *saved)``;
    ``input_grads(*saved[saved_for_b], *tangents) -> (*input grads, *kept)``;
    ``weight_grads(*b_inputs[w_from_b], *saved[w_saved], *kept) -> (*weight grads)``.
    """

    forward: Callable
    input_grads: Callable
    weight_grads: Callable | None      # None: B computes the weight gradients too (no differentiable input)
    out_spec: pytree.TreeSpec          # the structure of the stage's outputs (the loss alone on the last stage)
    num_outputs: int
    tangent_outputs: list[int]         # which outputs take a gradient (a tangent), in tangent order
    saved_for_b: list[int]             # the forward's saved values B reads (before the tangents)
    w_from_b: list[int]                # B's inputs W reads (first)
    w_saved: list[int]                 # the forward's saved values only W reads (next; then B's extra outputs)
    num_input_grads: int


def _joint_function(module: nn.Module, names: list[str], num_inputs: int, target_spec: Any,
                    loss_fn: Callable | None, specs: dict) -> Callable:
    """The stage as a flat function of (weights, constants, inputs, target leaves) returning a flat tuple:
    what AOTAutograd traces. The output's structure is left in ``specs``."""

    def run(*args):
        state = dict(zip(names, args[:len(names)]))
        inputs = args[len(names):len(names) + num_inputs]
        out = torch.func.functional_call(module, state, tuple(inputs))
        if loss_fn is not None:
            target = None if target_spec is None else pytree.tree_unflatten(list(args[len(names) + num_inputs:]),
                                                                            target_spec)
            out = compute_loss(loss_fn, out, target)
        flat, specs["out"] = pytree.tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise GraphSplitUnsupported("its output holds values that are not tensors")
        return tuple(flat)

    return run


def derive(module: nn.Module, inputs: tuple, target: Any = None, loss_fn: Callable | None = None,
           autocast: contextlib.AbstractContextManager | None = None,
           compile_options: dict[str, Any] | None = None) -> GraphSplit:
    """The F, B and W graphs of ``module`` (and of ``loss_fn(output, target)`` when given: the last stage)
    for inputs shaped like ``inputs`` (floating ones with ``requires_grad`` take a gradient), traced under
    ``autocast``; compiled with inductor and ``compile_options`` (its config patches) when those are given.
    Raises GraphSplitUnsupported with the reason where the stage cannot be split this way."""
    if not all(isinstance(v, torch.Tensor) for v in inputs):
        raise GraphSplitUnsupported("its inputs are not all tensors")
    target_leaves, target_spec = ([], None) if target is None else pytree.tree_flatten(target)
    if not all(isinstance(t, torch.Tensor) for t in target_leaves):
        raise GraphSplitUnsupported("the target holds values that are not tensors")
    weights = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    constants = [(n, p) for n, p in module.named_parameters() if not p.requires_grad] + list(module.named_buffers())
    names = [n for n, _ in weights + constants]
    args = tuple([p.detach().requires_grad_() for _, p in weights] + [c.detach() for _, c in constants]
                 + list(inputs) + target_leaves)
    specs: dict[str, Any] = {}
    run = _joint_function(module, names, len(inputs), target_spec, loss_fn, specs)
    with autocast or contextlib.nullcontext():
        taking = _outputs_taking_gradients(run, args)
        try:
            joint = _trace_joint(run, args, len(names))
        except GraphSplitUnsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing failure means: fall back, saying why
            raise GraphSplitUnsupported(_trace_failure(exc)) from exc
    _refuse_random(joint)
    num_outputs = len(taking)
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if len(tangents) != sum(taking):
        raise GraphSplitUnsupported(f"its joint graph has {len(tangents)} output gradients for {sum(taking)} "
                                    "differentiable outputs")
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # see _trace_joint

    forward, backward = min_cut_rematerialization_partition(joint, args, num_fwd_outputs=num_outputs)
    input_slots = [i for i in range(len(names), len(names) + len(inputs)) if args[i].requires_grad]
    b, w, saved_for_b, w_from_b, w_saved = _split_backward(backward, len(tangents), len(weights), input_slots)
    compile_graph = (lambda g: g) if compile_options is None else (lambda g: _Inductor(g, compile_options))
    return GraphSplit(compile_graph(forward), compile_graph(b), None if w is None else compile_graph(w),
                      specs["out"], num_outputs, [i for i, t in enumerate(taking) if t],
                      saved_for_b, w_from_b, w_saved, len(input_slots))


def _trace_failure(exc: Exception) -> str:
    text = str(exc)
    if "input mutations" in text:
        return ("its forward writes into a buffer or an input (batch-norm running statistics, an in-place op): "
                "the graph split needs a forward without side effects")
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"its forward does not trace into one graph (data-dependent control flow or an untraceable op): " \
           f"{type(exc).__name__}: {first[:200]}"


def _refuse_random(joint: fx.GraphModule) -> None:
    """Random draws (dropout) are refused: graph and eager kernels draw different numbers, so a split
    stage would not compute what the eager one does."""
    for node in joint.graph.nodes:
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags \
                and not _without_dropout(node):
            raise GraphSplitUnsupported(f"its forward draws random numbers ({node.target}, e.g. dropout), which "
                                        "the graphs would draw differently from eager")


def _outputs_taking_gradients(run: Callable, args: tuple) -> list[bool]:
    """Per output of ``run``: whether it requires a gradient (AOTAutograd gives each such output a
    tangent, in output order). Run on fake tensors: shapes and autograd flags only, no compute."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            outputs = run(*[mode.from_tensor(a) for a in args])
    except GraphSplitUnsupported:
        raise
    except Exception as exc:  # noqa: BLE001 - as in derive
        raise GraphSplitUnsupported(_trace_failure(exc)) from exc
    return [t.requires_grad for t in outputs]


def _trace_joint(run: Callable, args: tuple, num_params_buffers: int) -> fx.GraphModule:
    """The joint forward+backward graph of ``run``. An output that is an input or a view of one (a
    tensor a stage passes on to a later stage unchanged) is traced as a copy: the graphs hand out
    fresh tensors, and the gradient through a copy is the same."""
    # AOTAutograd brings torch._dynamo (~2 s of every process's start-up): imported where a graph split is made.
    from torch._functorch.aot_autograd import aot_export_joint_simple

    try:
        return aot_export_joint_simple(run, args, trace_joint=True, num_params_buffers=num_params_buffers)
    except RuntimeError as exc:
        if "alias" not in str(exc):
            raise

    def copied(*a):
        return tuple(t.clone() for t in run(*a))

    return aot_export_joint_simple(copied, args, trace_joint=True, num_params_buffers=num_params_buffers)


def _without_dropout(node: fx.Node) -> bool:
    """An op that may draw (attention kernels with a ``dropout_p``) called with ``dropout_p=0``: it draws nothing."""
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return False
    i = names.index("dropout_p")
    p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", node.target._schema.arguments[i].default_value)
    return p == 0


def _split_backward(backward: fx.GraphModule, num_tangents: int, num_weights: int, input_slots: list[int]):
    """Cut the backward graph into B (input gradients and what W reads of B) and W (weight gradients).

    The backward's placeholders are the forward's saved values followed by the tangents; its outputs one
    gradient per forward argument (None where it takes none). Returns B, W and where their inputs come
    from: ``saved_for_b`` (B reads these saved values, then every tangent), ``w_from_b`` (W reads these
    of B's inputs), ``w_saved`` (then these saved values B does not read, then B's extra outputs)."""
    graph = backward.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    saved, tangents = placeholders[:len(placeholders) - num_tangents], placeholders[len(placeholders) - num_tangents:]
    grads = list(next(n for n in graph.nodes if n.op == "output").args[0])
    input_grads = [grads[i] for i in input_slots]
    weight_grads = grads[:num_weights]
    if not input_grads:  # the first stage: nothing to send back, so B is the whole backward
        b_saved = [p for p in saved if p in _ancestors([g for g in weight_grads if g is not None])]
        b = _subgraph(backward, b_saved + tangents, weight_grads)
        return b, None, [saved.index(p) for p in b_saved], [], []
    b_nodes = _ancestors([g for g in input_grads if g is not None])
    # An op of B with several outputs hands W tensors, not the tuple: its getitems are B's too.
    b_nodes |= {n for n in graph.nodes if n.target is operator.getitem and n.args[0] in b_nodes}
    w_nodes = {n for n in _ancestors([g for g in weight_grads if g is not None]) - b_nodes if n.op != "placeholder"}
    # What W reads from outside itself (a saved value, a tangent or a B intermediate), and weight
    # gradients that B's nodes already are (a placeholder or an intermediate passed through).
    w_reads = {a for n in w_nodes for a in n.all_input_nodes if a not in w_nodes}
    w_reads |= {g for g in weight_grads if g is not None and g not in w_nodes}
    b_saved = [p for p in saved if p in b_nodes]
    b_inputs = b_saved + tangents
    from_b_inputs = [p for p in b_inputs if p in w_reads]
    w_saved = [p for p in saved if p in w_reads and p not in b_nodes]
    kept = [n for n in graph.nodes if n in w_reads and n.op != "placeholder"]
    b = _subgraph(backward, b_inputs, input_grads + kept)
    w = _subgraph(backward, from_b_inputs + w_saved + kept, weight_grads)
    return (b, w, [saved.index(p) for p in b_saved], [b_inputs.index(p) for p in from_b_inputs],
            [saved.index(p) for p in w_saved])


def _ancestors(roots: list[fx.Node], stop: frozenset[fx.Node] = frozenset()) -> set[fx.Node]:
    """``roots`` and the nodes they are computed from, not looking past ``stop``."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if n not in stop:
                stack.extend(n.all_input_nodes)
    return seen


def _subgraph(root: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node | None]) -> fx.GraphModule:
    """A graph of ``root``'s nodes that computes ``outputs`` from ``inputs``."""
    needed = _ancestors([o for o in outputs if o is not None], frozenset(inputs))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in root.graph.nodes:
        if n in needed and n not in env and n.op not in ("placeholder", "output"):
            env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] if o is not None else None for o in outputs))
    return fx.GraphModule(root, graph)


# Inductor's code per (graph code, input layouts, options, grad mode), shared by every stage and pipeline of the
# process. torch._inductor.compile bypasses inductor's own FX graph cache for a graph without a shape env (its log:
# 'No shape env'), so without this each stage, chunk and pipeline of the same graph compiled it again (a test
# module of compiled zero-bubble pipelines spent most of its time there). Sharing is safe: weights and buffers are
# graph inputs, CUDA graphs are off (runtime.compiled.graph_compile_options), and graphs that hold constants or
# submodules, which their code names but does not show, are not shared.
_COMPILED: dict[tuple, Callable] = {}


def _compiled(graph: fx.GraphModule, args: list[torch.Tensor], options: dict[str, Any]) -> Callable:
    """Inductor's compiled ``graph`` for ``args``, compiled once per process for the same code and layouts."""
    import torch._inductor

    if any(node.op in ("get_attr", "call_module") for node in graph.graph.nodes):
        return torch._inductor.compile(graph, args, options=options)
    layouts = tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
                    if isinstance(t, torch.Tensor) else repr(t) for t in args)
    key = (graph.code, layouts, repr(sorted(options.items())), torch.is_grad_enabled())
    if key not in _COMPILED:
        _COMPILED[key] = torch._inductor.compile(graph, args, options=options)
    return _COMPILED[key]


class _Inductor:
    """A graph compiled with inductor at its first call, for the tensors of that call (a graph is
    derived per input signature, so its shapes never change)."""

    def __init__(self, graph: fx.GraphModule, options: dict[str, Any]):
        self.graph, self.options = graph, options
        self.compiled: Callable | None = None

    def __call__(self, *args: torch.Tensor) -> tuple:
        if self.compiled is None:
            self.compiled = _compiled(self.graph, list(args), self.options)
        return self.compiled(*args)

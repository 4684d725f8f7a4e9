"""One stage's graph split over its tensor-parallel ranks: where each value is split, and the graph each rank runs.

Every value of the graph is whole (the same on every rank) or split: each rank holds one contiguous 1/T block of one
dimension. A planned layer makes a split value (colwise: its output features) or ends one (rowwise: it reads split
features and sums its partial outputs over the ranks, Megatron-LM's pairing). Walking the graph forward, every
operation that reads a split value either maps the split to a dimension of its output (pointwise operations,
reshapes and transposes, attention over split heads, reductions over other dimensions) or is refused, naming the
node and the fix; so the rewritten graph computes what the whole one does, or the pipeline is not built. A whole
tensor read where values are split passes through `ToLanes`, which sums its gradient (partial on each rank).

Stage boundaries must be whole: a stage's inputs are, and an output that is still split is refused.

Sequence parallelism (a plan naming any module 'sequence_parallel'): a row-parallel layer's partial outputs are
reduce-scattered along the sequence (the next-to-last dimension) instead of all-reduced, and so is a split
vocabulary's lookup. The walk then keeps what follows split along the sequence (pointwise operations, norms, whole
layers applied per token; a whole tensor met there is cut to the rank's slice) until a column-parallel layer
all-gathers its input. An operation no rule maps for such a value reads it all-gathered instead of being refused,
and so does a stage's output: the graph stays exact wherever the sequence cannot stay split.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from partitioners.modes import TrainingSwitch
from pipetrain.tensor_parallel.collectives import (ColumnsFromSlices, GatherLanes, GatherToLanes, ScatterSumOverLanes,
                                                   SliceForLane, SumOverLanes, ToLanes, VocabularyLookup)
from pipetrain.tensor_parallel.randomness import ATTENTIONS, DROPOUTS, LaneDraws
from pipetrain.tensor_parallel.styles import (COLWISE, COLWISE_GATHERED, REPLICATE, ROWWISE, SEQUENCE, VOCABULARY,
                                              TensorParallelPlan)

aten = torch.ops.aten

# Operations that keep a split where it is (elementwise, or a dtype/layout change), besides ATen's pointwise-tagged.
_ELEMENTWISE_NAMES = frozenset({
    "add", "sub", "rsub", "mul", "truediv", "div", "neg", "pow", "relu", "gelu", "silu", "tanh", "sigmoid", "exp",
    "log", "sqrt", "rsqrt", "abs", "sin", "cos", "softplus", "leaky_relu", "elu", "mish", "hardswish", "hardtanh",
    "relu6", "softsign", "clamp", "where", "masked_fill", "dropout", "float", "half", "bfloat16", "double", "to",
    "_to_copy", "type_as", "contiguous", "clone", "detach", "alias", "lift_fresh_copy", "erf"})
_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.ELU,
                        nn.Softplus, nn.Mish, nn.Hardswish, nn.Hardtanh, nn.ReLU6, nn.Softsign)
_SAME_TENSOR = frozenset({"detach", "clone", "contiguous", "alias"})  # a value with its input's shape
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten"})
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "var", "std", "logsumexp", "norm"})
_SOFTMAXES = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})


class TensorParallelError(ValueError):
    """A stage the plan cannot split exactly; the message names the node and what to do."""


@dataclass(frozen=True)
class Lanes:
    """A stage's tensor-parallel ranks: their process group, how many (T) and this rank's place among them."""

    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class ParameterSplit:
    """How one parameter is cut: along ``dim`` (None: held whole)."""

    style: str
    dim: int | None


def split_stage(module: fx.GraphModule, plan: TensorParallelPlan, lanes: Lanes, shapes: dict[str, tuple[int, ...]],
                where: str) -> dict[str, ParameterSplit]:
    """Rewrite ``module`` (a stage graph; ``shapes``: the whole shape of each value by node name) into the graph one
    tensor-parallel rank runs; returns how each planned parameter is to be cut (`pipetrain.tensor_parallel.parameters`
    makes the cut). ``where`` names the stage in messages."""
    return _Splitter(module, plan, lanes, shapes, where).run()


def split_values(module: fx.GraphModule, plan: TensorParallelPlan, lanes: Lanes, shapes: dict[str, tuple[int, ...]],
                 where: str) -> set[str]:
    """The names of ``module``'s nodes whose values the plan leaves split (rewriting ``module``, a throwaway copy):
    a stage boundary must not carry them."""
    splitter = _Splitter(module, plan, lanes, shapes, where, whole_outputs=False)
    splitter.run()
    return {splitter.replaced.get(node, node.name) for node in splitter.split if node not in splitter.sequence}


class _Splitter:
    def __init__(self, module: fx.GraphModule, plan: TensorParallelPlan, lanes: Lanes,
                 shapes: dict[str, tuple[int, ...]], where: str, whole_outputs: bool = True):
        self.gm, self.graph, self.plan, self.lanes, self.where = module, module.graph, plan, lanes, where
        self.whole_outputs = whole_outputs  # a stage's outputs must be whole (not checked for the whole model)
        self.shapes = dict(shapes)
        self.split: dict[fx.Node, int] = {}  # node -> its split dimension, counted from the right (negative)
        self.whole_to_lanes: dict[fx.Node, fx.Node] = {}
        self.started: dict[fx.Node, str] = {}  # a colwise layer's output -> the layer (named in refusals)
        self.replaced: dict[fx.Node, str] = {}  # a planned layer's rewritten call -> the name of the call it replaced
        self.pieces: set[fx.Node] = set()  # chunk/split calls on split values: their items are split alike
        self.params: dict[str, ParameterSplit] = {}
        self._modules = 0
        # Sequence parallelism: the split values that are slices of the sequence (leaving a stage gathered), the
        # gathered and sliced copies made of values, and the column-parallel inputs gathered from slices.
        self.sequence: set[fx.Node] = set()
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.sliced: dict[tuple[fx.Node, int], fx.Node] = {}
        self.gathered_to_lanes: dict[fx.Node, fx.Node] = {}

    # ----- the walk -------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, ParameterSplit]:
        self._inline_layers()
        self.styles = self._parameter_styles()
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                if self.whole_outputs:
                    self._check_outputs(node)
                continue
            planned = self._planned_layer(node)
            if planned is not None:
                self._split_layer(node, *planned)
            elif any(n in self.split for n in node.all_input_nodes):
                self._follow(node)
        self._check_planned_uses()
        self._check_all_placed()
        self._draw_per_lane()
        self._keep_slices_for_backward()
        self.graph.lint()
        self.gm.recompile()
        return self.params

    def _inline_layers(self) -> None:
        """nn.Linear and nn.Embedding calls (a torch.fx-traced stage) as the ATen calls an exported stage makes, so
        both are split alike."""
        for node in list(self.graph.nodes):
            if node.op != "call_module":
                continue
            layer = self.gm.get_submodule(node.target)
            if isinstance(layer, nn.Linear):
                with self.graph.inserting_before(node):
                    weight = self.graph.get_attr(f"{node.target}.weight")
                    bias = self.graph.get_attr(f"{node.target}.bias") if layer.bias is not None else None
                    call = self.graph.call_function(aten.linear.default, (node.args[0], weight, bias))
            elif isinstance(layer, nn.Embedding) and layer.max_norm is None:
                with self.graph.inserting_before(node):
                    weight = self.graph.get_attr(f"{node.target}.weight")
                    padding = -1 if layer.padding_idx is None else layer.padding_idx
                    call = self.graph.call_function(aten.embedding.default, (weight, node.args[0], padding,
                                                                              layer.scale_grad_by_freq, layer.sparse))
            else:
                continue
            if node.name in self.shapes:
                self.shapes[call.name] = self.shapes[node.name]
            node.replace_all_uses_with(call)
            self.graph.erase_node(node)

    # ----- planned layers -------------------------------------------------------------------------------------------
    def _parameter_styles(self) -> dict[int, tuple[str, str, str]]:
        """id of each planned parameter -> (its name, the layer whose plan splits it, style). A tied parameter has
        several names (a language model's embedding and head): it is split if any of its layers is planned, and
        refused where two plans cut it differently."""
        styles: dict[int, tuple[str, str, str]] = {}
        names = {id(p): name for name, p in self.gm.named_parameters()}  # the canonical (first) name
        for alias, param in self.gm.named_parameters(remove_duplicate=False):
            layer, _, kind = alias.rpartition(".")
            style = self.plan.style_of(layer)
            if style in (REPLICATE, SEQUENCE) or kind not in ("weight", "bias"):
                continue
            found = styles.get(id(param))
            if found is not None and _split_dim(found[2], kind) != _split_dim(style, kind):
                raise TensorParallelError(
                    f"{self.where}: {names[id(param)]!r} is tied to {alias!r}, and {self.plan.source} cuts them "
                    f"differently ({found[1]!r}: {found[2]}, {layer!r}: {style}); give both the same style, or "
                    f"tp_plan={{{layer!r}: 'replicate', {found[1]!r}: 'replicate'}}")
            if found is None:
                styles[id(param)] = (names[id(param)], layer, style)
        return styles

    def _planned_layer(self, node: fx.Node) -> tuple[str, str] | None:
        """(the layer's name, how this call runs split) for a linear or embedding call on a planned weight. The
        weight's cut decides: one split by rows (output features, vocabulary) runs as a vocabulary lookup in an
        embedding call and as a colwise matmul in a linear one (gathered, for a weight the plan gathers or a tied
        embedding used as a head); one split by columns runs rowwise."""
        if node.target is aten.linear.default:
            weight = node.args[1]
        elif node.target is aten.embedding.default:
            weight = node.args[0]
        else:
            return None
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            return None
        planned = self.styles.get(id(_attribute(self.gm, str(weight.target))))
        if planned is None:
            return None
        _, layer, style = planned
        if node.target is aten.embedding.default:
            if style == ROWWISE:
                raise TensorParallelError(f"{self.where}: {self.plan.source} cuts {layer!r} by columns (rowwise), but "
                                          f"the model looks rows up in it ({node.format_node()}); give it "
                                          "'embedding_rowwise' or 'replicate'")
            return layer, VOCABULARY
        return layer, COLWISE_GATHERED if style == VOCABULARY else style

    def _split_layer(self, node: fx.Node, layer: str, style: str) -> None:
        T = self.lanes.size
        linear = node.target is aten.linear.default
        weight_node = node.args[1 if linear else 0]
        weight = self.gm.get_parameter(str(weight_node.target))
        dim = 1 if style == ROWWISE else 0
        if weight.shape[dim] % T:
            what = {0: "output features" if linear else "vocabulary rows", 1: "input features"}[dim]
            raise TensorParallelError(f"{self.where}: {layer!r} ({style}) has {weight.shape[dim]} {what}, which do not "
                                      f"divide over tensor_parallel={T} ranks; use a tensor_parallel that divides "
                                      f"{weight.shape[dim]}, or tp_plan={{{layer!r}: 'replicate'}}")
        self._record(weight_node, style, dim)
        has_bias = linear and len(node.args) > 2 and node.args[2] is not None
        if has_bias:
            self._record(node.args[2], style, None if style == ROWWISE else 0)
        g = self.graph
        with g.inserting_before(node):
            local_weight = g.call_method("to_local", (weight_node,))
            if style == VOCABULARY:
                ids = node.args[1]
                self._require_whole(ids, node, "reads its ids")
                if len(node.args) > 3 and node.args[3]:
                    raise TensorParallelError(f"{self.where}: {layer!r} scales gradients by frequency, which a split "
                                              f"vocabulary cannot count; tp_plan={{{layer!r}: 'replicate'}}")
                scatter = self._sequence_dim(node)
                out = g.call_module(self._add(VocabularyLookup(self.lanes.group, self.lanes.rank * weight.shape[0] // T,
                                                               weight.shape[0] // T, scatter)),
                                    (local_weight, ids, *node.args[2:]), dict(node.kwargs))
                if scatter is not None:
                    self._mark_sequence(out, scatter)
            elif style == ROWWISE:
                x = node.args[0]
                if x not in self.split or x in self.sequence:  # a whole input: each rank multiplies its features' block
                    width = weight.shape[1] // T
                    x = g.call_method("narrow", (self._whole_to_lanes(x), -1, self.lanes.rank * width, width))
                elif self.split[x] != -1:
                    raise TensorParallelError(
                        f"{self.where}: {layer!r} is rowwise, so it reads its input features split over the "
                        f"tensor-parallel ranks, but its input {x} is {self._describe(x)}; make the layer that feeds "
                        f"it colwise, or tp_plan={{{layer!r}: 'replicate'}}")
                partial = g.call_function(aten.linear.default, (x, local_weight))
                scatter = self._sequence_dim(node)
                if scatter is None:
                    out = g.call_module(self._add(SumOverLanes(self.lanes.group)), (partial,))
                    if has_bias:
                        out = g.call_function(aten.add.Tensor, (out, node.args[2]))
                else:
                    out = g.call_module(self._add(ScatterSumOverLanes(self.lanes.group, scatter)), (partial,))
                    self._mark_sequence(out, scatter, like=node)
                    if has_bias:  # each rank adds it to its tokens: its gradient summed over the ranks
                        out = g.call_function(aten.add.Tensor, (out, self._to_lanes(node.args[2])))
                        self._mark_sequence(out, scatter, like=node)
            else:
                x = node.args[0]
                if x not in self.sequence:
                    self._require_whole(x, node, f"is the input of colwise {layer!r}; make the layer before it rowwise")
                bias = g.call_method("to_local", (node.args[2],)) if has_bias else None
                out = g.call_function(aten.linear.default, (self._whole_to_lanes(x), local_weight, bias))
                if style == COLWISE_GATHERED:
                    out = g.call_module(self._add(GatherLanes(self.lanes.group, -1)), (out,))
                else:
                    self.split[out] = -1
                    self.started[out] = layer
        if node.name in self.shapes:
            self.shapes[out.name] = self.shapes[node.name]
        self.replaced[out] = node.name
        node.replace_all_uses_with(out)
        g.erase_node(node)

    def _record(self, attr: fx.Node, style: str, dim: int | None) -> None:
        """How the parameter ``attr`` reads is cut, under its canonical name (a tied one: the same for every use)."""
        name = self.styles[id(_attribute(self.gm, str(attr.target)))][0]
        found = self.params.get(name)
        if found is not None and found.dim != dim:
            raise TensorParallelError(f"{self.where}: {name!r} is used by layers that cut it differently "
                                      f"({found.style} and {style}); keep them whole with tp_plan= (style 'replicate')")
        self.params.setdefault(name, ParameterSplit(style, dim))

    def _check_planned_uses(self) -> None:
        """A split parameter is read by split calls alone (a tied copy used whole elsewhere would read a block)."""
        for node in self.graph.nodes:
            if node.op != "get_attr":
                continue
            planned = self.styles.get(id(_attribute(self.gm, str(node.target))))
            split = self.params.get(planned[0]) if planned is not None else None
            if split is None or split.dim is None:
                continue
            for user in node.users:
                if not (user.op == "call_method" and user.target == "to_local"):
                    raise TensorParallelError(
                        f"{self.where}: parameter {node.target!r} is split ({split.style}) but {user.format_node()} "
                        f"also reads it whole; keep its layer whole with tp_plan={{{planned[1]!r}: 'replicate'}}")

    def _check_all_placed(self) -> None:
        """Every parameter of a planned layer was split: a layer the graph calls in another form (not one linear or
        embedding call) is refused rather than silently kept whole."""
        for name, layer, style in self.styles.values():
            if name not in self.params:
                raise TensorParallelError(
                    f"{self.where}: {self.plan.source} splits {layer!r} ({style}), but the stage does not use its "
                    f"parameter {name!r} in one linear or embedding call; keep it whole with "
                    f"tp_plan={{{layer!r}: 'replicate'}}")

    def _draw_per_lane(self) -> None:
        """Random operations on split values (dropout, attention's dropout) draw from a state of the lane's own."""
        for node in [n for n in self.split if n.op in ("call_function", "call_module")]:
            if not self._draws(node):
                continue
            operation = self.gm.get_submodule(node.target) if node.op == "call_module" else node.target
            with self.graph.inserting_before(node):
                drawn = self.graph.call_module(self._add(LaneDraws(operation, self.lanes.rank)), node.args, node.kwargs)
            drawn.meta = dict(node.meta)
            node.replace_all_uses_with(drawn)
            self.graph.erase_node(node)
            self.split[drawn] = self.split.pop(node)
            if node in self.sequence:
                self.sequence.discard(node)
                self.sequence.add(drawn)
            self.replaced[drawn] = self.replaced.pop(node, node.name)
            if node.name in self.shapes:
                self.shapes[drawn.name] = self.shapes[node.name]

    def _keep_slices_for_backward(self) -> None:
        """Sequence parallelism: the colwise layers reading one gathered input run as one `ColumnsFromSlices` call,
        which keeps the slice for their backward instead of the whole input (gathered again there)."""
        order = {n: float(i) for i, n in enumerate(self.graph.nodes)}  # a hoisted node goes just before
        for gathered in self.gathered_to_lanes.values():
            layers = [u for u in gathered.users if u.target is aten.linear.default and u.args[0] is gathered]
            if not layers:
                continue
            layers.sort(key=order.__getitem__)
            first = layers[0]
            operands = [a for u in layers for a in (u.args[1], u.args[2] if len(u.args) > 2 else None)]
            for a in operands:  # the later layers' blocks (to_local of their weights) are made before the call
                self._hoist(a, first, order)
            with self.graph.inserting_before(first):
                fused = self.graph.call_module(
                    self._add(ColumnsFromSlices(self.lanes.group, self.split[gathered.args[0]])),
                    (gathered.args[0], *operands))
            for i, layer in enumerate(layers):
                with self.graph.inserting_after(fused):
                    out = self.graph.call_function(operator.getitem, (fused, i))
                layer.replace_all_uses_with(out)
                for table in (self.split, self.started, self.replaced):
                    if layer in table:
                        table[out] = table.pop(layer)
                if layer.name in self.shapes:
                    self.shapes[out.name] = self.shapes[layer.name]
                self.graph.erase_node(layer)
            if not gathered.users:
                self.graph.erase_node(gathered)
                self.gm.delete_submodule(gathered.target)

    def _hoist(self, node: Any, before: fx.Node, order: dict[fx.Node, float]) -> None:
        """Move ``node`` (and what it reads) before ``before`` where it comes after it."""
        if not isinstance(node, fx.Node) or order[node] < order[before]:
            return
        for n in node.all_input_nodes:
            self._hoist(n, before, order)
        before.prepend(node)
        order[node] = order[before] - 0.5

    def _draws(self, node: fx.Node) -> bool:
        """Whether ``node`` draws random numbers: a dropout, or an attention whose dropout_p follows train() (a
        TrainingSwitch call) or is a constant other than 0."""
        name = self._op_name(node)
        if name in DROPOUTS:
            return True
        if name not in ATTENTIONS:
            return False
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return node.op == "call_module" or p != 0.0

    # ----- operations on split values -------------------------------------------------------------------------------
    def _follow(self, node: fx.Node) -> None:
        """Give ``node``, which reads a split value, the split of its output, or refuse it (sequence slices: read
        them all-gathered instead)."""
        slices = [n for n in node.all_input_nodes if n in self.sequence]
        mixed = any(n in self.split and n not in self.sequence for n in node.all_input_nodes)
        if slices and not mixed:
            try:
                self._apply_rule(node)
            except TensorParallelError:
                pass
            else:
                if node in self.split:
                    self.sequence.add(node)
                return
        for n in slices:  # what the sequence's slices cannot pass through reads them whole
            node.replace_input_with(n, self._gathered(n))
        if any(n in self.split for n in node.all_input_nodes):
            self._apply_rule(node)

    def _apply_rule(self, node: fx.Node) -> None:
        rule = self._rule(node, self._op_name(node))
        if rule is None:
            raise self._refusal(node, "no rule maps a split through this operation")
        rule(node)

    def _rule(self, node: fx.Node, name: str) -> Callable[[fx.Node], None] | None:
        if self._elementwise(node, name):
            return self._pointwise
        if name in _RESHAPES:
            return self._reshape
        table = {"transpose": self._transpose, "swapaxes": self._transpose, "t": self._transpose,
                 "permute": self._permute, "unsqueeze": self._unsqueeze, "squeeze": self._squeeze,
                 "expand": self._expand, "slice": self._along_other, "narrow": self._along_other,
                 "select": self._select, "cat": self._cat, "scaled_dot_product_attention": self._attention,
                 "matmul": self._batched, "bmm": self._batched, "linear": self._replicated_linear,
                 "sym_size": self._size, "size": self._size, "chunk": self._pieces, "split": self._pieces,
                 "split_with_sizes": self._pieces, "getitem": self._piece, "stack": self._stack}
        if name in _REDUCTIONS:
            return self._reduction
        if name in _SOFTMAXES:
            return self._softmax
        return table.get(name)

    def _elementwise(self, node: fx.Node, name: str) -> bool:
        return is_elementwise(self.gm, node, name)

    def _pointwise(self, node: fx.Node) -> None:
        dims = {self.split[n] for n in node.all_input_nodes if n in self.split}
        if len(dims) > 1:
            raise self._refusal(node, f"its inputs are split along different dimensions {sorted(dims)}")
        d = dims.pop()
        slices = any(n in self.sequence for n in node.all_input_nodes)
        for n in node.all_input_nodes:
            shape = None if n in self.split else self._shape(n)
            if slices and shape is not None and len(shape) >= -d and shape[d] != 1:
                node.replace_input_with(n, self._slice(n, d))  # a whole tensor meets each rank's tokens: its slice
            elif shape is not None and len(shape) >= -d and shape[d] != 1:
                raise self._refusal(node, f"it combines the split value with whole {n} of shape {tuple(shape)}, whose "
                                          f"dimension {d} is not broadcast")
        self._wrap_whole_inputs(node)
        self.split[node] = d

    def _reshape(self, node: fx.Node) -> None:
        x = node.args[0]
        before, after = self.shapes.get(x.name), self.shapes.get(node.name)
        if before is None or after is None:
            raise self._refusal(node, "its shapes are unknown")
        a = self.split[x] + len(before)
        prefix = math.prod(before[:a])
        T = self.lanes.size
        # The split goes where the sizes before it multiply to the same. Sizes of 1 make several places match: those
        # before it in ``before`` (a batch of 1) are passed over as often in ``after``; a 1 of its own (one key/value
        # head cut from the split features) stays, and is refused below.
        e = next((e for e in range(len(after) + 1) if math.prod(after[:e]) == prefix), None)
        ones = sum(1 for size in before[:a] if size == 1)
        while e is not None and e < len(after) and after[e] == 1 and ones:
            e, ones = e + 1, ones - 1
        if e is None or e == len(after) or after[e] % T:
            raise self._refusal(node, f"it reshapes {before} (split along dimension {a}) to {after}, which does not "
                                      f"keep a dimension divisible by {T} in the same place (e.g. attention heads or "
                                      "key/value heads that do not divide over the tensor-parallel ranks)")
        if self._op_name(node) != "flatten":
            sizes = list(node.args[1]) if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) \
                else list(node.args[1:])
            if len(sizes) == len(after):
                sizes[e] = self._local_size(node, sizes[e], after[e])
                node.args = (x, sizes) if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) \
                    else (x, *sizes)
        self.split[node] = e - len(after)

    def _local_size(self, node: fx.Node, size: Any, whole: int) -> Any:
        """A size argument of a reshape or expand at the split dimension, as this rank's share."""
        if size == -1:
            return size
        if isinstance(size, int) and size == whole:
            return whole // self.lanes.size
        raise self._refusal(node, f"its size {size} at the split dimension is computed, not a constant; write -1 there")

    def _transpose(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        a = self.split[x] + n
        if self._op_name(node) == "t":
            i, j = 0, 1
        else:
            i, j = (int(v) % n for v in node.args[1:3])
        a = j if a == i else i if a == j else a
        self.split[node] = a - n

    def _permute(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        order = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        order = [int(v) % n for v in order]
        self.split[node] = order.index(self.split[x] + n) - n

    def _unsqueeze(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        a, new = self.split[x] + n, int(node.args[1]) % (n + 1)
        self.split[node] = (a + (new <= a)) - (n + 1)

    def _squeeze(self, node: fx.Node) -> None:
        x = node.args[0]
        before = self.shapes.get(x.name)
        if before is None:
            raise self._refusal(node, "its input's shape is unknown")
        n, a = len(before), self.split[x] + len(before)
        asked = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", range(n))
        asked = {int(v) % n for v in (asked if isinstance(asked, (list, tuple, range)) else [asked])}
        removed = {i for i in asked if before[i] == 1}
        self.split[node] = (a - sum(1 for i in removed if i < a)) - (n - len(removed))

    def _expand(self, node: fx.Node) -> None:
        x = node.args[0]
        after = self.shapes.get(node.name)
        sizes = list(node.args[1])
        d = self.split[x]
        if after is None:
            raise self._refusal(node, "its shapes are unknown")
        sizes[d] = self._local_size(node, sizes[d], after[d])
        node.args = (x, sizes, *node.args[2:])
        self.split[node] = d

    def _along_other(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        dim = int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0))
        if dim % n == self.split[x] + n:
            raise self._refusal(node, "it slices the split dimension")
        self.split[node] = self.split[x]

    def _select(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        dim, a = int(node.args[1]) % n, self.split[x] + n
        if dim == a:
            raise self._refusal(node, "it indexes the split dimension")
        self.split[node] = (a - (dim < a)) - (n - 1)

    def _pieces(self, node: fx.Node) -> None:
        """chunk / split along another dimension than the split one: every piece is split as the input is."""
        x = node.args[0]
        n = self._ndim(x, node)
        dim = int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", 0))
        if dim % n == self.split[x] + n:
            raise self._refusal(node, "it cuts the split dimension into pieces")
        self.split[node] = self.split[x]
        self.pieces.add(node)

    def _piece(self, node: fx.Node) -> None:
        if node.args[0] not in self.pieces:
            raise self._refusal(node, "it indexes a split tensor")
        self.split[node] = self.split[node.args[0]]

    def _cat(self, node: fx.Node) -> None:
        parts = node.args[0]
        if any(p not in self.split for p in parts) or len({self.split[p] for p in parts}) > 1:
            raise self._refusal(node, "it joins split and whole tensors (or tensors split differently)")
        d = self.split[parts[0]]
        n = self._ndim(parts[0], node)
        dim = int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0))
        if dim % n == d + n:
            raise self._refusal(node, "it joins along the split dimension")
        self.split[node] = d

    def _stack(self, node: fx.Node) -> None:
        """Tensors split alike, stacked along a new dimension: the split moves left of it or stays."""
        parts = node.args[0]
        if any(p not in self.split for p in parts) or len({self.split[p] for p in parts}) > 1:
            raise self._refusal(node, "it stacks split and whole tensors (or tensors split differently)")
        n = self._ndim(parts[0], node)
        a = self.split[parts[0]] + n
        new = (int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0))) % (n + 1)
        self.split[node] = (a + (new <= a)) - (n + 1)

    def _attention(self, node: fx.Node) -> None:
        q, k, v = node.args[:3]
        if any(self.split.get(t) != -3 for t in (q, k, v)):
            raise self._refusal(node, "attention splits over heads: query, key and value must all be split along "
                                      f"their heads dimension (found {[self._describe(t) for t in (q, k, v)]})")
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            shape = self._shape(mask)
            if mask in self.split or shape is None or (len(shape) >= 3 and shape[-3] != 1):
                raise self._refusal(node, "its attention mask differs per head")
        self.split[node] = -3

    def _batched(self, node: fx.Node) -> None:
        a, b = node.args[:2]
        if self.split.get(a) is None or self.split.get(a) != self.split.get(b) or self.split[a] > -3:
            raise self._refusal(node, "a matmul keeps a split only along a batch dimension of both operands")
        self.split[node] = self.split[a]

    def _replicated_linear(self, node: fx.Node) -> None:
        d = self.split[node.args[0]]
        if d == -1:
            layer = node.args[1].target.rpartition(".")[0] if isinstance(node.args[1], fx.Node) else node.args[1]
            raise self._refusal(node, f"whole layer {layer!r} reads features split over the tensor-parallel ranks; "
                                      f"make it rowwise in tp_plan")
        self._wrap_whole_inputs(node)
        self.split[node] = d

    def _size(self, node: fx.Node) -> None:
        x = node.args[0]
        if len(node.args) < 2:
            raise self._refusal(node, "it reads the whole shape of a split tensor")
        n = self._ndim(x, node)
        if int(node.args[1]) % n == self.split[x] + n:
            raise self._refusal(node, "it reads the size of the split dimension")

    def _reduction(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None:
            raise self._refusal(node, "it reduces over every dimension, the split one included")
        dims = [int(v) % n for v in (dims if isinstance(dims, (list, tuple)) else [dims])]
        keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
        a = self.split[x] + n
        if a in dims:
            raise self._refusal(node, "it reduces over the split dimension")
        self.split[node] = self.split[x] if keep else (a - sum(1 for v in dims if v < a)) - (n - len(dims))

    def _softmax(self, node: fx.Node) -> None:
        x = node.args[0]
        n = self._ndim(x, node)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None or int(dim) % n == self.split[x] + n:
            raise self._refusal(node, "it normalises over the split dimension")
        self.split[node] = self.split[x]

    # ----- helpers --------------------------------------------------------------------------------------------------
    def _wrap_whole_inputs(self, node: fx.Node) -> None:
        """Whole tensors ``node`` reads next to split ones pass through ToLanes: their gradients are summed."""
        def wrap(arg: fx.Node) -> fx.Node:
            if arg in self.split or self._shape(arg) is None:  # split, or not a tensor
                return arg
            return self._to_lanes(arg)
        node.args = fx.map_arg(node.args, wrap)
        node.kwargs = fx.map_arg(node.kwargs, wrap)

    def _sequence_dim(self, node: fx.Node) -> int | None:
        """Where a row-parallel layer's (or a split vocabulary's) output ``node`` is cut under sequence parallelism:
        its next-to-last dimension (the sequence, or the tokens of a flat batch), if that divides over the ranks;
        None: all-reduced whole."""
        shape = self.shapes.get(node.name)
        if not self.plan.sequence_parallel or shape is None or len(shape) < 2 or shape[-2] % self.lanes.size:
            return None
        return -2

    def _mark_sequence(self, node: fx.Node, dim: int, like: fx.Node | None = None) -> None:
        self.split[node] = dim
        self.sequence.add(node)
        if like is not None and like.name in self.shapes:
            self.shapes[node.name] = self.shapes[like.name]

    def _gathered(self, node: fx.Node) -> fx.Node:
        """The whole value of the sequence slices ``node`` (all-gathered once, after it)."""
        return self._once_after(node, self.gathered, GatherLanes)

    def _once_after(self, node: fx.Node, made: dict[fx.Node, fx.Node], collective: type[nn.Module]) -> fx.Node:
        """``collective`` along ``node``'s split dimension, called on it right after it, once (``made``)."""
        if node not in made:
            with self.graph.inserting_after(node):
                made[node] = self.graph.call_module(self._add(collective(self.lanes.group, self.split[node])), (node,))
            if node.name in self.shapes:
                self.shapes[made[node].name] = self.shapes[node.name]
        return made[node]

    def _slice(self, node: fx.Node, dim: int) -> fx.Node:
        """This rank's slice of dimension ``dim`` of the whole tensor ``node`` (made once, after it)."""
        if (node, dim) not in self.sliced:
            after = node if node.op != "placeholder" else list(self.graph.find_nodes(op="placeholder"))[-1]
            with self.graph.inserting_after(after):
                sliced = self.graph.call_module(self._add(SliceForLane(self.lanes.group, dim)), (node,))
            self.sliced[node, dim] = sliced
            self._mark_sequence(sliced, dim, like=node)
        return self.sliced[node, dim]

    def _whole_to_lanes(self, node: fx.Node) -> fx.Node:
        """``node`` read whole by a column-parallel layer (or cut by a row-parallel one): sequence slices
        all-gathered (their gradient reduce-scattered back), a whole tensor through `ToLanes`."""
        if node not in self.sequence:
            return self._to_lanes(node)
        return self._once_after(node, self.gathered_to_lanes, GatherToLanes)

    def _to_lanes(self, node: fx.Node) -> fx.Node:
        if node not in self.whole_to_lanes:
            after = node if node.op != "placeholder" else list(self.graph.find_nodes(op="placeholder"))[-1]
            with self.graph.inserting_after(after):
                self.whole_to_lanes[node] = self.graph.call_module(self._add(ToLanes(self.lanes.group)), (node,))
            if node.name in self.shapes:
                self.shapes[self.whole_to_lanes[node].name] = self.shapes[node.name]
        return self.whole_to_lanes[node]

    def _add(self, module: nn.Module) -> str:
        name = f"tensor_parallel_{type(module).__name__}_{self._modules}"
        self._modules += 1
        self.gm.add_submodule(name, module)
        return name

    def _require_whole(self, x: Any, node: fx.Node, what: str) -> None:
        if x in self.split:
            raise TensorParallelError(f"{self.where}: {x} is split over the tensor-parallel ranks but {what} "
                                      f"({node.format_node()})")

    def _check_outputs(self, node: fx.Node) -> None:
        for value in node.all_input_nodes:
            if value in self.sequence:  # stages exchange whole tensors
                node.replace_input_with(value, self._gathered(value))
            elif value in self.split:
                raise TensorParallelError(
                    f"{self.where}: {value} leaves the stage split over the tensor-parallel ranks (the stage boundary "
                    "falls between a colwise layer and its rowwise partner); stage boundaries must be whole: move the "
                    "boundary with partitioner=[...] (the node names that start stages), or change tp_plan")

    def _shape(self, x: fx.Node) -> tuple[int, ...] | None:
        """The whole shape of the tensor ``x`` computes (None: not a tensor)."""
        if x.op == "get_attr":
            value = _attribute(self.gm, str(x.target))
            return tuple(value.shape) if isinstance(value, torch.Tensor) else None
        found = self.shapes.get(x.name)
        if found is None and x.op in ("call_method", "call_function") and self._op_name(x) in _SAME_TENSOR \
                and x.args and isinstance(x.args[0], fx.Node):
            return self._shape(x.args[0])  # a call the stage builder added (a received value detached): its input's
        return found

    def _ndim(self, x: fx.Node, node: fx.Node) -> int:
        shape = self.shapes.get(x.name)
        if shape is None:
            raise self._refusal(node, "its input's shape is unknown")
        return len(shape)

    def _describe(self, x: Any) -> str:
        return f"split along dimension {self.split[x]}" if x in self.split else "whole"

    def _op_name(self, node: fx.Node) -> str:
        return op_name(self.gm, node)

    def _refusal(self, node: fx.Node, why: str) -> TensorParallelError:
        layers = sorted(self._split_by(node))
        return TensorParallelError(
            f"{self.where}: tensor parallelism cannot place {node.format_node()}: {why}. The tensor it reads is split "
            f"by {', '.join(map(repr, layers)) or 'a planned layer'} ({self.plan.source}); pair each colwise layer "
            "with a rowwise one before such an operation, keep the layers whole with tp_plan= (style 'replicate'), "
            "or report the operation if it should be supported")

    def _split_by(self, node: fx.Node) -> set[str]:
        """The colwise layers whose split outputs reach ``node``'s inputs."""
        seen, todo, found = set(), [n for n in node.all_input_nodes if n in self.split], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.started:
                found.add(self.started[n])
            todo += [m for m in n.all_input_nodes if m in self.split]
        return found


def op_name(module: nn.Module, node: fx.Node) -> str:
    """What ``node`` computes, by name: an ATen operator's base name, a method's, a module's class or a function's."""
    t = node.target
    if node.op == "call_method":
        return str(t)
    if node.op == "call_module":
        layer = module.get_submodule(t)
        if isinstance(layer, TrainingSwitch):  # a call made to follow train()/eval(): what it calls
            t = layer.fn
        else:
            return type(layer).__name__
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def is_elementwise(module: nn.Module, node: fx.Node, name: str | None = None) -> bool:
    """Whether ``node`` computes each output element from the same element of its inputs (or changes its dtype)."""
    if node.op == "call_module" and not isinstance(module.get_submodule(node.target), TrainingSwitch):
        return isinstance(module.get_submodule(node.target), _ELEMENTWISE_MODULES)
    if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags:
        return True
    return (name or op_name(module, node)) in _ELEMENTWISE_NAMES or node.target in (
        operator.add, operator.sub, operator.mul, operator.truediv, operator.neg)


def _split_dim(style: str, kind: str) -> int | None:
    """The dimension a style cuts a layer's ``kind`` ("weight" or "bias") along (None: whole)."""
    if style == ROWWISE:
        return 1 if kind == "weight" else None
    return 0


def _attribute(module: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name, None)

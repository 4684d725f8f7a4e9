"""Calls whose training flag a capture bakes in, made to follow the stage module's train()/eval().

A model captured in training mode records ``F.dropout(x, p, training=True)``, ``F.batch_norm(...,
training=True)`` (timm's BatchNormAct2d calls it itself), ``aten.dropout(x, p, True)``,
``aten.scaled_dot_product_attention(..., dropout_p=p)`` and BatchNorm's
``num_batches_tracked.add_(1)`` with the mode as a constant. Each such call becomes a
:class:`TrainingSwitch` submodule that reads ``self.training`` at run time, so ``predict`` (eval
mode) runs what the model runs in eval mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class _Flag:
    """Where a call keeps its mode argument and what it becomes in each mode."""

    index: int           # positional index of the argument
    keyword: str         # its keyword name
    kind: str            # "flag": the mode itself; "batch_norm": mode unless no running stats; "p": 0 in eval
    running_mean: int = -1  # batch_norm: positional index of running_mean


_DROPOUTS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)
_FLAGS: dict[Any, _Flag] = {
    **{fn: _Flag(2, "training", "flag") for fn in _DROPOUTS},
    **{op: _Flag(2, "train", "flag") for op in (aten.dropout.default, aten.feature_dropout.default,
                                               aten.alpha_dropout.default, aten.feature_alpha_dropout.default)},
    F.batch_norm: _Flag(5, "training", "batch_norm", running_mean=1),
    aten.batch_norm.default: _Flag(5, "training", "batch_norm", running_mean=3),
    F.scaled_dot_product_attention: _Flag(4, "dropout_p", "p"),
    aten.scaled_dot_product_attention.default: _Flag(4, "dropout_p", "p"),
}


class TrainingSwitch(nn.Module):
    """``fn(*args, **kwargs)`` with its mode argument set from ``self.training``; for a counter
    update (``skip_in_eval``) the call is skipped in eval mode and its first argument returned."""

    def __init__(self, fn: Callable, flag: _Flag | None, captured: Any, skip_in_eval: bool = False,
                 inplace: bool = False):
        super().__init__()
        self.fn, self.flag, self.captured, self.skip_in_eval = fn, flag, captured, skip_in_eval
        self.inplace = inplace  # the stage builder clones a received value an in-place call modifies

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.skip_in_eval:
            return self.fn(*args, **kwargs) if self.training else args[0]
        f = self.flag
        if f.kind == "flag":
            value: Any = self.training
        elif f.kind == "p":
            value = self.captured if self.training else 0.0
        else:
            running_mean = args[f.running_mean] if len(args) > f.running_mean else kwargs.get("running_mean")
            value = self.training or running_mean is None
        if len(args) > f.index:
            args = args[:f.index] + (value,) + args[f.index + 1:]
        else:
            kwargs = {**kwargs, f.keyword: value}
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", str(self.fn))


def _argument(node: fx.Node, flag: _Flag) -> Any:
    if len(node.args) > flag.index:
        return node.args[flag.index]
    return node.kwargs.get(flag.keyword)


def _is_counter_update(node: fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked.add_(1)``: done in training mode only."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    first = node.args[0]
    in_place_add = ((node.op == "call_method" and node.target == "add_")
                    or (node.op == "call_function" and node.target is aten.add_.Tensor))
    return in_place_add and first.op == "get_attr" and str(first.target).endswith("num_batches_tracked")


def follow_training_flag(gm: fx.GraphModule) -> int:
    """Replace the mode-dependent calls of a graph captured in training mode by TrainingSwitch
    submodules (``_pipetrain_mode_<i>``); returns how many. The new nodes keep the scope of the
    call they replace (node.meta["scope"])."""
    count = 0
    for node in list(gm.graph.nodes):
        switch = None
        if _is_counter_update(node):
            fn = getattr(torch.Tensor, "add_") if node.op == "call_method" else node.target
            switch = TrainingSwitch(fn, None, None, skip_in_eval=True)
        elif node.op == "call_function" and node.target in _FLAGS:
            flag = _FLAGS[node.target]
            captured = _argument(node, flag)
            if flag.kind == "p" and not (isinstance(captured, float) and captured > 0):
                continue  # no dropout inside attention: nothing depends on the mode
            if flag.kind != "p" and captured is not True:
                continue  # the code asked for eval behaviour explicitly: keep it
            inplace = bool(node.kwargs.get("inplace")) or (len(node.args) > 3 and node.args[3] is True
                                                           and node.target in _DROPOUTS)
            switch = TrainingSwitch(node.target, flag, captured, inplace=inplace)
        if switch is None:
            continue
        name = f"_pipetrain_mode_{count}"
        gm.add_submodule(name, switch)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, node.args, node.kwargs)
        new.meta = dict(node.meta)
        new.meta.setdefault("scope", _stack_scope(node))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


def _stack_scope(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] if isinstance(v, tuple) else str(k) for k, v in stack.items()]
    return paths[-1] if paths else ""

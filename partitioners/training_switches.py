"""The values that switch on a model's code under ``self.training`` (random layer drop, SpecAugment masking).

Such code draws its randomness in Python (``if self.training and torch.rand([]) < self.config.layerdrop``),
which no capture can follow: export stops at the branch on a drawn value, or bakes one draw into the graph.
Turning the value off is the fix, so a failed capture names the ones that are on. They are found in the
source of the model's own modules: an attribute of ``self.config``, ``config`` or ``self`` that a branch on
``self.training`` reads, and that is a positive number in this model.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from numbers import Real

import torch.nn as nn


def training_switches(model: nn.Module) -> list[str]:
    """``"config.layerdrop = 0.1 (Wav2Vec2Encoder.forward)"`` for every value that is on in ``model``."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        for owner, attr, where in (read for cls in type(module).__mro__ for read in _branch_reads(cls)):
            if owner == "config":
                value, label = getattr(getattr(module, "config", None), attr, None), f"config.{attr}"
            else:
                value, label = getattr(module, attr, None), f"{path or type(model).__name__}.{attr}"
            if isinstance(value, Real) and not isinstance(value, bool) and value > 0:
                found.setdefault(label, f"{label} = {value} ({where})")
    return list(found.values())


@functools.cache
def _branch_reads(cls: type) -> tuple[tuple[str, str, str], ...]:
    """(``"config"`` or ``"self"``, attribute, ``Class.method``) for each attribute a branch on
    ``self.training`` in ``cls``'s own source reads; nothing for torch's classes or source not found."""
    if cls.__module__.split(".")[0] in ("torch", "builtins"):
        return ()
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return ()
    reads = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for node in ast.walk(fn):
            condition = node.test if isinstance(node, (ast.If, ast.IfExp, ast.While)) else node
            if not isinstance(condition, (ast.BoolOp, ast.UnaryOp, ast.Attribute)) or not _reads_training(condition):
                continue
            attrs = _attributes(condition)
            if not attrs and isinstance(node, ast.If):  # `if self.training:` with the draw inside
                attrs = [a for stmt in node.body for c in ast.walk(stmt) if isinstance(c, ast.Compare)
                         for a in _attributes(c)]
            reads += [(owner, attr, f"{cls.__name__}.{fn.name}") for owner, attr in attrs]
    return tuple(dict.fromkeys(reads))


def _is_self_training(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "training"
            and isinstance(node.value, ast.Name) and node.value.id == "self")


def _reads_training(node: ast.AST) -> bool:
    return any(_is_self_training(n) for n in ast.walk(node))


def _attributes(node: ast.AST) -> list[tuple[str, str]]:
    """The ``self.config.x`` / ``config.x`` (as ("config", x)) and ``self.x`` (as ("self", x)) reads in
    ``node``, but ``self.training`` and ``self.config`` themselves."""
    out = []
    for n in ast.walk(node):
        if not isinstance(n, ast.Attribute) or _is_self_training(n):
            continue
        base = n.value
        if isinstance(base, ast.Attribute) and base.attr == "config" and isinstance(base.value, ast.Name) \
                and base.value.id == "self":
            out.append(("config", n.attr))
        elif isinstance(base, ast.Name) and base.id == "config":
            out.append(("config", n.attr))
        elif isinstance(base, ast.Name) and base.id == "self" and n.attr != "config":
            out.append(("self", n.attr))
    return out

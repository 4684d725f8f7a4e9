"""The sizes of a model's inputs a capture runs with, and the check of a micro-batch against them.

torch.export keeps every input dimension symbolic (any size: the batch, a sequence length) unless
the model's code needs its value: a size a parameter pins (image channels, the patches of a fixed
position table) or one forward() turns into a Python number (``int(x.shape[1])``,
``range(x.size(0))``, ``.tolist()``). Such a dimension is fixed to the example's size, and a bound
forward() tests (``if length > max_positions: raise``) becomes the dimension's largest size. Fed
other sizes, the graph would fail with a raw shape error or compute something else; the check
names the input, the dimension and the fix instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

META_KEY = "size_limits"  # placeholder meta: {dimension: SizeLimit}
MIXES_SAMPLES_KEY = "mixes_samples"  # output node meta: an output has a dimension past dim 0 that follows the batch


@dataclass(frozen=True)
class SizeLimit:
    """One dimension of an input: exactly ``fixed`` or at most ``most`` (None where it has no limit)."""

    fixed: int | None = None
    most: int | None = None


def from_export(program: torch.export.ExportedProgram) -> dict[str, dict[int, SizeLimit]]:
    """Per tensor input of ``program``, by name, the dimensions the capture fixed or bounded."""
    user_inputs = set(program.graph_signature.user_inputs)
    limits: dict[str, dict[int, SizeLimit]] = {}
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user_inputs or not isinstance(value, torch.Tensor):
            continue
        dims = {}
        for d, size in enumerate(value.shape):
            # A fixed dimension is an int, or a SymInt whose expression export replaced by a number.
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is None or expr.is_Integer:
                dims[d] = SizeLimit(fixed=int(size))
                continue
            bound = program.range_constraints.get(expr)
            if bound is not None and bound.upper.is_Integer:  # not int_oo (whose is_finite is True)
                dims[d] = SizeLimit(most=int(bound.upper))
        if dims:
            limits[node.name] = dims
    return limits


def outputs_mix_samples(program: torch.export.ExportedProgram) -> bool:
    """Whether an output tensor of ``program`` has a dimension other than dim 0 whose size follows the batch
    (CLIP's ``logits_per_image``: one row and one column per sample): such an output couples the samples, and
    the outputs of micro-batches do not put it together."""
    batch = set()
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() > 0 \
                and isinstance(value.shape[0], torch.SymInt):
            batch |= value.shape[0].node.expr.free_symbols
    output = next(n for n in program.graph.nodes if n.op == "output")
    for leaf in output.args[0]:
        value = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if isinstance(value, torch.Tensor) and any(
                isinstance(size, torch.SymInt) and size.node.expr.free_symbols & batch for size in value.shape[1:]):
            return True
    return False


def of_graph(gm: fx.GraphModule) -> dict[str, dict[int, SizeLimit]]:
    """The limits a capture recorded on ``gm``'s placeholders, by input name (empty: any sizes)."""
    return {str(n.target): n.meta[META_KEY] for n in gm.graph.nodes if n.op == "placeholder" and META_KEY in n.meta}


def check(name: str, value: Any, limits: dict[int, SizeLimit]) -> None:
    """Raise ValueError if input ``name`` of one micro-batch has a size its capture cannot run with."""
    if not isinstance(value, torch.Tensor):
        return
    for d, limit in limits.items():
        if d >= value.dim():  # another rank of input: the model's own error says more than this check
            continue
        size = value.shape[d]
        if limit.fixed is not None and size != limit.fixed:
            what = f"{size} samples in a micro-batch" if d == 0 else f"size {size} in dimension {d}"
            raise ValueError(
                f"input {name!r} has {what}, but the captured model runs only with {limit.fixed} there: "
                f"torch.export fixed dimension {d} to the example's size because forward() needs its value as a "
                f"Python number (int(x.shape[{d}]), range(...), .tolist()) or a parameter's shape pins it; fix: "
                f"feed inputs of that size, or keep the size symbolic in forward() (x.shape[{d}] and torch ops "
                "rather than Python numbers)")
        if limit.most is not None and size > limit.most:
            raise ValueError(
                f"input {name!r} has size {size} in dimension {d}, but the model accepts at most {limit.most} "
                f"there (a bound its forward() checks, e.g. its number of position embeddings); fix: truncate "
                f"or split the inputs to at most {limit.most}")

"""``compile=``: each stage's module run through ``torch.compile``, and what that option may hold.

Shapes: torch's automatic dynamic shapes (``dynamic=None``). A stage compiles for the first input shapes
it sees; the first time the micro-batch size changes, it compiles once more with that dimension symbolic,
likewise the first time the sequence length changes; a micro-batch of one sample gets a graph of its own
(torch specialises sizes 0 and 1). So at most 4 graphs per stage and mode (training forward; the no-grad
forward that recomputation replays; predict), whatever sizes follow (measured in tests/test_compile.py).
Marking dimensions dynamic up front would save one compilation but cost a call per tensor per action.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

# Per stage, not shared: nn.Module.compile compiles nn.Module._call_impl, one code object for every stage
# of the process, whose cache entries would otherwise count against one recompile limit for all of them.
# The limit covers the bound above for the three modes (3 x 4); past it torch runs the stage eager.
DEFAULTS: dict[str, Any] = {"isolate_recompiles": True, "recompile_limit": 12}
# Inductor keeps fused bf16/fp16 intermediates in fp32; rounding them where eager does makes a compiled
# bf16 stage compute what the eager one does (measured: losses 1e-3 relative apart without, equal with).
INDUCTOR_OPTIONS: dict[str, Any] = {"emulate_precision_casts": True}


def compile_arguments(value: Any) -> dict[str, Any] | None:
    """The keyword arguments for ``torch.compile`` that ``compile=value`` asks for (None: run eager).
    ``True`` means ``DEFAULTS`` and ``INDUCTOR_OPTIONS``; a dict is passed on over them (its ``options``
    over ``INDUCTOR_OPTIONS``, which are left out with a ``mode``, as torch.compile takes one or the other,
    and with another ``backend`` than inductor, which takes none),
    its keys checked against ``torch.compile``'s parameters here so a typo fails at ``wrap``, not at the
    first step."""
    if value is False:
        return None
    if value is True:
        return {**DEFAULTS, "options": dict(INDUCTOR_OPTIONS)}
    if not isinstance(value, dict):
        raise TypeError(f"compile must be False, True or a dict of torch.compile arguments, got {value!r} "
                        f"({type(value).__name__}); fix: compile=True, or a dict such as "
                        "compile={'mode': 'max-autotune-no-cudagraphs'}")
    accepted = set(inspect.signature(torch.compile).parameters) - {"model"}
    unknown = sorted(set(value) - accepted)
    if unknown:
        raise ValueError(f"compile={value!r}: torch.compile takes no argument(s) {', '.join(unknown)}; "
                         f"fix: use only {', '.join(sorted(accepted))}")
    arguments = {**DEFAULTS, **value}
    if "mode" not in value and value.get("backend", "inductor") == "inductor":  # other backends take no options
        arguments["options"] = {**INDUCTOR_OPTIONS, **(value.get("options") or {})}
    return arguments


def compile_stage(module: nn.Module, arguments: dict[str, Any]) -> None:
    """Compile ``module``'s calls in place (``nn.Module.compile``): its names, parameters and state dict stay
    those of the eager module, so optimizers, checkpoints, tied weights and staleness policies (which call
    it with other weight tensors swapped in (``pipetrain.runtime.weight_swap``), graph inputs to the compiled code) see no
    wrapper."""
    module.compile(**arguments)


def graph_compile_options(arguments: dict[str, Any]) -> dict[str, Any] | None:
    """What compiling a derived graph (``pipetrain.runtime.graph_split``) takes of ``arguments``: inductor's
    config patches (its ``options``, or those of its ``mode``), or None to run the graphs uncompiled where
    another backend than inductor is asked for (``backend="eager"`` or ``"aot_eager"``: the graphs are
    already what those would run). The dynamo arguments (recompile limits, dynamic shapes) do not apply:
    a graph is derived per input signature."""
    backend = arguments.get("backend", "inductor")
    if backend != "inductor":
        return None
    if "mode" in arguments:
        import torch._inductor
        options = dict(torch._inductor.list_mode_options(arguments["mode"]))
    else:
        options = dict(arguments.get("options") or {})
    # CUDA graphs (mode="reduce-overhead") replay into the same output buffers, but a forward's saved
    # values and B's outputs for W live on across the micro-batches in flight.
    options["triton.cudagraphs"] = False
    return options

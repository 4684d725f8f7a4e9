"""Which layers of a model are split over the tensor-parallel ranks, and how: the plan's vocabulary.

A plan maps module-name patterns to a style, in Hugging Face's vocabulary (``config.base_model_tp_plan``,
``model.tp_plan``): ``"layers.*.self_attn.q_proj": "colwise"``. ``*`` stands for one name component (a layer
index); a pattern matches a module whose dotted name is the pattern or ends with ``"." + pattern`` (HF's base-model
plans name layers below the task head's prefix). The plan comes, in order, from wrap's ``tp_plan=``, from the
model's own (HF), or from `pipetrain.tensor_parallel.automatic` for chains of linear layers.
"""
from __future__ import annotations

import re
from typing import Mapping

from torch import nn

COLWISE = "colwise"  # nn.Linear: output features split (weight rows); its output stays split
ROWWISE = "rowwise"  # nn.Linear: input features split (weight columns; a whole input cut); partial outputs summed
COLWISE_GATHERED = "colwise_gather_output"  # colwise, then its output gathered whole (HF: a language-model head)
VOCABULARY = "embedding_rowwise"  # nn.Embedding: the vocabulary split; each rank looks up its rows, summed
REPLICATE = "replicate"  # every rank holds the whole layer
# Sequence parallelism (Megatron-LM's, HF's and torchtitan's style for norms): naming any module with it turns it on
# for the whole model. The row-parallel outputs are then reduce-scattered along the sequence instead of all-reduced,
# and what runs between them and the next column-parallel layer (dropout, residual adds, norms: the module so named,
# its weights whole) runs on each rank's slice of the sequence; the column-parallel layers all-gather their input.
SEQUENCE = "sequence_parallel"

# HF's names for what pipetrain does under another name. A replicated layer that reads a split tensor (Qwen3's
# per-head q/k norms) gets its gradient summed over the ranks wherever it is used: no style needed for that.
ALIASES = {"colwise_rep": COLWISE_GATHERED, "rowwise_split_input": ROWWISE,
           "replicated_with_grad_allreduce": REPLICATE, "replicated": REPLICATE, "sequence": SEQUENCE}
STYLES = (COLWISE, ROWWISE, COLWISE_GATHERED, VOCABULARY, REPLICATE, SEQUENCE)


class TensorParallelPlan:
    """Module-name patterns -> styles; `style_of` answers for one module name (the first matching pattern, as
    written; no match: replicated). ``exact``: the patterns are whole module names, not suffixes."""

    def __init__(self, patterns: Mapping[str, str], source: str, exact: bool = False):
        self.source = source  # where the plan came from, for messages: "tp_plan=", "the model's tp_plan", ...
        self.patterns: dict[str, str] = {}
        for pattern, style in patterns.items():
            if not isinstance(pattern, str) or not isinstance(style, str):
                raise TypeError(f"{source} maps module-name patterns (str) to styles (str), got {pattern!r}: {style!r}")
            style = ALIASES.get(style, style)
            if style not in STYLES:
                raise ValueError(
                    f"{source}: style {style!r} of {pattern!r} is not one pipetrain runs; styles: {', '.join(STYLES)} "
                    f"(HF's {', '.join(sorted(ALIASES))} too). Pass wrap(..., tp_plan={{{pattern!r}: 'replicate'}}) "
                    "to keep that layer whole, or a colwise/rowwise pair for it")
            self.patterns[pattern] = style
        prefix = "^" if exact else r"(?:^|.*\.)"
        self._compiled = [(re.compile(prefix + _components(pattern) + "$"), style)
                          for pattern, style in self.patterns.items()]

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan runs the values between row- and column-parallel layers split along the sequence."""
        return SEQUENCE in self.patterns.values()

    def style_of(self, module_name: str) -> str:
        """The style of the module named ``module_name`` (its dotted name in the model)."""
        for regex, style in self._compiled:
            if regex.match(module_name):
                return style
        return REPLICATE

    def __repr__(self) -> str:
        return f"TensorParallelPlan({self.patterns!r}, source={self.source!r})"


def _components(pattern: str) -> str:
    """A dotted pattern as a regular expression: ``*`` is one name component, the rest literal."""
    return r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in pattern.split("."))


def model_plan(model: nn.Module) -> Mapping[str, str] | None:
    """The plan a Hugging Face model declares (``model.tp_plan``: its config's ``base_model_tp_plan`` under the
    base model's prefix, and the task head's), or None."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return plan
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        return base
    return None

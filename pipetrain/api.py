"""``pipetrain.wrap``: the one call users make."""
from __future__ import annotations

from typing import Any

from torch import nn

from pipetrain.options import PipelineOptions
from pipetrain.pipeline import Pipeline, plain_inputs


def wrap(model: nn.Module, example_inputs: Any, **options: Any) -> Pipeline:
    """Split ``model`` into pipeline stages and return a :class:`Pipeline` that trains it.

    ``example_inputs`` is one micro-batch of inputs (a tensor, a tuple in argument order or a Mapping of
    keyword arguments such as ``{"input_ids": ids, "attention_mask": mask}``), used to capture and
    profile the model; ``step``/``train``/``predict`` take inputs of the same form. The model's
    output reaches ``loss_fn`` and ``predict`` in its own structure (``ModelOutput``, dict, tuple);
    ``loss_fn=pipetrain.model_loss`` trains a model that computes its loss itself (``labels``). Options are those of :class:`PipelineOptions` (stages, micro_batches,
    schedule, staleness, partitioner, loss_fn, optimizer, precision, data_parallel, engine,
    logdir, ...); an unknown option is an error, not ignored.
    """
    known = PipelineOptions.__dataclass_fields__
    unknown = sorted(k for k in options if k not in known)
    if unknown:
        raise TypeError(f"wrap() got unknown option(s) {unknown}; valid options: "
                        f"{', '.join(known)}")
    return Pipeline(model, plain_inputs(example_inputs), PipelineOptions(**options))

"""``pipetrain.wrap``: the one call users make. Its options are PipelineOptions' fields, written out so that
``help(pipetrain.wrap)`` and an IDE show each with its type and meaning (tests/test_errors.py holds the two
equal: names, order and defaults)."""
from __future__ import annotations

import os
from typing import Any, Callable, Literal

import torch
from torch import nn

from pipetrain.options import PipelineOptions
from pipetrain.pipeline import Pipeline, plain_inputs


def wrap(model: nn.Module, example_inputs: Any, *,
         # --- the pipeline
         stages: int = 4,
         micro_batches: int = 8,
         schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "async-1f1b", "zbv", "dualpipev",
                           "interleaved-zb"] = "1f1b",
         staleness: Literal["none", "vanilla", "stash", "2bw", "spectrain", "nesterov"] = "none",
         partitioner: Literal["graph", "time", "params", "uniform"] | list[str] = "graph",
         # --- what it trains with
         loss_fn: Callable | None = PipelineOptions.loss_fn,
         optimizer: Callable = PipelineOptions.optimizer,
         lr_scheduler: Callable | None = None,
         max_grad_norm: float | None = None,
         norm_type: float = 2.0,
         precision: Literal["fp32", "bf16", "fp16"] = "fp32",
         data_parallel: int = 1,
         engine: Literal["auto", "local", "distributed"] = "auto",
         logdir: str | None = None,
         weights: str | os.PathLike | None = None,
         nonfinite: Literal["raise", "skip"] = "raise",
         # --- tuning knobs with safe defaults
         chunks: int = 2,
         spectrain_variant: Literal["paper", "forward-only"] = "paper",
         lookahead: float = 1.0,
         spike_compensation: bool = False,
         dc_lambda: float = 0.0,
         stage_lr_warmup: int = 0,
         stage_momentum: bool = False,
         error_feedback: bool = False,
         devices: list[torch.device] | None = None,
         seed: int = 0,
         profile: bool = True,
         bandwidth: float | None = None,
         memory_limit: float | None = None,
         recompute: Literal["none", "except-last", "always", "auto"] = "none",
         compile: bool | dict = False,
         dynamic_shapes: bool = False,
         receive_ahead: bool = True,
         timeout: float = 30.0,
         # --- hybrid mode (data_parallel > 1)
         allreduce: Literal["hybrid", "flat", "hierarchical", "per-tensor"] = "hybrid",
         cluster: str | None = None,
         bucket_mb: float = 25.0,
         hierarchy: tuple[int, int] | None = None,
         overlap: bool = True,
         compress: Literal["bf16", "fp16"] | None = None,
         zero: Literal[0, 1, 2, 3] = 0,
         reshard_after_forward: bool = False,
         # --- tensor parallelism inside each stage
         tensor_parallel: int = 1,
         tp_plan: dict[str, str] | None = None,
         **unknown: Any) -> Pipeline:
    """Split ``model`` into pipeline stages and return a :class:`Pipeline` that trains it.

    ``example_inputs`` is one micro-batch of inputs (a tensor, a tuple in argument order or a Mapping of
    keyword arguments such as ``{"input_ids": ids, "attention_mask": mask}``), used to capture and profile
    the model; ``step``/``train``/``predict`` take inputs of the same form. The model's output reaches
    ``loss_fn`` and ``predict`` in its own structure (``ModelOutput``, dict, tuple). A bad value raises
    before anything is captured; an unknown option is an error, not ignored.

    The pipeline:
        stages: pipeline stages (one process each under torchrun, times data_parallel).
        micro_batches: micro-batches each mini-batch is split into.
        schedule: "gpipe", "1f1b", "interleaved-1f1b" (chunks virtual stages per device), "zb-h1"
            (zero bubble, backward split into input and weight gradients), "zbv" and "dualpipev" (zero
            bubble with 2 chunks per device in a V: device 0 holds the first and the last), "interleaved-zb"
            (interleaved 1F1B with the split backward) or "async-1f1b" (no flush).
        staleness: async-1f1b's weight policy: "vanilla", "stash" (PipeDream), "2bw" (PipeDream-2BW),
            "spectrain" (weight prediction) or "nesterov"; "none" for the synchronous schedules.
        partitioner: "graph" (balanced cost graph), "time", "params", "uniform", or a list of the
            graph's node names that start stages 1..stages-1.
    What it trains with:
        loss_fn: (output, target) -> scalar loss; ``pipetrain.model_loss`` for a model that computes its own.
        optimizer: a factory, params -> torch.optim.Optimizer, called once per stage.
        lr_scheduler: a factory, optimizer -> scheduler, stepped once per applied update and checkpointed.
        max_grad_norm: clip by the global gradient norm over every stage and replica (tied copies once),
            after fp16 unscaling; float("inf") measures without clipping. norm_type: its p (inf: max).
        precision: "fp32", "bf16" (autocast) or "fp16" (autocast, fp32 master weights, loss scaling).
        data_parallel: replicas of the pipeline (hybrid mode under torchrun).
        engine: "local" (every stage in this process), "distributed" (torchrun) or "auto".
        logdir: TensorBoard directory (rank 0 writes).
        weights: where the parameters come from: a Hugging Face directory, a .safetensors file, a
            torch.save'd state dict or a pipetrain checkpoint; each rank reads only its stages' tensors.
        nonfinite: a NaN/inf loss or gradient: "raise" on every rank, or "skip" the update everywhere.
    Tuning knobs:
        chunks: virtual stages per device for interleaved-1f1b and interleaved-zb (zbv, dualpipev: always 2).
        spectrain_variant: "paper" or "forward-only" prediction. lookahead: scales the prediction distance.
        spike_compensation: async-1f1b: apply a late gradient's missed momentum share at once (Kosson et al.).
        dc_lambda: async-1f1b: DC-ASGD-a's lambda_0, correcting each gradient to the weights it is applied to.
        stage_lr_warmup: async-1f1b: PipeMare's per-stage rates, lr / (1 + delay) rising to lr over these updates.
        stage_momentum: async-1f1b: each stage's momentum window grows with the square of its delay, at the same
            effective rate (beta_k = 1 - (1 - beta) / (1 + delay)^2).
        error_feedback: async-1f1b: add the last update's error, extrapolated over the delay, W += D (u_t - u_{t-1})
            (Zmushko et al.'s correction for 2bw; any optimizer).
        devices: local engine: the torch.device of each stage.
        seed: dropout and initialisation streams (a meta-device model's weights depend on it and names only).
        profile: time the model's nodes for the graph partitioner. bandwidth: bytes/s between stages.
        memory_limit: bytes per stage the split must fit (predicted peak).
        recompute: activation recomputation: "none", "except-last", "always" or "auto" (fits memory_limit).
        compile: torch.compile each stage: False, True or a dict of torch.compile arguments.
        dynamic_shapes: boundary shapes may depend on values (a header per message).
        receive_ahead: distributed engine: post each receive one computation early.
        timeout: seconds a rank waits for another before it stops with an error naming it (with compile, at least
            10 minutes while a peer may still be compiling: pipetrain.comm.compile_grace; under torchrun, at least
            10 minutes at the rendezvous, where ranks arrive after start-up work of their own: comm.world).
    Hybrid mode:
        allreduce: "hybrid" (per bucket, flat or hierarchical as ``cluster`` prices them), "flat",
            "hierarchical" or "per-tensor". cluster: a preset or Cluster JSON. bucket_mb: bucket size.
        hierarchy: (nodes, replicas per node); None: from LOCAL_WORLD_SIZE.
        overlap: reduce buckets during the last backward. compress: send gradients in "bf16" or "fp16".
        zero: 1 shards the optimizer state over a stage's replicas, 2 the gradients too, 3 the parameters too
            (torch's FSDP2: all-gathered once per step). reshard_after_forward: zero=3 frees them after each
            micro-batch's forward and backward instead.
    Tensor parallelism:
        tensor_parallel: T ranks per stage and replica (ranks = stages x data_parallel x T, the T innermost, so keep
            them on one node); each holds 1/T of every planned layer, with Megatron-LM's all-reduces between them.
        tp_plan: module-name patterns -> "colwise", "rowwise", "colwise_gather_output", "embedding_rowwise" or
            "replicate" (Hugging Face's vocabulary; "layers.*.mlp.up_proj" matches every layer's). None: the model's
            own plan (a Hugging Face model's tp_plan), else colwise/rowwise pairs of consecutive linear layers.
    """
    if unknown:
        raise TypeError(f"wrap() got unknown option(s) {sorted(unknown)}; valid options: "
                        f"{', '.join(PipelineOptions.__dataclass_fields__)}")
    given = locals()
    options = PipelineOptions(**{name: given[name] for name in PipelineOptions.__dataclass_fields__})
    return Pipeline(model, plain_inputs(example_inputs), options)

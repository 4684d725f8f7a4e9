"""The options of ``pipetrain.wrap`` and their validation (one clear error per bad value)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from partitioners.memory_model import SETTINGS
from partitioners.partition import METHODS as PARTITIONERS
from pipetrain.allreduce.reducer import ALGORITHMS as ALLREDUCE
from pipetrain.comm.engine import ENGINES
from pipetrain.optim.muon import factory_cuts_matrices_for_muon
from pipetrain.runtime.compiled import compile_arguments
from pipetrain.runtime.nonfinite import NONFINITE
from pipetrain.runtime.precision import PRECISIONS
from pipetrain.runtime.staleness import PREDICTING, SPECTRAIN_VARIANTS, STALENESS
from pipetrain.runtime.staleness.corrections import DelayCorrections, check_delay_corrections
from pipetrain.runtime.staleness.two_buffered import check_two_buffered
from schedules import BUILDERS
from schedules.cluster import load_cluster

# Each vocabulary is defined where the thing is implemented; these are the names wrap's options use.
SCHEDULES = tuple(BUILDERS)  # gpipe, 1f1b, interleaved-1f1b, zb-h1, async-1f1b, zbv, dualpipev, interleaved-zb
SYNC_SCHEDULES = tuple(k for k in SCHEDULES if k != "async-1f1b")
# Zero-bubble schedules: each backward split into input gradients (B) and weight gradients (W).
SPLIT_BACKWARD_SCHEDULES = ("zb-h1", "zbv", "dualpipev", "interleaved-zb")
# V placement: exactly two chunks per device, the first and the last model piece on device 0.
V_SCHEDULES = ("zbv", "dualpipev")
# Loop placement with `chunks` virtual stages per device.
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "interleaved-zb")
RECOMPUTE = SETTINGS + ("auto",)  # "auto": per stage, the cheapest setting that fits memory_limit
ZERO = (0, 1, 2, 3)


def _default_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@dataclass
class PipelineOptions:
    """Everything ``wrap`` accepts besides the model and its example inputs."""

    stages: int = 4
    micro_batches: int = 8
    schedule: str = "1f1b"
    staleness: str = "none"
    partitioner: str | list[str] = "graph"
    loss_fn: Callable | None = torch.nn.functional.cross_entropy
    optimizer: Callable = _default_optimizer
    # A factory taking a stage's optimizer (like optimizer=), e.g. lambda opt: LambdaLR(opt, warmup_then_cosine):
    # stepped once per applied update (not on a skipped one), its state checkpointed.
    lr_scheduler: Callable | None = None
    # Clip by the global gradient norm over every stage and replica (tied copies once), after fp16 unscaling,
    # as torch.nn.utils.clip_grad_norm_ on the unsplit model; float("inf") measures the norm without clipping.
    max_grad_norm: float | None = None
    norm_type: float = 2.0
    precision: str = "fp32"
    data_parallel: int = 1
    engine: str = "auto"
    logdir: str | None = None
    # Where the parameters come from: a Hugging Face checkpoint directory, a .safetensors file, a torch.save'd
    # state dict or a pipetrain checkpoint directory; each rank reads only its stages' tensors. None: the
    # model's own (a model on the meta device: each module's initialiser, the same at any stage count).
    weights: str | os.PathLike | None = None
    # A NaN/inf loss or gradient at a step: "raise" (an error on every rank naming step, stage and
    # parameter) or "skip" (no update on any stage for that step; StepResult.skipped says so).
    nonfinite: str = "raise"
    # Beyond the contract: tuning knobs with safe defaults.
    chunks: int = 2                    # virtual stages per device: interleaved-1f1b, interleaved-zb; zbv, dualpipev: 2
    spectrain_variant: str = "paper"
    # spectrain / nesterov: scales the prediction distance (1.0: predict the schedule's real lag; see README).
    lookahead: float = 1.0
    # async-1f1b delay corrections, with any policy (pipetrain.runtime.staleness.corrections): spike
    # compensation (Kosson et al.), DC-ASGD-a's lambda_0 (0: off), PipeMare's per-stage rate warm-up (updates; 0: off),
    # delay-matched momentum per stage, error feedback on the update (Zmushko et al., for 2bw).
    spike_compensation: bool = False
    dc_lambda: float = 0.0
    stage_lr_warmup: int = 0
    stage_momentum: bool = False
    error_feedback: bool = False
    devices: list[torch.device] | None = None  # local engine: device per stage
    seed: int = 0
    profile: bool = True
    bandwidth: float | None = None     # bytes/s between stages, for the graph partitioner
    memory_limit: float | None = None  # bytes per stage: the partitioner's split must fit (predicted peak)
    # Activation recomputation: "none" | "except-last" | "always" | "auto" (per stage, the cheapest
    # setting that fits memory_limit).
    recompute: str = "none"
    # torch.compile each stage's module: False, True or a dict of torch.compile arguments (see runtime/compiled.py).
    compile: bool | dict = False
    dynamic_shapes: bool = False
    # Distributed engine: post each receive one computation early, so that it arrives while the computation
    # before its own runs (every direction of every link then has its own process group); False: at use.
    receive_ahead: bool = True
    timeout: float = 30.0              # seconds a rank waits for another before it stops with an error
    # Hybrid mode: how each stage's gradients are averaged over its data-parallel replicas.
    allreduce: str = "hybrid"         # "hybrid": per bucket, flat or hierarchical as `cluster` prices them
    cluster: str | None = None        # preset or Cluster JSON (as `pipetrain plan --cluster`) for allreduce="hybrid"
    bucket_mb: float = 25.0
    hierarchy: tuple[int, int] | None = None  # (nodes, replicas per node); None: from LOCAL_WORLD_SIZE
    overlap: bool = True                      # reduce buckets during the last backward, not after it
    compress: str | None = None               # "bf16" | "fp16": send gradients in low precision
    # ZeRO over the replicas of each stage: 1 shards the optimizer state (each replica steps the tensors it
    # owns, gradients reduce-scattered, parameters all-gathered); 2 also drops the gradients it does not own;
    # 3 shards the parameters too, with torch's FSDP2 (fully_shard over the stage's replicas).
    zero: int = 0
    # zero=3: free the all-gathered parameters after each micro-batch's forward (gathered again for its
    # backward) instead of keeping them from a step's first forward to its gradient reduction.
    reshard_after_forward: bool = False
    # Tensor parallelism: each stage's planned layers split over T ranks (pipetrain.tensor_parallel), with the plan
    # from tp_plan (module-name patterns -> Hugging Face's styles: "colwise", "rowwise", ...), else the model's own
    # (HF's tp_plan), else colwise/rowwise pairs of consecutive linear layers.
    tensor_parallel: int = 1
    tp_plan: dict[str, str] | None = None

    def __post_init__(self) -> None:
        self.validate()  # a bad value fails where it is written, before anything is captured

    def validate(self) -> None:
        """Raise one error naming the first bad value and its fix (called on construction)."""
        def choose(name: str, value: Any, valid) -> None:
            if value not in valid:
                raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(map(str, valid))}")

        if not isinstance(self.stages, int) or self.stages < 1:
            raise ValueError(f"stages must be a positive integer, got {self.stages!r}")
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        if not isinstance(self.data_parallel, int) or self.data_parallel < 1:
            raise ValueError(f"data_parallel must be a positive integer, got {self.data_parallel!r}")
        choose("schedule", self.schedule, SCHEDULES)
        choose("staleness", self.staleness, STALENESS)
        choose("precision", self.precision, PRECISIONS)
        choose("engine", self.engine, ENGINES)
        choose("spectrain_variant", self.spectrain_variant, SPECTRAIN_VARIANTS)
        choose("allreduce", self.allreduce, ALLREDUCE)
        choose("nonfinite", self.nonfinite, NONFINITE)
        choose("recompute", self.recompute, RECOMPUTE)
        if self.recompute == "auto" and self.memory_limit is None:
            raise ValueError("recompute='auto' picks per stage the cheapest setting that fits memory_limit: give "
                             "memory_limit (bytes per stage) or choose recompute='none', 'except-last' or 'always'")
        if not isinstance(self.receive_ahead, bool):
            raise TypeError(f"receive_ahead must be True (post receives one computation early) or False (at use), "
                            f"got {self.receive_ahead!r}")
        if self.max_grad_norm is not None and not (isinstance(self.max_grad_norm, (int, float)) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0 (float('inf'): measure the norm, never clip) or None, "
                             f"got {self.max_grad_norm!r}")
        if not (isinstance(self.norm_type, (int, float)) and self.norm_type > 0):
            raise ValueError(f"norm_type must be a number > 0 (2.0: Euclidean; float('inf'): the largest entry), "
                             f"got {self.norm_type!r}")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError(f"lr_scheduler must be a factory: optimizer -> torch.optim.lr_scheduler.LRScheduler, got "
                            f"{type(self.lr_scheduler).__name__}; fix: lr_scheduler=lambda opt: "
                            "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100))")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        choose("compress", self.compress, (None, "bf16", "fp16"))
        if self.cluster is not None:
            load_cluster(self.cluster)  # a bad preset name or path fails here, naming the presets
        if self.hierarchy is not None and (len(self.hierarchy) != 2 or self.hierarchy[0] * self.hierarchy[1] != self.data_parallel):
            raise ValueError(f"hierarchy={self.hierarchy} must be (nodes, replicas per node) with "
                             f"nodes x replicas per node = data_parallel = {self.data_parallel}")
        self._check_zero()
        self._check_tensor_parallel()
        if not isinstance(self.partitioner, (list, tuple)):
            choose("partitioner", self.partitioner, PARTITIONERS)
        if self.schedule in SYNC_SCHEDULES and self.staleness != "none":
            raise ValueError(
                f"staleness={self.staleness!r} only applies to schedule='async-1f1b'; the {self.schedule} "
                "schedule flushes the pipeline, so weights are never stale: use staleness='none'")
        if self.schedule == "async-1f1b" and self.staleness == "none":
            raise ValueError("schedule='async-1f1b' needs a staleness policy: staleness='vanilla', 'stash' "
                             "(PipeDream weight stashing), '2bw' (PipeDream-2BW), 'spectrain' (weight prediction) "
                             "or 'nesterov' (Nesterov look-ahead)")
        if not isinstance(self.lookahead, (int, float)) or not self.lookahead >= 0:
            raise ValueError(f"lookahead must be a number >= 0 (1.0: predict the schedule's real lag), got {self.lookahead!r}")
        if self.lookahead != 1.0 and self.staleness not in PREDICTING:
            raise ValueError(f"lookahead={self.lookahead} scales the prediction of staleness='spectrain' or 'nesterov'; "
                             f"staleness={self.staleness!r} predicts nothing: leave lookahead at 1.0")
        self._check_delay_corrections()
        if self.staleness == "2bw":
            check_two_buffered(self.stages, self.micro_batches)
        if self.schedule == "async-1f1b" and self.precision == "fp16":
            raise ValueError("fp16 loss scaling needs every stage to agree on skipped steps, which a "
                             "never-flushed async-1f1b pipeline cannot do without stalling: use "
                             "precision='bf16' (no loss scaling) or a synchronous schedule")
        if (self.schedule == "async-1f1b" and self.precision != "fp32" and self.policy_name in ("vanilla", "spectrain")
                and compile_arguments(self.compile) is not None):
            raise ValueError(
                f"staleness={self.staleness!r} with precision={self.precision!r} casts the weights again when the "
                "backward reads them (pipetrain.runtime.live_casts), which a compiled stage's graph does not let "
                "it do: use compile=False, precision='fp32', or a policy whose backward reuses the forward's "
                "weights ('stash', '2bw', 'nesterov', spectrain_variant='forward-only')")
        # A bad value fails here, at wrap; every schedule compiles (split ones their derived B and W graphs).
        compile_arguments(self.compile)
        if self.schedule in INTERLEAVED_SCHEDULES and self.chunks < 2:
            raise ValueError(f"{self.schedule} needs chunks >= 2 virtual stages per device, got {self.chunks}")
        if self.schedule in V_SCHEDULES and self.chunks != 2:
            # chunks' default is 2: only a value the user chose differs
            raise ValueError(f"{self.schedule} runs exactly 2 chunks per device (V placement: device d holds virtual "
                             f"stages d and 2*stages-1-d), got chunks={self.chunks}; leave chunks at 2, or use "
                             "schedule='interleaved-zb' for more chunks per device")
        if self.schedule in V_SCHEDULES + ("interleaved-zb",) and self.stages < 2:
            raise ValueError(f"{self.schedule} needs stages >= 2 (several chunks on each of at least two devices); "
                             "with one stage use schedule='zb-h1' or '1f1b'")
        if self.weights is not None and not isinstance(self.weights, (str, os.PathLike)):
            raise TypeError(f"weights must be a path (a checkpoint directory or file), got "
                            f"{type(self.weights).__name__}; fix: save the state dict (torch.save or "
                            "save_pretrained) and pass its path, or load it into the model before wrap")
        if self.loss_fn is None:
            raise ValueError("loss_fn is required: a callable (output, target) -> scalar loss")
        if isinstance(self.optimizer, torch.optim.Optimizer):
            name = type(self.optimizer).__name__
            raise TypeError(
                f"optimizer is a {name} instance, but pipetrain builds one optimizer per stage over that stage's "
                f"parameters, so it needs a factory: params -> optimizer; fix: optimizer=lambda params: "
                f"torch.optim.{name}(params, lr=...) with the arguments you gave the instance")
        if not callable(self.optimizer):
            raise TypeError(f"optimizer must be a factory: params -> torch.optim.Optimizer, got "
                            f"{type(self.optimizer).__name__}; fix: optimizer=lambda params: "
                            "torch.optim.SGD(params, lr=0.05, momentum=0.9)")
        self._check_whole_matrices()

    def _check_whole_matrices(self) -> None:
        """Refuse torch's own Muon where a rank holds part of a matrix: it would orthogonalise each part, which is
        another update; pipetrain's Muon, a drop-in subclass, gathers the whole matrix first."""
        split = {"zero=3": self.zero == 3, f"tensor_parallel={self.tensor_parallel}": self.tensor_parallel > 1}
        cut = [what for what, on in split.items() if on]
        if cut and factory_cuts_matrices_for_muon(self.optimizer):
            raise ValueError(f"torch.optim.Muon with {' and '.join(cut)}: each rank holds part of a matrix, and "
                             "torch's Muon would orthogonalise each part (another update than the unsplit model's); "
                             "use pipetrain.optim.Muon, torch's Muon with the same arguments that gathers each "
                             "matrix whole, or pipetrain.optim.muon_with_adamw, which builds it")

    def _check_delay_corrections(self) -> None:
        if not isinstance(self.spike_compensation, bool):
            raise TypeError(f"spike_compensation must be True or False, got {self.spike_compensation!r}")
        if not isinstance(self.stage_momentum, bool):
            raise TypeError(f"stage_momentum must be True or False, got {self.stage_momentum!r}")
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if not isinstance(self.dc_lambda, (int, float)) or not self.dc_lambda >= 0:
            raise ValueError(f"dc_lambda must be a number >= 0 (0: off; DC-ASGD-a's lambda_0), got {self.dc_lambda!r}")
        if not isinstance(self.stage_lr_warmup, int) or self.stage_lr_warmup < 0:
            raise ValueError(f"stage_lr_warmup must be a whole number of updates >= 0 (0: off), got {self.stage_lr_warmup!r}")
        corrections = self.delay_corrections
        if not corrections.any:
            return
        if self.schedule != "async-1f1b":
            raise ValueError(f"spike_compensation, dc_lambda, stage_lr_warmup, stage_momentum and error_feedback correct the "
                             f"delay of async-1f1b's gradients; the {self.schedule} schedule has none: leave them off")
        if self.zero:
            raise ValueError("the delay corrections are not implemented with zero > 0 (each replica would need every "
                             "tensor's optimizer state): use zero=0 with them")
        check_delay_corrections(corrections, self.policy_name)

    @property
    def delay_corrections(self) -> DelayCorrections:
        return DelayCorrections(self.spike_compensation, float(self.dc_lambda), self.stage_lr_warmup, self.stage_momentum,
                                self.error_feedback)

    def _check_zero(self) -> None:
        if self.zero not in ZERO:
            raise ValueError(f"zero must be 0 (off), 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters "
                             f"too), got {self.zero!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")
        if self.reshard_after_forward and self.zero != 3:
            raise ValueError("reshard_after_forward frees the parameters zero=3 gathers for each micro-batch; with "
                             f"zero={self.zero} they are not sharded: use zero=3 or leave it False")
        if not self.zero:
            return
        if self.zero == 3:
            self._check_fully_sharded()
        if self.data_parallel == 1 or self.engine == "local":
            raise ValueError(
                f"zero={self.zero} shards a stage's optimizer state over its data-parallel replicas, and "
                + ("data_parallel=1 has none" if self.data_parallel == 1 else "engine='local' runs no replicas")
                + ": use zero=0, or data_parallel > 1 under torchrun (engine='distributed' or 'auto')")

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism needs and does not run yet, refused before anything is captured."""
        T = self.tensor_parallel
        if not isinstance(T, int) or isinstance(T, bool) or T < 1:
            raise ValueError(f"tensor_parallel must be a positive integer, got {T!r}")
        if self.tp_plan is not None and not isinstance(self.tp_plan, Mapping):
            raise TypeError(f"tp_plan must map module-name patterns to styles, e.g. {{'layers.*.mlp.up_proj': "
                            f"'colwise', 'layers.*.mlp.down_proj': 'rowwise'}}; got {type(self.tp_plan).__name__}")
        if T == 1:
            if self.tp_plan is not None:
                raise ValueError("tp_plan says how layers are split over tensor-parallel ranks, and tensor_parallel=1 "
                                 "has none: pass tensor_parallel > 1 with it, or drop tp_plan")
            return
        if self.engine == "local":
            raise ValueError(f"tensor_parallel={T} runs one process per tensor-parallel rank: launch with torchrun "
                             "(engine='distributed' or 'auto')")
        refused = {"schedule='async-1f1b'": self.schedule == "async-1f1b", "compile": bool(self.compile)}
        why = {"schedule='async-1f1b'": "its staleness policies keep and swap whole weight versions",
               "compile": "the compiled graphs would have to trace the tensor-parallel collectives"}
        for what, refuse in refused.items():
            if refuse:
                raise ValueError(f"tensor_parallel={T} with {what} is not supported yet: {why[what]}; use "
                                 f"tensor_parallel=1 with it, or a synchronous schedule and compile=False "
                                 "with tensor parallelism")

    def _check_fully_sharded(self) -> None:
        """What zero=3 (FSDP2) does not run, refused before anything is captured."""
        if self.schedule == "async-1f1b":
            raise ValueError("zero=3 with schedule='async-1f1b' is not supported: its staleness policies keep and swap "
                             "whole weight versions, and FSDP2 keeps each replica's shard only; use zero=1 or 2 with "
                             "async-1f1b, or a synchronous schedule with zero=3")
        if self.compile:
            raise ValueError("zero=3 with compile is not supported yet: the compiled stage and its derived backward "
                             "graphs read the parameters FSDP2 replaces while it gathers them; use compile=False with "
                             "zero=3, or zero=1/2 with compile")

    @property
    def chunks_per_device(self) -> int:
        """Virtual stages (model chunks) per pipeline position under this schedule."""
        if self.schedule in INTERLEAVED_SCHEDULES + V_SCHEDULES:
            return self.chunks
        return 1

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule runs each backward as B (input gradients) and W (weight gradients)."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks_per_device

    @property
    def policy_name(self) -> str:
        if self.staleness == "spectrain":
            return SPECTRAIN_VARIANTS[self.spectrain_variant]
        return self.staleness

"""What one training run of the apps trains and how (RunConfig), and its command-line flags.

The flags are the one definition every training entry point parses: `pipetrain compare` (and so `pipetrain demo`),
the example scripts (examples/_common.py) and examples/huggingface.py, each adding only its own.

Each RunConfig field declares its flag (add_arguments, config_from_args) in its metadata. The fields that are
``pipetrain.wrap`` options carry the option's name and take PipelineOptions' default, so a default the library
changes cannot drift here; an entry point that wants another one (the demo's micro-batches) passes it.
"""
from __future__ import annotations

import argparse
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn.functional as F

import pipetrain
from pipetrain.apps.datasets import DATASETS, DOWNLOADABLE, OFFLINE_DATASETS, dataset_info
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS
from pipetrain.options import PARTITIONERS, PRECISIONS, SCHEDULES, STALENESS, PipelineOptions

_HPARAMS_FALLBACK = {"resnet18": "resnet", "resnet50": "resnet"}
OPTIMIZERS = ("sgd", "nag", "adam", "nadam")  # nag: SGD with Nesterov momentum; nadam: Adam with it
ADAPTIVE = ("adam", "nadam")
ADAM_LR = 1e-3  # torch.optim.Adam's default
RESUME = ("never", "auto")  # auto: continue from the newest checkpoint in checkpoint_dir
PIPELINE_DEFAULTS = {f.name: f.default for f in fields(PipelineOptions)}  # wrap's options and their defaults


def _flag(value: Any, help: str | None = None, *, wrap: str | None = None, pipeline_only: bool = False,
          name: str | None = None, **argparse_kwargs: Any) -> Any:
    """A RunConfig field with default ``value`` that is also a command-line flag, ``--field-name`` unless
    ``name`` is given.

    ``argparse_kwargs`` go to ``add_argument`` (type, choices, action; a ``default`` there replaces
    ``value`` on the command line), ``wrap`` names the ``pipetrain.wrap`` option the field is passed as,
    and ``pipeline_only`` flags are left out of entry points that choose no schedule (`pipetrain compare`)."""
    return field(default=value, metadata={"argparse": dict(argparse_kwargs, help=help), "flag": name,
                                            "wrap": wrap, "pipeline_only": pipeline_only})


def _option(name: str, help: str | None = None, *, pipeline_only: bool = False, **argparse_kwargs: Any) -> Any:
    """A RunConfig field (and flag) that is the ``pipetrain.wrap`` option ``name``, with its default."""
    return _flag(PIPELINE_DEFAULTS[name], help, wrap=name, pipeline_only=pipeline_only, **argparse_kwargs)


def _setting(default: Any, *, wrap: str | None = None) -> Any:
    """A RunConfig field without a command-line flag (programs set it: compare, the tests)."""
    return field(default=default, metadata={"wrap": wrap})


@dataclass
class RunConfig:
    """What to train and how; None means the model family's default (DEFAULT_DATASET, DEFAULT_HPARAMS).

    Each field's metadata declares its command-line flag (see add_arguments) and the ``pipetrain.wrap``
    option it is (see wrap_options); the flags appear in --help in field order."""

    model: str = _flag("vgg")  # add_arguments takes the choices (and the default) from its caller
    dataset: str | None = _flag(None, "default: the model's offline dataset", choices=DATASETS)
    data_dir: str | None = _flag(None, "where cifar10/cifar100/imagefolder live (default $PIPETRAIN_DATA or data)")
    # Fetches cifar10/cifar100 into data_dir: needs the network; run one process.
    download: bool = _flag(False, "download cifar10/cifar100 into --data-dir first (needs the network)",
                           action="store_true")
    width: int | None = _flag(None, "first conv channels / hidden size (default: pipetrain.apps.models)", type=int)
    depth: int | None = _flag(None, "layers (vgg 11/13/16/19, resnet 6n+2, transformer/lstm layers)", type=int)
    stages: int = _option("stages", "pipeline stages (under torchrun: world / data-parallel)", type=int)
    micro_batches: int = _option("micro_batches", "micro-batches per mini-batch", type=int)
    schedule: str = _option("schedule", choices=SCHEDULES, pipeline_only=True)
    # On the command line None stands for the schedule's policy (config_from_args picks it).
    staleness: str = _option("staleness", "async-1f1b: vanilla | stash | 2bw | spectrain | nesterov (default "
                             "spectrain); sync: none", choices=STALENESS, default=None, pipeline_only=True)
    lookahead: float = _option("lookahead", "spectrain/nesterov: scale the prediction distance (1: the schedule's "
                               "real lag)", type=float, pipeline_only=True)
    spectrain_variant: str = _option("spectrain_variant", "spectrain: 'paper' (predict in forward and backward) or "
                                     "'forward-only' (predict in forward, stash for backward)",
                                     choices=("paper", "forward-only"), pipeline_only=True)
    spike_compensation: bool = _option("spike_compensation", "async-1f1b: apply a late gradient's missed momentum at "
                                       "once (Kosson et al.)", action="store_true", pipeline_only=True)
    dc_lambda: float = _option("dc_lambda", "async-1f1b: DC-ASGD-a's lambda_0 (0: off)", type=float, pipeline_only=True)
    stage_lr_warmup: int = _option("stage_lr_warmup", "async-1f1b: PipeMare's per-stage rate warm-up, in updates "
                                   "(0: off)", type=int, pipeline_only=True)
    stage_momentum: bool = _option("stage_momentum", "async-1f1b: each stage's momentum window grows with the "
                                   "square of its delay, at the same effective rate", action="store_true",
                                   pipeline_only=True)
    error_feedback: bool = _option("error_feedback", "async-1f1b: add the last update's error, extrapolated over the "
                                   "delay (Zmushko et al., for 2bw)", action="store_true", pipeline_only=True)
    data_parallel: int = _option("data_parallel", "replicas of the whole pipeline", type=int, pipeline_only=True)
    engine: str = _setting(PIPELINE_DEFAULTS["engine"], wrap="engine")
    checkpoint_dir: str | None = _flag(None, "save a checkpoint here after every epoch, and on SIGTERM (then exit 0)",
                                       pipeline_only=True)
    resume: str = _flag("never", "continue from the newest checkpoint in --checkpoint-dir, if there is one",
                        action="store_const", const="auto", pipeline_only=True)
    precision: str = _option("precision", choices=PRECISIONS)
    partitioner: str = _option("partitioner", choices=PARTITIONERS)
    # Time each layer for the graph/time partitioners (False: estimate them; deterministic).
    profile: bool = _setting(PIPELINE_DEFAULTS["profile"])
    epochs: int | None = _flag(None, "default: the model family's DEFAULT_HPARAMS", type=int)
    batch_size: int | None = _flag(None, "global mini-batch size", type=int)
    optimizer: str = _flag("sgd", "sgd (momentum 0.9), nag (the same with Nesterov momentum), adam or nadam",
                           choices=OPTIMIZERS)
    lr: float | None = _flag(None, "learning rate (default: the family's SGD rate; 1e-3 with adam)", type=float)
    momentum: float = _setting(0.9)
    seed: int = _option("seed", type=int)
    train_samples: int | None = _flag(None, "use only the first N training samples", type=int)
    val_samples: int | None = _flag(None, "use only the first N validation samples", type=int)
    logdir: str | None = _option("logdir", "TensorBoard run directory")
    progress: bool = _flag(True, "show no progress (bar, step or epoch lines), only the summary", name="--no-progress",
                           action="store_false")
    label: str = _setting("")  # names the run in the progress bar and summary line

    def resolved(self) -> "RunConfig":
        """A copy with every family default filled in (dataset, epochs, batch size, lr)."""
        if self.model not in DEFAULT_DATASET:
            raise ValueError(f"unknown model {self.model!r}; choose one of {sorted(DEFAULT_DATASET)}")
        if self.resume not in RESUME:
            raise ValueError(f"resume must be 'never' or 'auto', got {self.resume!r}")
        if self.resume == "auto" and not self.checkpoint_dir:
            raise ValueError("resume='auto' needs a checkpoint directory (--checkpoint-dir)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        hp = DEFAULT_HPARAMS[_HPARAMS_FALLBACK.get(self.model, self.model)]
        out = RunConfig(**asdict(self))
        out.dataset = self.dataset or DEFAULT_DATASET[self.model]
        _check_data(self.model, out.dataset, self.data_dir, self.download)
        out.epochs = hp["epochs"] if self.epochs is None else self.epochs
        out.batch_size = hp["batch_size"] if self.batch_size is None else self.batch_size
        if self.lr is None:  # the families' tuned rates are SGD's; Adam gets torch's default
            out.lr = ADAM_LR if self.optimizer in ADAPTIVE else hp["lr"]
        return out

    def wrap_options(self) -> dict[str, Any]:
        """The options of ``pipetrain.wrap`` this run trains with (call on a resolved config)."""
        options = {f.metadata["wrap"]: getattr(self, f.name) for f in fields(self) if f.metadata["wrap"]}
        # The options no single field holds: only the graph and time partitioners use layer timings.
        options.update(loss_fn=F.cross_entropy, profile=self.profile and self.partitioner in ("graph", "time"),
                       optimizer=optimizer_factory(self.optimizer, self.lr, self.momentum))
        return options

    def check(self) -> None:
        """Raise the error wrap() would raise for these options, before any data is loaded or trained."""
        pipetrain.PipelineOptions(**self.resolved().wrap_options())  # validates on construction

    def describe(self) -> str:
        """Schedule and layout in a few words, e.g. 'async-1f1b/spectrain 4 stages x 1 micro-batch'."""
        kind = self.schedule + (f"/{self.staleness}" if self.staleness != "none" else "")
        kind += f" (lookahead {self.lookahead:g})" if self.lookahead != 1.0 else ""
        kind += " (forward-only)" if self.spectrain_variant != "paper" and self.staleness == "spectrain" else ""
        corrections = [name for name, on in (("spike compensation", self.spike_compensation),
                                             (f"DC lambda {self.dc_lambda:g}", self.dc_lambda > 0),
                                             (f"PipeMare warm-up {self.stage_lr_warmup}", self.stage_lr_warmup > 0),
                                             ("stage momentum", self.stage_momentum),
                                             ("error feedback", self.error_feedback)) if on]
        kind += f" + {', '.join(corrections)}" if corrections else ""
        dp = f" x {self.data_parallel} replicas" if self.data_parallel > 1 else ""
        return f"{kind} {self.stages} stages x {self.micro_batches} micro-batches{dp}"



def _kind(dataset: str) -> str:
    """The kind of data ``dataset`` holds (image, sequence or text), without reading imagefolder's files."""
    return "image" if dataset == "imagefolder" else dataset_info(dataset).kind


def _check_data(model: str, dataset: str, data_dir: str | None, download: bool) -> None:
    """Refuse data the model cannot train on, and a --data-dir or --download the dataset would not use."""
    wanted = _kind(DEFAULT_DATASET[model])
    if _kind(dataset) != wanted:
        raise ValueError(f"{model} trains on {wanted} data ({', '.join(d for d in DATASETS if _kind(d) == wanted)}), "
                         f"and {dataset} is {_kind(dataset)} data: choose one of those or another --model")
    if data_dir is not None and dataset in OFFLINE_DATASETS:
        raise ValueError(f"--data-dir says where {', '.join(d for d in DATASETS if d not in OFFLINE_DATASETS)} "
                         f"live; {dataset} ships with pipetrain: drop --data-dir")
    if download and dataset not in DOWNLOADABLE:
        raise ValueError(f"--download fetches {' and '.join(DOWNLOADABLE)}; {dataset} is not downloaded: "
                         "drop --download")


def optimizer_factory(name: str, lr: float, momentum: float) -> Callable[[Any], torch.optim.Optimizer]:
    """The ``optimizer=`` factory of wrap() for RunConfig.optimizer."""
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "nadam":  # the synchronous control for the nesterov staleness policy under Adam
        return lambda params: torch.optim.NAdam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nag")


def _flags(*, pipeline: bool = True) -> list[Field]:
    """RunConfig's fields that are command-line flags, in --help order (``pipeline=False``: not the schedule ones)."""
    return [f for f in fields(RunConfig)
            if "argparse" in f.metadata and (pipeline or not f.metadata["pipeline_only"])]


def add_arguments(parser: argparse.ArgumentParser, models: Sequence[str], *, pipeline: bool = True,
                  omit: Collection[str] = ()) -> None:
    """The options every training entry point shares (``pipeline=False`` leaves out the schedule ones), but
    those of the fields in ``omit``: an entry point that declares that flag with its own meaning or has no use
    for it (examples/huggingface.py's --dataset is a file to tokenize)."""
    unknown = set(omit) - {f.name for f in _flags()}
    if unknown:
        raise ValueError(f"omit names no flag of RunConfig: {sorted(unknown)}")
    for f in _flags(pipeline=pipeline):
        if f.name in omit:
            continue
        kwargs = {"dest": f.name, "default": f.default, **f.metadata["argparse"]}
        if f.name == "model":  # each entry point trains its own models
            kwargs.update(default=models[0], choices=list(models))
        elif f.name == "micro_batches" and not pipeline:  # compare's data-parallel baseline takes none
            kwargs["help"] += " of the pipelined runs"
        parser.add_argument(f.metadata["flag"] or "--" + f.name.replace("_", "-"), **kwargs)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """A RunConfig from parsed ``add_arguments`` options; the fields without a flag keep their defaults."""
    values = {f.name: getattr(args, f.name) for f in _flags() if hasattr(args, f.name)}
    if "staleness" in values and values["staleness"] is None:  # not given: the schedule's policy
        values["staleness"] = "spectrain" if values["schedule"] == "async-1f1b" else "none"
    return RunConfig(**values)


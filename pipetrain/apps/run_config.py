"""What one training run of the apps trains and how (RunConfig), and its command-line flags.

The flags are the one definition every training entry point parses: `pipetrain compare` (and so `pipetrain demo`),
the example scripts (examples/_common.py) and examples/huggingface.py, each adding only its own.

Each RunConfig field declares its flag (add_arguments, config_from_args) in its metadata. The fields that are
``pipetrain.wrap`` options carry the option's name and take PipelineOptions' default, so a default the library
changes cannot drift here; an entry point that wants another one (the demo's micro-batches) passes it.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable, Collection, Sequence

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

import pipetrain
from pipetrain.apps.datasets import DATASETS, DOWNLOADABLE, OFFLINE_DATASETS, dataset_info
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS
from pipetrain.optim import LAMB, LARS, muon_with_adamw, warmup_cosine_decay, warmup_poly_decay
from pipetrain.options import PARTITIONERS, PRECISIONS, SCHEDULES, STALENESS, PipelineOptions

_HPARAMS_FALLBACK = {"resnet18": "resnet", "resnet50": "resnet"}
# nag: SGD with Nesterov momentum; nadam: Adam with it; lars and lamb: the large-batch optimizers (pipetrain.optim);
# muon: torch's Muon for the matrices, AdamW for the rest (pipetrain.optim.muon_with_adamw)
OPTIMIZERS = ("sgd", "nag", "adam", "nadam", "lars", "lamb", "muon")
ADAPTIVE = ("adam", "nadam", "lamb")  # Adam's moments: Adam's rates
ADAM_LR = 1e-3  # torch.optim.Adam's default (LAMB's paper tunes rates of this size too)
# LARS's global rate: its trust coefficient (0.001) makes each tensor move by lr * 0.001 of its norm per update, so
# the rate is 1000x an SGD rate for the same relative step (You et al. 2017 reach global rates of 2-30 at 8K+). 1
# trains the families at their batches: `examples/vgg.py --optimizer lars` (VGG-11 on digits, 3 epochs) 98.3%
# against SGD's 96.9% (--lr 5: 96.4%, 20: 91.4%).
LARS_LR = 1.0
# LARS with You et al. 2017's momentum and trust coefficient; its trust ratio divides by ||g|| + wd * ||w||, and
# without decay the weight norms, and with them every step, grow unchecked: their 5e-4 (the families' SGD has none).
LARS_WEIGHT_DECAY, LARS_TRUST = 5e-4, 0.001
# Muon's rate (Keller Jordan's and torch's examples), and its AdamW's as a share of it: Adam's default at Muon's
# default, so that one --lr (a grid, compare's batch scaling) moves both.
MUON_LR, MUON_ADAMW_SHARE = 0.02, ADAM_LR / 0.02
LAMB_WEIGHT_DECAY = 0.01  # the BERT recipe's (You et al. 2019); LAMB's betas (0.9, 0.999) and eps 1e-6 are its defaults
LR_SCHEDULES = ("none", "warmup-cosine", "warmup-poly")  # none: constant
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
    optimizer: str = _flag("sgd", "sgd (momentum 0.9), nag (the same with Nesterov momentum), adam, nadam (Adam with "
                           "Nesterov momentum at its beta1 from the first step, without NAdam's warm-up), lars "
                           "(You et al. 2017: momentum 0.9, trust coefficient 0.001, weight decay 5e-4), lamb "
                           "(You et al. 2019: weight decay 0.01) or muon (torch's Muon for every 2-D parameter, "
                           "AdamW at lr x 0.05 for the others: pipetrain.optim.muon_with_adamw)", choices=OPTIMIZERS)
    lr: float | None = _flag(None, "the global learning rate, the peak of --lr-schedule (default: the family's SGD "
                             f"rate; {ADAM_LR:g} with adam, nadam and lamb; {LARS_LR:g} with lars; {MUON_LR:g} with muon)",
                             type=float)
    lr_schedule: str = _flag("none", "none (constant --lr), warmup-poly (linear warm-up over --warmup updates, then "
                             "polynomial decay of power --poly-power to 0 at the last update: Jia et al. 2018) or "
                             "warmup-cosine (the same warm-up, then a cosine to 0; huggingface.py's default)",
                             choices=LR_SCHEDULES)
    warmup: int = _flag(0, "updates of linear learning-rate warm-up of --lr-schedule (a run at another batch size "
                        "in `pipetrain compare` warms up over the same samples)", type=int)
    poly_power: float = _flag(2.0, "warmup-poly: the power of the decay (default 2, Jia et al.)", type=float)
    momentum: float = _setting(0.9)
    seed: int = _option("seed", type=int)
    train_samples: int | None = _flag(None, "use only the first N training samples", type=int)
    val_samples: int | None = _flag(None, "use only the first N validation samples", type=int)
    logdir: str | None = _option("logdir", "TensorBoard run directory")
    progress: bool = _flag(True, "show no progress (bar, step or epoch lines), only the summary", name="--no-progress",
                           action="store_false")
    label: str = _setting("")  # names the run in the progress bar and summary line

    def __post_init__(self) -> None:
        """Refuse a schedule flag that would change nothing (every entry point builds its config here)."""
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown --lr-schedule {self.lr_schedule!r}; choose one of {', '.join(LR_SCHEDULES)}")
        if self.warmup < 0 or self.poly_power <= 0:
            raise ValueError(f"--warmup must be >= 0 and --poly-power > 0, got {self.warmup} and {self.poly_power:g}")
        if self.warmup and self.lr_schedule == "none":
            raise ValueError("--warmup shapes --lr-schedule, which is none (constant): add --lr-schedule warmup-poly "
                             "or drop --warmup")
        if self.poly_power != 2.0 and self.lr_schedule != "warmup-poly":
            raise ValueError(f"--poly-power is warmup-poly's and --lr-schedule is {self.lr_schedule}: add "
                             "--lr-schedule warmup-poly or drop --poly-power")

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
        out.lr = default_lr(self.optimizer, hp["lr"]) if self.lr is None else self.lr
        return out

    def wrap_options(self, updates: int | None = None) -> dict[str, Any]:
        """The options of ``pipetrain.wrap`` this run trains with (call on a resolved config); ``updates``: how many
        the run takes, which --lr-schedule spreads its warm-up and decay over (needed unless it is none)."""
        options = {f.metadata["wrap"]: getattr(self, f.name) for f in fields(self) if f.metadata["wrap"]}
        # The options no single field holds: only the graph and time partitioners use layer timings.
        options.update(loss_fn=F.cross_entropy, profile=self.profile and self.partitioner in ("graph", "time"),
                       optimizer=optimizer_factory(self.optimizer, self.lr, self.momentum,
                                                   looks_ahead=self.staleness == "nesterov"),
                       lr_scheduler=self.lr_scheduler(updates))
        return options

    def lr_scheduler(self, updates: int | None) -> Callable[[torch.optim.Optimizer], LambdaLR] | None:
        """The ``lr_scheduler=`` factory of wrap() for --lr-schedule over a run of ``updates`` updates (None:
        constant rate); wrap steps it once per applied update and checkpoints it."""
        if self.lr_schedule == "none":
            return None
        if updates is None:
            raise ValueError(f"--lr-schedule {self.lr_schedule} decays over the run: pass wrap_options(updates=...)")
        warmup, power = self.warmup, self.poly_power
        if self.lr_schedule == "warmup-cosine":  # a warm-up as long as the run or longer: it never decays
            return lambda optimizer: warmup_cosine_decay(optimizer, warmup, updates)
        if updates <= warmup:  # what warmup_poly_decay would raise at wrap, in the flags' words
            raise ValueError(f"--warmup {warmup} leaves no update of this run's {updates} to decay over: warm up over "
                             "fewer updates or train longer")
        return lambda optimizer: warmup_poly_decay(optimizer, warmup, updates, power)

    def check(self) -> None:
        """Raise the error wrap() would raise for these options, before any data is loaded or trained."""
        c = self.resolved()
        # The run's length is known once its data is: any length past the warm-up gives wrap the same options.
        pipetrain.PipelineOptions(**c.wrap_options(updates=c.warmup + 1))  # validates on construction

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


def default_lr(optimizer: str, sgd_lr: float) -> float:
    """The global rate of ``optimizer`` when --lr is not given, for a model family whose SGD rate is ``sgd_lr``."""
    if optimizer in ADAPTIVE:
        return ADAM_LR
    return {"lars": LARS_LR, "muon": MUON_LR}.get(optimizer, sgd_lr)


def optimizer_factory(name: str, lr: float, momentum: float,
                      looks_ahead: bool = False) -> Callable[[Any], torch.optim.Optimizer]:
    """The ``optimizer=`` factory of wrap() for RunConfig.optimizer; ``lr`` is the global rate (LARS and LAMB
    scale it per tensor by their trust ratios). ``looks_ahead``: the nesterov staleness policy makes the
    Nesterov look-ahead, so Muon's own is off."""
    if name == "muon":
        return muon_with_adamw(lr=lr, adamw_lr=lr * MUON_ADAMW_SHARE, nesterov=not looks_ahead)
    if name == "lars":
        return lambda params: LARS(params, lr=lr, momentum=momentum, weight_decay=LARS_WEIGHT_DECAY,
                                   trust_coefficient=LARS_TRUST)
    if name == "lamb":
        return lambda params: LAMB(params, lr=lr, weight_decay=LAMB_WEIGHT_DECAY)
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "nadam":  # the synchronous control for the nesterov staleness policy under Adam
        # Nesterov momentum at Adam's beta1 from the first step. torch's default momentum schedule (momentum_decay
        # 4e-3) starts it at beta1/2 and nears beta1 only after ~10^4 steps: over a few hundred updates that is
        # Adam at half the momentum, not the same Adam looking ahead.
        return lambda params: torch.optim.NAdam(params, lr=lr, momentum_decay=math.inf)
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


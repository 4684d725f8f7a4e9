"""One training loop shared by the example scripts, `pipetrain compare` and the demo.

``run(config)`` builds a zoo model on a dataset, wraps it in a pipeline, trains for some
epochs over a deterministic (seeded) data order, validates after every epoch, and returns a
:class:`RunSummary`. Under torchrun every rank runs the same call and iterates the same global
mini-batches (the runtime shards them for data parallelism); only rank 0 shows progress and
writes TensorBoard scalars. Checkpoints are saved after every epoch; ``resume="auto"`` loads the
newest one and skips the mini-batches it already trained, so a resumed run sees the same data
order as an uninterrupted one. With a checkpoint directory, SIGTERM (what schedulers and torchrun
send before killing a job) is a request to stop: the run finishes the mini-batch in flight (under
torchrun, the next one when the signal came after that one's step report; an async-1f1b stream
takes no new mini-batches and drains; under torchrun async-1f1b stops at the end of the epoch),
saves a checkpoint and returns with ``summary.preempted`` set, so the process exits with status 0
and ``resume="auto"`` continues it.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import signal
import threading
import time
from datetime import timedelta
from dataclasses import Field, asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset
from torch.utils.data import default_collate

import pipetrain
from pipetrain.apps.datasets import DATASETS, dataset_info, load_dataset, make_loader
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS, build_model
from pipetrain.options import PARTITIONERS, PRECISIONS, SCHEDULES, STALENESS

# Settings for models without their own DEFAULT_HPARAMS entry (torchvision ResNets use the ResNet ones).
_HPARAMS_FALLBACK = {"resnet18": "resnet", "resnet50": "resnet"}
OPTIMIZERS = ("sgd", "nag", "adam", "nadam")  # nag: SGD with Nesterov momentum; nadam: Adam with it
ADAPTIVE = ("adam", "nadam")
ADAM_LR = 1e-3  # torch.optim.Adam's default
RESUME = ("never", "auto")  # auto: continue from the newest checkpoint in checkpoint_dir


def _flag(value: Any, help: str | None = None, *, wrap: str | None = None, pipeline_only: bool = False,
          name: str | None = None, **argparse_kwargs: Any) -> Any:
    """A RunConfig field with default ``value`` that is also a command-line flag, ``--field-name`` unless
    ``name`` is given.

    ``argparse_kwargs`` go to ``add_argument`` (type, choices, action; a ``default`` there replaces
    ``value`` on the command line), ``wrap`` names the ``pipetrain.wrap`` option the field is passed as,
    and ``pipeline_only`` flags are left out of entry points that choose no schedule (`pipetrain compare`)."""
    return field(default=value, metadata={"argparse": dict(argparse_kwargs, help=help), "flag": name,
                                            "wrap": wrap, "pipeline_only": pipeline_only})


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
    stages: int = _flag(4, "pipeline stages (under torchrun: world / data-parallel)", type=int, wrap="stages")
    micro_batches: int = _flag(4, "micro-batches per mini-batch", type=int, wrap="micro_batches")
    schedule: str = _flag("1f1b", choices=SCHEDULES, wrap="schedule", pipeline_only=True)
    # On the command line None stands for the schedule's policy (config_from_args picks it).
    staleness: str = _flag("none", "async-1f1b: vanilla | stash | 2bw | spectrain | nesterov (default spectrain); "
                           "sync: none", choices=STALENESS, default=None, wrap="staleness", pipeline_only=True)
    lookahead: float = _flag(1.0, "spectrain/nesterov: scale the prediction distance (1: the schedule's real lag)",
                             type=float, wrap="lookahead", pipeline_only=True)
    data_parallel: int = _flag(1, "replicas of the whole pipeline", type=int, wrap="data_parallel",
                               pipeline_only=True)
    engine: str = _setting("auto", wrap="engine")
    checkpoint_dir: str | None = _flag(None, "save a checkpoint here after every epoch, and on SIGTERM (then exit 0)",
                                       pipeline_only=True)
    resume: str = _flag("never", "auto: continue from the newest checkpoint in --checkpoint-dir", choices=RESUME,
                        pipeline_only=True)
    precision: str = _flag("fp32", choices=PRECISIONS, wrap="precision")
    partitioner: str = _flag("graph", choices=PARTITIONERS, wrap="partitioner")
    profile: bool = _setting(True)  # time each layer for the graph/time partitioners (False: estimate; deterministic)
    epochs: int | None = _flag(None, "default: the model family's DEFAULT_HPARAMS", type=int)
    batch_size: int | None = _flag(None, "global mini-batch size", type=int)
    optimizer: str = _flag("sgd", "sgd (momentum 0.9), nag (the same with Nesterov momentum), adam or nadam",
                           choices=OPTIMIZERS)
    lr: float | None = _flag(None, "learning rate (default: the family's SGD rate; 1e-3 with adam)", type=float)
    momentum: float = _setting(0.9)
    seed: int = _flag(0, type=int, wrap="seed")
    train_samples: int | None = _flag(None, "use only the first N training samples", type=int)
    val_samples: int | None = _flag(None, "use only the first N validation samples", type=int)
    logdir: str | None = _flag(None, "TensorBoard run directory", wrap="logdir")
    progress: bool = _flag(True, "no progress bar", name="--no-progress", action="store_false")
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
        dp = f" x {self.data_parallel} replicas" if self.data_parallel > 1 else ""
        return f"{kind} {self.stages} stages x {self.micro_batches} micro-batches{dp}"


@dataclass
class EpochRecord:
    """One epoch: mean train loss, validation loss/accuracy, throughput and traffic."""

    epoch: int
    step: int  # optimizer updates so far
    train_loss: float
    val_loss: float
    val_accuracy: float
    samples_per_second: float
    bytes_per_step: float


class PerStageMeans:
    """Per-stage means over a run's steps of the StepResult lists below; NaN entries (a mini-batch
    where nothing was measured) are left out of their stage's mean."""

    FIELDS = ("version_lag", "weight_version_bytes", "prediction_distance", "prediction_error")

    def __init__(self):
        self.sums: dict[str, list[float]] = {}
        self.counts: dict[str, list[int]] = {}

    def add(self, result: "pipetrain.StepResult") -> None:
        for name in self.FIELDS:
            values = getattr(result, name)
            sums = self.sums.setdefault(name, [0.0] * len(values))
            counts = self.counts.setdefault(name, [0] * len(values))
            for k, value in enumerate(values):
                if value == value:
                    sums[k] += value
                    counts[k] += 1

    def mean(self, name: str) -> list[float]:
        return [s / n if n else math.nan for s, n in zip(self.sums.get(name, []), self.counts.get(name, []))]


@dataclass
class RunSummary:
    """Everything one run reports: per-step losses, per-epoch records, wall time."""

    config: RunConfig
    epochs: list[EpochRecord] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    version_lag: list[float] = field(default_factory=list)  # per stage, mean over steps
    weight_version_bytes: list[float] = field(default_factory=list)  # per stage, mean over steps
    prediction_distance: list[float] = field(default_factory=list)  # per stage, mean over steps
    prediction_error: list[float] = field(default_factory=list)  # per stage, mean over the measured steps
    # What the cost model needs to predict the run's speed elsewhere (pipetrain.apps.throughput): per step
    # and stage, seconds of compute (every F and B, as the runner times them); per stage, bytes of activations
    # sent to later stages, summed over the steps; and the bytes of each trainable parameter, last registered
    # first (about the order a backward finishes their gradients).
    step_busy_seconds: list[list[float]] = field(default_factory=list)
    stage_activation_bytes: list[float] = field(default_factory=list)
    gradient_bytes: list[int] = field(default_factory=list)
    samples: int = 0
    train_seconds: float = 0.0
    bytes_sent: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    preempted: bool = False  # stopped early by SIGTERM after saving a checkpoint; resume="auto" continues
    diverged: str = ""  # the NonFiniteError that ended the run (compare records it instead of stopping)

    @property
    def min_train_loss(self) -> float:
        return min((e.train_loss for e in self.epochs), default=math.nan)

    @property
    def min_val_loss(self) -> float:
        return min((e.val_loss for e in self.epochs), default=math.nan)

    @property
    def max_val_accuracy(self) -> float:
        return max((e.val_accuracy for e in self.epochs), default=math.nan)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.train_seconds if self.train_seconds > 0 else math.nan

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_sent / self.steps if self.steps else 0.0

    def line(self) -> str:
        """The one-line summary the scripts end with."""
        c = self.config
        name = f"{c.label}: " if c.label else ""
        if self.diverged:
            return f"{name}{c.model} on {c.dataset}, {c.describe()}: diverged ({self.diverged.split(';')[0]})"
        return (f"{name}{c.model} on {c.dataset}, {c.describe()}, {len(self.epochs)} epochs ({self.steps} steps): "
                f"min train loss {self.min_train_loss:.4f}, min val loss {self.min_val_loss:.4f}, "
                f"max val accuracy {100 * self.max_val_accuracy:.2f}%, {self.samples_per_second:.0f} samples/s, "
                f"{human_bytes(self.bytes_per_step)}/step sent, {self.wall_seconds:.1f} s")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _subset(dataset: Dataset, n: int | None) -> Dataset:
    if n is None or n >= len(dataset):
        return dataset
    return Subset(dataset, range(n))


class _StopRequest:
    """SIGTERM's handler during run(): it only takes note, and passes the request to the pipeline,
    whose next step report carries it to every rank; the loop acts at the next safe point."""

    def __init__(self) -> None:
        self.signalled = False
        self._pipe: pipetrain.Pipeline | None = None

    def attach(self, pipe: pipetrain.Pipeline) -> None:
        """Forward requests to ``pipe`` from now on (and one that came while it was being built)."""
        self._pipe = pipe
        if self.signalled:
            pipe.request_stop()

    def __call__(self, signum: int, frame: Any) -> None:
        self.signalled = True
        if self._pipe is not None:
            self._pipe.request_stop()


@contextlib.contextmanager
def _sigterm_requests_stop(enabled: bool) -> Iterator[_StopRequest | None]:
    """Catch SIGTERM for the duration of the block (only the main thread may install handlers);
    the previous handler comes back afterwards, also after an error."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield None
        return
    request = _StopRequest()
    previous = signal.signal(signal.SIGTERM, request)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Feed:
    """The mini-batches of one epoch, counted as the pipeline pulls them, ending early once ``limit``
    is set: that is how a stream ends at a mini-batch every rank agreed on."""

    def __init__(self, batches: Iterator[tuple[Any, Any]]):
        self._batches = batches
        self.pulled = 0
        self.limit: int | None = None

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while self.limit is None or self.pulled < self.limit:
            batch = next(self._batches, None)
            if batch is None:
                return
            self.pulled += 1  # counted when handed over, so ``pulled`` is what the pipeline holds
            yield batch


class _StopAgreement:
    """Where the ranks stop: all at the same mini-batch, since each save has barriers.

    Ranks get SIGTERM at slightly different times. Within an epoch they learn of any rank's request
    from the step report they exchange anyway (StepResult.stop_requested), which every rank reads at
    the same step: a request that comes after a rank sent step t's report stops the run after step
    t + 1. Between epochs (a signal during validation or the save) they vote once, on a gloo group of
    its own (CPU tensors whatever the backend; no interleaving with the pipeline's collectives)."""

    def __init__(self, schedule: str, timeout: float) -> None:
        # Bounded like every collective of the pipeline (wrap's timeout), not torch's 30-minute default.
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
                       if dist.is_initialized() else None)
        # A distributed async-1f1b stream reads step t's report while ranks have taken different numbers
        # of later mini-batches, so no count to stop after follows from it; it stops at the epoch's end.
        self._mid_stream = self._group is None or schedule != "async-1f1b"

    def stop_after(self, result: pipetrain.StepResult, request: _StopRequest) -> bool:
        """Whether to stop after the mini-batch of ``result``, in the middle of an epoch."""
        if not self._mid_stream:
            return False
        return request.signalled if self._group is None else result.stop_requested

    def any_rank_asked(self, request: _StopRequest) -> bool:
        """Whether any rank got SIGTERM (every rank calls this at the same point)."""
        if self._group is None:
            return request.signalled
        vote = torch.tensor([int(request.signalled)], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote[0])


def _batches(dataset: Dataset, order: list[int], batch_size: int, skip: int) -> Iterator[tuple[Any, Any]]:
    """Full mini-batches of ``order`` (the last partial one is dropped), after skipping ``skip``."""
    for start in range(skip * batch_size, len(order) - batch_size + 1, batch_size):
        yield default_collate([dataset[i] for i in order[start:start + batch_size]])


@torch.no_grad()
def evaluate(pipe: pipetrain.Pipeline, dataset: Dataset, batch_size: int) -> tuple[float, float]:
    """Mean cross-entropy and accuracy (per sample, or per token for language models) over ``dataset``.

    Sums stay tensors on the output's device (targets are moved there, never the reverse) and are
    read once at the end: one host synchronisation per evaluation, not two per batch."""
    batches: Iterable = _batches(dataset, list(range(len(dataset))), batch_size, 0)
    tail = len(dataset) % batch_size
    if tail:  # the batches above drop a partial last batch; validation must see every sample
        last = default_collate([dataset[i] for i in range(len(dataset) - tail, len(dataset))])
        batches = itertools.chain(batches, [last])
    total_loss, correct, count = None, None, 0
    for x, y in batches:
        out = pipe.predict(x)
        y = y.to(out.device, non_blocking=True)
        loss = F.cross_entropy(out, y, reduction="sum")
        hits = (out.argmax(dim=1) == y).sum()
        total_loss = loss if total_loss is None else total_loss + loss
        correct = hits if correct is None else correct + hits
        count += y.numel()
    if total_loss is None:
        raise ValueError("evaluate needs a dataset with at least one sample")
    return float(total_loss) / count, int(correct) / count


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def run(config: RunConfig, on_step: Callable[[pipetrain.StepResult], None] | None = None) -> RunSummary:
    """Train ``config`` (every rank under torchrun) and return what it measured; ``on_step`` is called with
    each mini-batch's result (``Pipeline.on_step``).

    With ``checkpoint_dir`` set, SIGTERM makes the run save at the next mini-batch boundary and
    return early with ``preempted`` set (see the module docstring); without it SIGTERM keeps its
    usual meaning."""
    with _sigterm_requests_stop(bool(config.checkpoint_dir)) as request:
        return _run(config, request, on_step)


def _run(config: RunConfig, request: _StopRequest | None,
         on_step: Callable[[pipetrain.StepResult], None] | None) -> RunSummary:
    from tqdm import tqdm

    c = config.resolved()
    wall_start = time.perf_counter()
    train = _subset(load_dataset(c.dataset, data_dir=c.data_dir, split="train", seed=c.seed, download=c.download),
                    c.train_samples)
    val = _subset(load_dataset(c.dataset, data_dir=c.data_dir, split="val", seed=c.seed, download=c.download),
                  c.val_samples)
    if len(train) < c.batch_size:
        raise ValueError(f"the train set has {len(train)} samples, fewer than one batch of {c.batch_size}; "
                         "use a smaller --batch-size or more --train-samples")
    info = dataset_info(c.dataset, data_dir=c.data_dir)
    torch.manual_seed(c.seed)  # same initial weights for every method and engine
    model = build_model(c.model, num_classes=info.num_classes, width=c.width, depth=c.depth)
    gradient_bytes = [p.numel() * p.element_size() for p in reversed(list(model.parameters())) if p.requires_grad]
    loader = make_loader(train, c.batch_size, shuffle=True, seed=c.seed, drop_last=True)
    x0, _ = default_collate([train[i] for i in range(c.batch_size)])
    example = x0[:max(1, c.batch_size // (c.micro_batches * c.data_parallel))]
    pipe = pipetrain.wrap(model, example, **c.wrap_options())
    if on_step is not None:
        pipe.on_step(on_step)
    rank0 = is_rank_zero()
    agreement = None
    if request is not None:
        agreement = _StopAgreement(c.schedule, pipe.options.timeout)
        request.attach(pipe)
    val_log = None
    if c.logdir and rank0:
        from torch.utils.tensorboard import SummaryWriter

        val_log = SummaryWriter(c.logdir, filename_suffix=".val")  # same run directory as the runtime's scalars
    summary = RunSummary(c, gradient_bytes=gradient_bytes)
    try:
        if c.resume == "auto" and pipe.resume(c.checkpoint_dir) and rank0:
            print(f"resumed from {c.checkpoint_dir} at step {pipe.updates}", flush=True)
        steps_per_epoch = len(loader)
        done = pipe.updates
        per_stage = PerStageMeans()
        for epoch in range(c.epochs):
            order = list(loader.sampler)  # draws this epoch's permutation, even for epochs resume skips
            skip = min(max(done - epoch * steps_per_epoch, 0), steps_per_epoch)
            if skip == steps_per_epoch:
                continue
            bar = tqdm(total=steps_per_epoch, initial=skip, disable=not (rank0 and c.progress), leave=False,
                       desc=f"{c.label + ' ' if c.label else ''}epoch {epoch + 1}/{c.epochs}", dynamic_ncols=True)
            losses, samples, seconds, sent = [], 0, 0.0, 0
            feed = _Feed(_batches(train, order, c.batch_size, skip))
            for result in pipe.train(feed):
                losses.append(result.loss)
                samples += result.samples
                seconds += result.seconds
                sent += sum(result.bytes_sent)
                per_stage.add(result)
                summary.step_busy_seconds.append([f * result.seconds for f in result.busy_fraction])
                _add_into(summary.stage_activation_bytes, result.comm_bytes.get("activations", []))
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", samples_s=f"{result.samples_per_second:.0f}")
                if agreement is not None and feed.limit is None and agreement.stop_after(result, request):
                    # Not a break: the stream ends by itself after ``limit`` (async drains its in-flight ones).
                    # Ranks stop at the same step, having taken the same mini-batches (a sync schedule
                    # takes one per step; async-1f1b stops mid-stream only in one process).
                    feed.limit = feed.pulled
            bar.close()
            summary.step_losses += losses
            summary.samples += samples
            summary.train_seconds += seconds
            summary.bytes_sent += sent
            summary.steps += len(losses)
            if feed.limit is not None and skip + len(losses) < steps_per_epoch:
                pipe.save(c.checkpoint_dir)  # mid-epoch: no validation; the resume starts at the next mini-batch
                summary.preempted = True
                if rank0:
                    print(f"stopped by SIGTERM at step {pipe.updates} (epoch {epoch + 1}, mini-batch "
                          f"{skip + len(losses)}/{steps_per_epoch}); saved {c.checkpoint_dir}, resume with "
                          "--resume auto", flush=True)
                break
            val_loss, val_acc = evaluate(pipe, val, c.batch_size)
            record = EpochRecord(epoch + 1, pipe.updates, sum(losses) / len(losses), val_loss, val_acc,
                                 samples / seconds if seconds > 0 else math.nan, sent / len(losses))
            summary.epochs.append(record)
            if val_log is not None:
                val_log.add_scalar("val/loss", val_loss, pipe.updates)
                val_log.add_scalar("val/accuracy", val_acc, pipe.updates)
                val_log.add_scalar("train/epoch_loss", record.train_loss, pipe.updates)
                val_log.flush()
            if rank0 and c.progress:
                tqdm.write(f"{c.label + ' ' if c.label else ''}epoch {epoch + 1}/{c.epochs}: "
                           f"train loss {record.train_loss:.4f}, val loss {val_loss:.4f}, "
                           f"val accuracy {100 * val_acc:.2f}%, {record.samples_per_second:.0f} samples/s")
            if c.checkpoint_dir:
                pipe.save(c.checkpoint_dir)
            if agreement is not None and epoch + 1 < c.epochs and (
                    feed.limit is not None or agreement.any_rank_asked(request)):
                summary.preempted = True  # asked during validation or the save: the epoch's checkpoint is it
                if rank0:
                    print(f"stopped by SIGTERM after epoch {epoch + 1} (step {pipe.updates}); saved "
                          f"{c.checkpoint_dir}, resume with --resume auto", flush=True)
                break
        for name in PerStageMeans.FIELDS:
            setattr(summary, name, per_stage.mean(name))
    finally:
        if val_log is not None:
            val_log.close()
        pipe.close()
    summary.wall_seconds = time.perf_counter() - wall_start
    return summary


def _add_into(totals: list[float], values: Sequence[float]) -> None:
    """Add ``values`` to ``totals`` element by element (``totals`` starts empty)."""
    if not totals:
        totals.extend([0.0] * len(values))
    for k, value in enumerate(values):
        totals[k] += value


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


def add_arguments(parser: argparse.ArgumentParser, models: Sequence[str], *, pipeline: bool = True) -> None:
    """The options every training entry point shares (``pipeline=False`` leaves out the schedule ones)."""
    for f in _flags(pipeline=pipeline):
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


def example_main(models: Sequence[str], description: str, argv: Sequence[str] | None = None) -> RunSummary:
    """The body of every examples/<family>.py: parse options, train, print the summary line (rank 0)."""
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser, models)
    args = parser.parse_args(argv)
    try:
        summary = run(config_from_args(args))
    except (ValueError, FileNotFoundError) as exc:  # bad options or missing data: say why, no traceback
        raise SystemExit(f"{parser.prog}: {exc}") from None
    if is_rank_zero():
        print(summary.line(), flush=True)
    return summary

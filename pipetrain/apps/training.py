"""One training loop shared by `pipetrain compare`, the demo and the tests: ``run(config)``.

It builds a zoo model on a dataset, wraps it in a pipeline, trains for some epochs over a deterministic
(seeded) data order, validates after every epoch, and returns a :class:`RunSummary`. Under torchrun every
rank runs the same call and iterates the same global mini-batches (the runtime shards them for data
parallelism); only rank 0 shows progress and writes TensorBoard scalars (pipetrain.apps.run_log: validation,
and the losses on a samples axis too). Checkpoints are saved after every epoch; ``resume="auto"`` loads the
newest one and skips the mini-batches it already trained, so a resumed run sees the same data order as an
uninterrupted one. With a checkpoint directory, SIGTERM is a request to stop
(pipetrain.StopOnSigterm): the run finishes the mini-batch in flight (under torchrun, the next one when the
signal came after that one's step report; an async-1f1b stream takes no new mini-batches and drains; under
torchrun async-1f1b stops at the end of the epoch), saves a checkpoint and returns with ``summary.preempted``
set, so the process exits with status 0 and ``resume="auto"`` continues it.

What to train is a RunConfig (pipetrain.apps.run_config); examples/ shows the same loop as a user's script.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset, default_collate

import pipetrain
from pipetrain.apps.datasets import dataset_info, load_dataset, make_loader
from pipetrain.apps.models import build_model
from pipetrain.apps.optimizer_clock import OptimizerClock
from pipetrain.apps.run_config import RunConfig
from pipetrain.apps.run_log import RunLog
from pipetrain.apps.run_summary import EpochRecord, PerStageMeans, RunSummary


def _subset(dataset: Dataset, n: int | None) -> Dataset:
    if n is None or n >= len(dataset):
        return dataset
    return Subset(dataset, range(n))



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
    pipe = pipetrain.wrap(model, example, **c.wrap_options(updates=c.epochs * len(loader)))  # --lr-schedule's length
    if on_step is not None:
        pipe.on_step(on_step)
    clock = OptimizerClock(pipe)
    rank0 = is_rank_zero()
    log = RunLog(c.logdir, c.batch_size) if c.logdir and rank0 else None  # the runtime's run directory
    summary = RunSummary(c, gradient_bytes=gradient_bytes)
    with _closed_after(pipe, log), pipetrain.StopOnSigterm(pipe, enabled=bool(c.checkpoint_dir)) as stop:
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
            for result in pipe.train(stop.batches(_batches(train, order, c.batch_size, skip))):
                losses.append(result.loss)
                samples += result.samples
                seconds += result.seconds
                sent += sum(result.bytes_sent)
                per_stage.add(result)
                summary.step_busy_seconds.append([f * result.seconds for f in result.busy_fraction])
                _add_into(summary.stage_activation_bytes, result.comm_bytes.get("activations", []))
                if log is not None:
                    log.step(result)
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.4f}", samples_s=f"{result.samples_per_second:.0f}")
            bar.close()
            summary.step_losses += losses
            summary.samples += samples
            summary.train_seconds += seconds
            summary.bytes_sent += sent
            summary.steps += len(losses)
            if stop.stopped and skip + len(losses) < steps_per_epoch:
                pipe.save(c.checkpoint_dir)  # mid-epoch: no validation; the resume starts at the next mini-batch
                summary.preempted = True
                if rank0:
                    print(f"stopped by SIGTERM at step {pipe.updates} (epoch {epoch + 1}, mini-batch "
                          f"{skip + len(losses)}/{steps_per_epoch}); saved {c.checkpoint_dir}, resume with "
                          "--resume", flush=True)
                break
            val_loss, val_acc = evaluate(pipe, val, c.batch_size)
            record = EpochRecord(epoch + 1, pipe.updates, sum(losses) / len(losses), val_loss, val_acc,
                                 samples / seconds if seconds > 0 else math.nan, sent / len(losses), seconds)
            summary.epochs.append(record)
            if log is not None:
                log.epoch(record)
            if rank0 and c.progress:
                tqdm.write(f"{c.label + ' ' if c.label else ''}epoch {epoch + 1}/{c.epochs}: "
                           f"train loss {record.train_loss:.4f}, val loss {val_loss:.4f}, "
                           f"val accuracy {100 * val_acc:.2f}%, {record.samples_per_second:.0f} samples/s")
            if c.checkpoint_dir:
                pipe.save(c.checkpoint_dir)
            if epoch + 1 < c.epochs and stop.requested():
                summary.preempted = True  # asked during validation or the save: the epoch's checkpoint is it
                if rank0:
                    print(f"stopped by SIGTERM after epoch {epoch + 1} (step {pipe.updates}); saved "
                          f"{c.checkpoint_dir}, resume with --resume", flush=True)
                break
        for name in PerStageMeans.FIELDS:
            setattr(summary, name, per_stage.mean(name))
        summary.optimizer_seconds, summary.optimizer_steps = clock.seconds, clock.steps
    summary.wall_seconds = time.perf_counter() - wall_start
    return summary


@contextlib.contextmanager
def _closed_after(pipe: pipetrain.Pipeline, log: RunLog | None) -> Iterator[None]:
    """Close the pipeline (and the loop's log, if any) when the block ends, also after an error."""
    try:
        yield
    finally:
        if log is not None:
            log.close()
        pipe.close()


def _add_into(totals: list[float], values: Sequence[float]) -> None:
    """Add ``values`` to ``totals`` element by element (``totals`` starts empty)."""
    if not totals:
        totals.extend([0.0] * len(values))
    for k, value in enumerate(values):
        totals[k] += value


"""What the example scripts share besides the pipeline itself: their command line and their data.

Each script builds its model, wraps it, trains, validates, logs and checkpoints it itself; this module only
parses the flags they have in common and hands them seeded mini-batches of the offline datasets
(pipetrain.apps.datasets), the same on every rank and again on a resumed run. The flags are those of every
training entry point (pipetrain.apps.run_config: `pipetrain compare` and examples/huggingface.py take them
too), plus the three of the scripts' own loop: --steps, --log-every and --save-every.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Subset, default_collate

from pipetrain.apps.datasets import DatasetNotFoundError, dataset_info, load_dataset
from pipetrain.apps.models import DEFAULT_SIZE
from pipetrain.apps.run_config import RunConfig, add_arguments, config_from_args


def parse_args(doc: str, models: Sequence[str],
               argv: Sequence[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    """The examples' command line: the run (a RunConfig with the model family's defaults filled in:
    pipetrain.apps.models' size, dataset, epochs, batch size and learning rate) and the loop's own flags
    (``steps``, ``log_every``, ``save_every``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p, models)
    loop = p.add_argument_group("this script's training loop")
    loop.add_argument("--steps", type=int, help="stop after this many updates (default: --epochs of them)")
    loop.add_argument("--log-every", type=int, default=10, help="print the loss every N steps (0: never)")
    loop.add_argument("--save-every", type=int, default=0,
                      help="synchronous schedules: also save every N steps (async-1f1b saves after each epoch)")
    args = p.parse_args(argv)
    if (args.resume == "auto" or args.save_every) and not args.checkpoint_dir:
        p.error("--resume and --save-every need --checkpoint-dir, where checkpoints are saved and loaded")
    if args.save_every and args.schedule == "async-1f1b":
        p.error("--save-every saves between the steps of a synchronous schedule; async-1f1b saves after each "
                "epoch (its pipeline never flushes in between): drop --save-every")
    try:
        config = config_from_args(args).resolved()
    except ValueError as error:  # an option the run cannot take: say which and what to do, as argparse does
        p.error(str(error))
    if config.model not in DEFAULT_SIZE and (config.width or config.depth):
        p.error(f"{config.model} is torchvision's fixed architecture: drop --width and --depth")
    width, depth = DEFAULT_SIZE.get(config.model, (None, None))
    config = dataclasses.replace(config, width=config.width or width, depth=config.depth or depth)
    return config, argparse.Namespace(steps=args.steps, log_every=args.log_every, save_every=args.save_every)


def datasets(config: RunConfig) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets of ``--dataset`` (their first --train-samples / --val-samples) and
    the number of classes (the vocabulary size for text)."""
    def load(split: str, samples: int | None) -> Dataset:
        try:
            data = load_dataset(config.dataset, data_dir=config.data_dir, split=split, seed=config.seed,
                                download=config.download)
        except DatasetNotFoundError as error:  # it says where the files belong and how to fetch them
            raise SystemExit(str(error)) from None
        return Subset(data, range(min(len(data), samples))) if samples else data

    train, val = load("train", config.train_samples), load("val", config.val_samples)
    if len(train) < config.batch_size:
        raise SystemExit(f"the training set has {len(train)} samples, fewer than one mini-batch of "
                         f"{config.batch_size}: use a smaller --batch-size or more --train-samples")
    return train, val, dataset_info(config.dataset, data_dir=config.data_dir).num_classes


def updates(config: RunConfig, loop: argparse.Namespace, train: Dataset) -> int:
    """The updates the run takes (``--steps``, else ``--epochs`` of them), which ``--lr-schedule`` spreads its
    warm-up and decay over: refused when ``--warmup`` leaves none to decay."""
    last = loop.steps or config.epochs * (len(train) // config.batch_size)
    try:
        config.lr_scheduler(last)
    except ValueError as error:  # it names the flags and what to do
        raise SystemExit(str(error)) from None
    return last


def mini_batches(dataset: Dataset, batch_size: int, *, seed: int, epoch: int, start: int = 0,
                 stop: int | None = None) -> Iterator[tuple[Any, Any]]:
    """Mini-batches ``start`` to ``stop`` (default: every full one) of ``epoch``, in an order drawn from
    ``seed`` and ``epoch`` alone: every rank iterates the same ones (the pipeline gives each data-parallel
    replica its share) and a resumed run finds its place without drawing the batches before it."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    for k in range(start, len(dataset) // batch_size if stop is None else stop):
        yield default_collate([dataset[i] for i in order[k * batch_size:(k + 1) * batch_size].tolist()])

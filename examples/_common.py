"""What the example scripts share besides the pipeline itself: their command line and their data.

Each script builds its model, wraps it, trains, validates, logs and checkpoints it itself; this module only
parses the flags they have in common and hands them seeded mini-batches of the offline datasets
(pipetrain.apps.datasets), the same on every rank and again on a resumed run.
"""
from __future__ import annotations

import argparse
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Dataset, Subset, default_collate

from pipetrain import PipelineOptions
from pipetrain.apps.datasets import DATASETS, DatasetNotFoundError, dataset_info, load_dataset
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS, DEFAULT_SIZE
from pipetrain.options import PARTITIONERS, PRECISIONS, SCHEDULES, STALENESS

# torchvision's ResNets take the CIFAR ResNets' training settings.
_HPARAMS_OF = {"resnet18": "resnet", "resnet50": "resnet"}


def parse_args(doc: str, models: Sequence[str], argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The examples' command line. What is not given takes the model family's defaults
    (pipetrain.apps.models: size, dataset, epochs, batch size, learning rate) or pipetrain.wrap's."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--model", default=models[0], choices=list(models))
    add("--width", type=int, help="first conv channels / hidden size (default: the family's)")
    add("--depth", type=int, help="layers (vgg 11/13/16/19, resnet 6n+2, transformer/lstm layers)")
    add("--dataset", choices=DATASETS, help="default: the model's offline dataset")
    add("--data-dir", help="where cifar10/cifar100/imagefolder live (default $PIPETRAIN_DATA or data)")
    add("--download", action="store_true", help="download cifar10/cifar100 into --data-dir first (one process)")
    add("--train-samples", type=int, help="use only the first N training samples")
    add("--val-samples", type=int, help="use only the first N validation samples")
    pipeline = p.add_argument_group("the pipeline (pipetrain.wrap's options, with its defaults)")
    pipeline.add_argument("--stages", type=int, default=PipelineOptions.stages,
                          help="pipeline stages (under torchrun: processes / --data-parallel)")
    pipeline.add_argument("--micro-batches", type=int, default=PipelineOptions.micro_batches)
    pipeline.add_argument("--schedule", choices=SCHEDULES, default=PipelineOptions.schedule)
    pipeline.add_argument("--staleness", choices=STALENESS, help="async-1f1b: vanilla, stash, 2bw, spectrain "
                          "(default) or nesterov; the synchronous schedules: none")
    pipeline.add_argument("--lookahead", type=float, default=PipelineOptions.lookahead)
    pipeline.add_argument("--data-parallel", type=int, default=PipelineOptions.data_parallel)
    pipeline.add_argument("--partitioner", choices=PARTITIONERS, default=PipelineOptions.partitioner)
    pipeline.add_argument("--precision", choices=PRECISIONS, default=PipelineOptions.precision)
    training = p.add_argument_group("training, logging and checkpoints")
    training.add_argument("--epochs", type=int, help="default: the family's")
    training.add_argument("--steps", type=int, help="stop after this many updates (default: --epochs of them)")
    training.add_argument("--batch-size", type=int, help="global mini-batch size (default: the family's)")
    training.add_argument("--lr", type=float, help="SGD learning rate, momentum 0.9 (default: the family's)")
    training.add_argument("--seed", type=int, default=0)
    training.add_argument("--logdir", help="TensorBoard run directory")
    training.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    training.add_argument("--no-progress", dest="log_every", action="store_const", const=0,
                          help="print no step or epoch lines, only the summary")
    training.add_argument("--checkpoint-dir", help="save here after every epoch (and every --save-every steps)")
    training.add_argument("--save-every", type=int, default=0,
                          help="synchronous schedules: also save every N steps (async-1f1b saves after each epoch)")
    training.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in "
                          "--checkpoint-dir, if there is one: its weights, optimizer state, step and place in the data")
    args = p.parse_args(argv)
    if (args.resume or args.save_every) and not args.checkpoint_dir:
        p.error("--resume and --save-every need --checkpoint-dir, where checkpoints are saved and loaded")
    hparams = DEFAULT_HPARAMS[_HPARAMS_OF.get(args.model, args.model)]
    width, depth = DEFAULT_SIZE.get(args.model, (None, None))  # torchvision's ResNets have a fixed size
    defaults = {"dataset": DEFAULT_DATASET[args.model], "width": width, "depth": depth, **hparams,
                "staleness": "spectrain" if args.schedule == "async-1f1b" else "none"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    """The training and validation sets of ``--dataset`` (their first --train-samples / --val-samples) and
    the number of classes (the vocabulary size for text)."""
    def load(split: str, samples: int | None) -> Dataset:
        try:
            data = load_dataset(args.dataset, data_dir=args.data_dir, split=split, seed=args.seed,
                                download=args.download)
        except DatasetNotFoundError as error:  # it says where the files belong and how to fetch them
            raise SystemExit(str(error)) from None
        return Subset(data, range(min(len(data), samples))) if samples else data

    train, val = load("train", args.train_samples), load("val", args.val_samples)
    if len(train) < args.batch_size:
        raise SystemExit(f"the training set has {len(train)} samples, fewer than one mini-batch of "
                         f"{args.batch_size}: use a smaller --batch-size or more --train-samples")
    return train, val, dataset_info(args.dataset, data_dir=args.data_dir).num_classes


def mini_batches(dataset: Dataset, batch_size: int, *, seed: int, epoch: int, start: int = 0,
                 stop: int | None = None) -> Iterator[tuple[Any, Any]]:
    """Mini-batches ``start`` to ``stop`` (default: every full one) of ``epoch``, in an order drawn from
    ``seed`` and ``epoch`` alone: every rank iterates the same ones (the pipeline gives each data-parallel
    replica its share) and a resumed run finds its place without drawing the batches before it."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    for k in range(start, len(dataset) // batch_size if stop is None else stop):
        yield default_collate([dataset[i] for i in order[k * batch_size:(k + 1) * batch_size].tolist()])

"""Datasets for the examples, `pipetrain compare` and the demo.

Three real datasets ship offline (nothing here touches the network unless
``download=True``): "digits" (scikit-learn's 8x8 handwritten digits, upscaled
to 32x32 RGB for the image models), "mnist1d" (the MNIST-1D benchmark, generated
locally with the paper's default arguments, once per machine: see `cache_dir`; "mnist1d-large" is the same
generator's 50,000 samples, for batches of thousands) and "text" (character-level Python
language reference, from the standard library's ``pydoc_data``). "cifar10",
"cifar100" and "imagefolder" read torchvision datasets from ``data_dir``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import pickle
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from pipetrain.apps.extras import import_extra

DATASETS = ["digits", "mnist1d", "mnist1d-large", "text", "cifar10", "cifar100", "imagefolder"]
OFFLINE_DATASETS = ["digits", "mnist1d", "mnist1d-large", "text"]
# Samples MNIST-1D generates (a fifth of them the test split, our "val"): the paper's 5,000, and 10x that for
# the large-batch study, where a batch of 2,048 must still take many updates per epoch.
MNIST1D_SAMPLES = {"mnist1d": 5_000, "mnist1d-large": 50_000}

TEXT_SEQ_LEN = 64
# Fixed vocabulary (newline + printable ASCII) so token ids do not depend on the corpus.
TEXT_VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
_UNKNOWN_CHAR = "?"  # stands in for the few non-ASCII characters (curly quotes, dashes)
_VAL_FRACTION = 0.2
_CIFAR_MEAN, _CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
_CIFAR_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
DOWNLOADABLE = list(_CIFAR_FOLDERS)  # what download=True fetches


class DatasetNotFoundError(FileNotFoundError):
    """A dataset that must be read from disk is not where it is expected."""


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset: classes, one sample's shape, kind."""

    num_classes: int
    input_shape: tuple[int, ...]
    kind: str  # "image" | "sequence" | "text"


def _default_data_dir(data_dir: str | os.PathLike | None) -> Path:
    return Path(data_dir if data_dir is not None else os.environ.get("PIPETRAIN_DATA", "data"))


def dataset_info(name: str, *, data_dir: str | os.PathLike | None = None) -> DatasetInfo:
    """Classes, per-sample input shape and kind of dataset `name` (imagefolder reads data_dir)."""
    if name == "digits":
        return DatasetInfo(10, (3, 32, 32), "image")
    if name in MNIST1D_SAMPLES:
        return DatasetInfo(10, (40, 1), "sequence")
    if name == "text":
        return DatasetInfo(len(TEXT_VOCAB), (TEXT_SEQ_LEN,), "text")
    if name == "cifar10":
        return DatasetInfo(10, (3, 32, 32), "image")
    if name == "cifar100":
        return DatasetInfo(100, (3, 32, 32), "image")
    if name == "imagefolder":
        return DatasetInfo(len(_imagefolder(data_dir, "train").classes), (3, 32, 32), "image")
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None = None,
    split: str = "train",
    seed: int = 0,
    download: bool = False,
) -> Dataset:
    """Return the `split` ("train" or "val") of dataset `name` as (input, label) pairs.

    `seed` picks the train/val split of "digits" and "text"; "mnist1d" uses the
    benchmark's own fixed split (4,000 train / 1,000 test as "val"; "mnist1d-large" 40,000 / 10,000). Only
    cifar10/cifar100 with ``download=True`` use the network.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if name == "digits":
        return _split(_digits(), split, seed)
    if name in MNIST1D_SAMPLES:
        x_train, y_train, x_test, y_test = _mnist1d(MNIST1D_SAMPLES[name])
        x, y = (x_train, y_train) if split == "train" else (x_test, y_test)
        return TensorDataset(x, y)
    if name == "text":
        return _split(_text(), split, seed)
    if name in _CIFAR_FOLDERS:
        return _cifar(name, _default_data_dir(data_dir), split, download)
    if name == "imagefolder":
        return _imagefolder(data_dir, split)
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")


def _split(full: TensorDataset, split: str, seed: int) -> TensorDataset:
    """Deterministic seeded train/val split (val = the first 20% of a seeded permutation)."""
    n = len(full)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = int(n * _VAL_FRACTION)
    idx = perm[:n_val] if split == "val" else perm[n_val:]
    return TensorDataset(*(t[idx] for t in full.tensors))


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: 8x8 images and their labels, as its load_digits returns them. Read straight from
    the CSV scikit-learn ships where it is there: importing sklearn.datasets costs ~0.8 s of CPU in every process
    that trains on digits (each rank of a run), reading the file 0.03 s."""
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        csv = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            data = np.loadtxt(csv, delimiter=",")  # load_digits' own reading: 64 pixels, then the label
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    bunch = import_extra("sklearn.datasets", "scikit-learn", "the digits dataset").load_digits()
    return bunch.images, bunch.target


@functools.lru_cache(maxsize=1)
def _digits() -> TensorDataset:
    images, target = _digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = ((x - x.mean()) / x.std()).expand(-1, 3, -1, -1).contiguous()
    return TensorDataset(x, torch.tensor(target, dtype=torch.long))


MNIST1D_TENSORS = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # x_train, y_train, x_test, y_test


def cache_dir() -> Path:
    """Where generated datasets are kept between processes: ``$PIPETRAIN_CACHE``, else
    ``$XDG_CACHE_HOME/pipetrain``, else ``~/.cache/pipetrain``."""
    if os.environ.get("PIPETRAIN_CACHE"):
        return Path(os.environ["PIPETRAIN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pipetrain"


@functools.lru_cache(maxsize=2)
def _mnist1d(samples: int = MNIST1D_SAMPLES["mnist1d"]) -> MNIST1D_TENSORS:
    """MNIST-1D with ``samples`` samples, generated once per machine: the package's generator takes ~0.8 ms of CPU
    per sample (4 s for the paper's 5,000, a minute for 50,000) and importing it 1.8 s, in every process that trains
    on it (each rank of a run). So the tensors are kept in `cache_dir`, named after what decides them: the sample
    count and the package's version (its default arguments, which we generate with)."""
    try:
        version = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:
        version = None  # import_extra below says what to install
    path = cache_dir() / f"mnist1d-{samples}-{version}.pt"
    cached = _read_mnist1d(path, samples) if version is not None else None
    if cached is not None:
        return cached
    generator = import_extra("mnist1d.data", "mnist1d", "the mnist1d dataset")
    arguments = generator.get_dataset_args(as_dict=True)
    arguments["num_samples"] = samples
    tensors = _generate_mnist1d(generator, arguments)
    _keep(path, tensors)
    return tensors


def _generate_mnist1d(generator, arguments: dict) -> MNIST1D_TENSORS:
    # make_dataset reseeds the global `random` and numpy generators; restore them
    # so loading data never changes the caller's random stream.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        d = generator.make_dataset(SimpleNamespace(**arguments))  # local generation, never the download path
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)

    def as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(x, dtype=torch.float32).unsqueeze(-1), torch.tensor(y, dtype=torch.long)

    return (*as_tensors(d["x"], d["y"]), *as_tensors(d["x_test"], d["y_test"]))


def _read_mnist1d(path: Path, samples: int) -> MNIST1D_TENSORS | None:
    """The tensors kept at ``path``, or None where there are none or they are not a whole dataset of ``samples``
    (a file cut short by a full disk is generated again)."""
    try:
        tensors = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):  # none there, or not a whole file
        return None
    whole = (isinstance(tensors, tuple) and len(tensors) == 4 and all(isinstance(t, torch.Tensor) for t in tensors)
             and len(tensors[0]) + len(tensors[2]) == samples)
    return tensors if whole else None


def _keep(path: Path, tensors: MNIST1D_TENSORS) -> None:
    """Write ``tensors`` to ``path`` whole or not at all (ranks generating at once each rename their own file into
    place); a cache that cannot be written (a read-only home) only costs the next process the generation."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".part")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(tensors, f)
        os.replace(part, path)
    except OSError:
        Path(part).unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def _text() -> TensorDataset:
    """Non-overlapping windows of TEXT_SEQ_LEN+1 characters; target = input shifted by one."""
    from pydoc_data.topics import topics

    corpus = "\n\n".join(topics[key] for key in sorted(topics))
    index = {ch: i for i, ch in enumerate(TEXT_VOCAB)}
    unknown = index[_UNKNOWN_CHAR]
    ids = torch.tensor([index.get(ch, unknown) for ch in corpus], dtype=torch.long)
    n = (len(ids) - 1) // TEXT_SEQ_LEN
    windows = ids[: n * TEXT_SEQ_LEN + 1]
    x = windows[:-1].view(n, TEXT_SEQ_LEN)
    y = windows[1:].view(n, TEXT_SEQ_LEN)
    return TensorDataset(x, y)


def decode_text(ids: torch.Tensor) -> str:
    """Turn a 1-D tensor of "text" token ids back into a string."""
    return "".join(TEXT_VOCAB[i] for i in ids.tolist())


def _cifar(name: str, root: Path, split: str, download: bool) -> Dataset:
    expected = root / _CIFAR_FOLDERS[name]
    if not download and not expected.is_dir():
        raise DatasetNotFoundError(
            f"{name} not found: expected torchvision's extracted files at {expected.resolve()}. "
            f"Fetch it with --download (load_dataset(..., download=True)), point --data-dir "
            f"(data_dir=) at a directory that contains {expected.name}/, or use an offline "
            f"dataset: {', '.join(OFFLINE_DATASETS)}."
        )
    import torchvision
    from torchvision import transforms as T

    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    tf = T.Compose([T.ToTensor(), T.Normalize(_CIFAR_MEAN, _CIFAR_STD)])
    return cls(str(root), train=split == "train", download=download, transform=tf)


def _imagefolder(data_dir: str | os.PathLike | None, split: str) -> Dataset:
    if data_dir is None:
        raise ValueError("imagefolder needs data_dir (--data-dir) pointing at <dir>/train and <dir>/val")
    root = Path(data_dir) / split
    if not root.is_dir():
        raise DatasetNotFoundError(
            f"imagefolder split {split!r} not found: expected {root.resolve()} laid out as "
            f"{split}/<class name>/<image file>; or use an offline dataset: "
            f"{', '.join(OFFLINE_DATASETS)}."
        )
    import torchvision
    from torchvision import transforms as T

    # 32x32 so the image models of the zoo apply unchanged.
    tf = T.Compose([T.Resize(32), T.CenterCrop(32), T.ToTensor(), T.Normalize((0.5,) * 3, (0.5,) * 3)])
    return torchvision.datasets.ImageFolder(str(root), transform=tf)


class _ShardedSampler(Sampler[int]):
    """Seeded order (a fresh permutation each epoch when shuffling), then every world-th index.

    All ranks draw the same permutation from the same seed, so their shards are
    disjoint; each shard has len(dataset) // world indices so ranks stay in step.
    """

    def __init__(self, n: int, *, shuffle: bool, seed: int, rank: int, world: int):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
        self.n, self.shuffle, self.rank, self.world = n, shuffle, rank, world
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=self.generator) if self.shuffle else torch.arange(self.n)
        usable = len(self) * self.world
        return iter(order[:usable][self.rank :: self.world].tolist())

    def __len__(self) -> int:
        return self.n // self.world


def make_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    rank: int = 0,
    world: int = 1,
) -> DataLoader:
    """Deterministic single-process DataLoader; with world > 1, rank's disjoint shard.

    Iterating it again gives the next epoch's (seeded) order, the same on every run.
    """
    sampler = _ShardedSampler(len(dataset), shuffle=shuffle, seed=seed, rank=rank, world=world)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=0)

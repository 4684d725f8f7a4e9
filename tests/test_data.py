"""Tests for pipetrain.apps.datasets: sizes, shapes, label ranges, split determinism, offline use, errors."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

import pipetrain.apps.datasets

from pipetrain.apps.datasets import (
    DATASETS,
    DatasetNotFoundError,
    dataset_info,
    decode_text,
    load_dataset,
    make_loader,
)


def _all_labels(ds):
    return torch.stack([ds[i][1] for i in range(len(ds))])


@pytest.mark.parametrize(
    "name, sizes", [("digits", (1438, 359)), ("mnist1d", (4000, 1000)), ("text", (5814, 1453))]
)
def test_offline_sizes_shapes_and_labels(name, sizes):
    info = dataset_info(name)
    train, val = load_dataset(name, split="train"), load_dataset(name, split="val")
    assert (len(train), len(val)) == sizes
    x, y = train[0]
    assert tuple(x.shape) == info.input_shape
    labels = _all_labels(val)
    assert labels.min() >= 0 and labels.max() < info.num_classes
    if name != "text":  # every class is present in both splits
        assert set(_all_labels(train).tolist()) == set(range(info.num_classes))


def test_digits_total_is_sklearn_and_split_is_seeded_partition():
    n = len(load_digits().target)
    assert n == 1797
    a_train, a_val = load_dataset("digits", seed=1), load_dataset("digits", split="val", seed=1)
    b_val = load_dataset("digits", split="val", seed=1)
    c_val = load_dataset("digits", split="val", seed=2)
    assert len(a_train) + len(a_val) == n
    assert torch.equal(a_val.tensors[0], b_val.tensors[0])
    assert not torch.equal(a_val.tensors[1], c_val.tensors[1])
    # train and val are disjoint: no image (as raw bytes) appears in both
    seen = {row.numpy().tobytes() for row in a_train.tensors[0]}
    assert not any(row.numpy().tobytes() in seen for row in a_val.tensors[0][:50])


def test_digits_is_upscaled_sklearn_image():
    # Independent reference: nearest 8x8 block average of the 32x32 image tracks sklearn's pixels.
    x, y = load_dataset("digits", split="val", seed=0)[0]
    assert torch.equal(x[0], x[1]) and torch.equal(x[0], x[2])
    blocks = x[0].reshape(8, 4, 8, 4).mean(dim=(1, 3)).numpy()
    images, targets = load_digits(return_X_y=False).images, load_digits().target
    corr = [np.corrcoef(blocks.ravel(), img.ravel())[0, 1] for img in images]
    best = int(np.argmax(corr))
    assert corr[best] > 0.95 and targets[best] == y.item()
    assert abs(load_dataset("digits").tensors[0].mean().item()) < 0.05


def test_mnist1d_is_benchmark_and_keeps_global_rng(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPETRAIN_CACHE", str(tmp_path))  # an empty cache: generated inside this test
    pipetrain.apps.datasets._mnist1d.cache_clear()
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    train = load_dataset("mnist1d")  # generation must not touch numpy's global stream
    assert np.random.rand() == expected
    x = train.tensors[0]
    assert x.dtype == torch.float32 and x.shape == (4000, 40, 1)
    assert torch.bincount(train.tensors[1], minlength=10).min() > 300  # balanced classes


def test_mnist1d_is_generated_once_per_machine_and_again_when_its_file_is_cut_short(tmp_path, monkeypatch):
    import mnist1d.data

    monkeypatch.setenv("PIPETRAIN_CACHE", str(tmp_path))
    generate, generated = mnist1d.data.make_dataset, []
    monkeypatch.setattr(mnist1d.data, "make_dataset", lambda args: generated.append(args) or generate(args))
    load = pipetrain.apps.datasets._mnist1d.__wrapped__  # past the in-process cache: what a new process does
    samples = 500  # a tenth of the paper's, to keep the test short
    arguments = mnist1d.data.get_dataset_args()
    arguments.num_samples = samples
    reference = generate(arguments)  # the package's own, independent of our cache and tensors

    first = load(samples)
    assert len(generated) == 1 and len(list(tmp_path.iterdir())) == 1  # one file, no partial one left
    assert np.array_equal(first[0].squeeze(-1).numpy(), reference["x"].astype(np.float32))
    assert np.array_equal(first[3].numpy(), reference["y_test"])
    again = load(samples)
    assert len(generated) == 1 and all(torch.equal(a, b) for a, b in zip(again, first))  # read, not generated

    (kept,) = tmp_path.iterdir()
    kept.write_bytes(kept.read_bytes()[:100])  # a file cut short (a full disk): generated again, and rewritten
    assert all(torch.equal(a, b) for a, b in zip(load(samples), first)) and len(generated) == 2
    assert all(torch.equal(a, b) for a, b in zip(load(samples), first)) and len(generated) == 2

    # Another version of the package may generate other data (its default arguments): another file.
    monkeypatch.setattr(pipetrain.apps.datasets.importlib.metadata, "version", lambda name: "0.0.0-other")
    assert all(torch.equal(a, b) for a, b in zip(load(samples), first)) and len(generated) == 3
    assert len(list(tmp_path.iterdir())) == 2


def test_text_targets_are_inputs_shifted_and_decode_to_english():
    train = load_dataset("text", seed=0)
    x, y = train.tensors
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = decode_text(torch.cat([x[i] for i in range(50)]))
    assert " the " in text and len(text) == 50 * 64


@pytest.mark.slow
def test_no_network_while_loading(tmp_path):
    code = (
        "import socket\n"
        "def refuse(*a, **k): raise OSError('network access attempted')\n"
        "socket.socket.connect = refuse\nsocket.create_connection = refuse\nsocket.getaddrinfo = refuse\n"
        "from pipetrain.apps.datasets import load_dataset\n"
        "for name in ('digits', 'mnist1d', 'text'):\n"
        "    for split in ('train', 'val'):\n"
        "        load_dataset(name, split=split)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert list(tmp_path.iterdir()) == []  # nothing cached or written to the working directory


@pytest.mark.parametrize("name, folder", [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")])
def test_missing_cifar_names_path_flag_and_alternatives(tmp_path, name, folder):
    with pytest.raises(DatasetNotFoundError) as err:
        load_dataset(name, data_dir=tmp_path)
    message = str(err.value)
    assert str((tmp_path / folder).resolve()) in message
    assert "--download" in message and "digits" in message and "mnist1d" in message


def test_imagefolder_reads_split_directories(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for label, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            (tmp_path / split / label).mkdir(parents=True)
            Image.new("RGB", (40, 48), colour).save(tmp_path / split / label / "a.png")
    ds = load_dataset("imagefolder", data_dir=tmp_path, split="val")
    assert dataset_info("imagefolder", data_dir=tmp_path).num_classes == 2
    x, y = ds[1]
    assert x.shape == (3, 32, 32) and y == 1
    with pytest.raises(DatasetNotFoundError, match="train"):
        load_dataset("imagefolder", data_dir=tmp_path / "missing")


def test_unknown_names_and_splits():
    with pytest.raises(ValueError, match="digits"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="split"):
        load_dataset("digits", split="test")
    assert set(DATASETS) >= {"digits", "mnist1d", "text", "cifar10", "cifar100", "imagefolder"}


def test_make_loader_deterministic_epochs_and_disjoint_shards():
    ds = torch.utils.data.TensorDataset(torch.arange(103), torch.zeros(103))

    def epochs(**kw):
        loader = make_loader(ds, 10, seed=5, drop_last=False, **kw)
        return [torch.cat([x for x, _ in loader]).tolist() for _ in range(2)]

    a, b = epochs(shuffle=True), epochs(shuffle=True)
    assert a == b and a[0] != a[1] and sorted(a[0]) == list(range(103))
    assert epochs(shuffle=False)[0] == list(range(103))
    shards = [epochs(shuffle=True, rank=r, world=3)[0] for r in range(3)]
    assert [len(s) for s in shards] == [34, 34, 34]
    assert len(set(sum(shards, []))) == 102
    loader = make_loader(ds, 10, shuffle=True, seed=0, drop_last=True)
    assert [len(x) for x, _ in loader] == [10] * 10
    with pytest.raises(ValueError, match="rank"):
        make_loader(ds, 10, shuffle=True, seed=0, drop_last=False, rank=3, world=3)

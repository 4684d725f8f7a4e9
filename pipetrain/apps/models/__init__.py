"""Example model zoo: small, torch.fx-traceable models for the examples and the demo.

All models take one tensor and return logits with the class dimension second,
so ``F.cross_entropy(model(x), y)`` is the loss for every entry, including the
language models (logits (batch, vocab, length), targets (batch, length)).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipetrain.apps.models.cnn1d import Conv1dClassifier
from pipetrain.apps.models.lstm import LSTMLM, LSTMClassifier
from pipetrain.apps.models.resnet import CifarResNet, torchvision_resnet
from pipetrain.apps.models.transformer import TransformerClassifier, TransformerLM
from pipetrain.apps.models.vgg import VGG

MODELS = ["vgg", "resnet", "cnn1d", "transformer", "lstm", "transformer-lm", "lstm-lm", "resnet18", "resnet50"]

# Each family's natural offline dataset (pipetrain.apps.datasets names).
DEFAULT_DATASET = {
    "vgg": "digits", "resnet": "digits", "resnet18": "digits", "resnet50": "digits",
    "cnn1d": "mnist1d", "transformer": "mnist1d", "lstm": "mnist1d",
    "transformer-lm": "text", "lstm-lm": "text",
}

# Tiny defaults (width, depth): one epoch of the default dataset takes a few seconds on 2 CPU cores.
# width = first conv's channels (vgg, resnet) or model/hidden dimension (transformer, lstm).
DEFAULT_SIZE = {
    "vgg": (8, 11), "resnet": (8, 20), "cnn1d": (32, 3),
    "transformer": (32, 2), "lstm": (32, 2),
    "transformer-lm": (64, 2), "lstm-lm": (64, 2),
}

# Plain single-process SGD (momentum 0.9) settings that reach good validation accuracy in a few
# epochs at DEFAULT_SIZE, small enough for a CPU (examples/benchmarks/bench_models.py measures both).
DEFAULT_HPARAMS = {
    "vgg": {"lr": 0.05, "batch_size": 64, "epochs": 3},
    "resnet": {"lr": 0.02, "batch_size": 32, "epochs": 4},
    "cnn1d": {"lr": 0.05, "batch_size": 64, "epochs": 10},
    "transformer": {"lr": 0.03, "batch_size": 64, "epochs": 8},
    "lstm": {"lr": 0.1, "batch_size": 64, "epochs": 10},
    "transformer-lm": {"lr": 0.1, "batch_size": 64, "epochs": 4},
    "lstm-lm": {"lr": 0.2, "batch_size": 64, "epochs": 4},
}


def build_model(name: str, *, num_classes: int, width: int | None = None, depth: int | None = None,
                **kw: Any) -> nn.Module:
    """Build zoo model `name` with `num_classes` outputs (vocabulary size for the *-lm models).

    width/depth default to DEFAULT_SIZE[name]; depth is 11/13/16/19 for vgg, 6n+2 for
    resnet, the number of layers for transformer/lstm. Extra keywords go to the
    constructor (e.g. heads=, in_features=). resnet18/resnet50 are torchvision's
    (fixed size). Initialisation follows torch's global seed.
    """
    if name in ("resnet18", "resnet50"):
        if width is not None or depth is not None or kw:
            raise ValueError(f"{name} is torchvision's fixed architecture; drop width/depth/{sorted(kw)}")
        return torchvision_resnet(name, num_classes=num_classes)
    if name not in DEFAULT_SIZE:
        raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
    default_width, default_depth = DEFAULT_SIZE[name]
    width = default_width if width is None else width
    depth = default_depth if depth is None else depth
    if name == "vgg":
        return VGG(depth, num_classes=num_classes, width=width, **kw)
    if name == "resnet":
        return CifarResNet(depth, num_classes=num_classes, width=width, **kw)
    cls = {"cnn1d": Conv1dClassifier, "transformer": TransformerClassifier, "lstm": LSTMClassifier,
           "transformer-lm": TransformerLM, "lstm-lm": LSTMLM}[name]
    return cls(num_classes=num_classes, width=width, depth=depth, **kw)


__all__ = ["MODELS", "DEFAULT_DATASET", "DEFAULT_SIZE", "DEFAULT_HPARAMS", "build_model", "VGG", "CifarResNet", "Conv1dClassifier",
           "torchvision_resnet", "TransformerClassifier", "TransformerLM", "LSTMClassifier", "LSTMLM"]

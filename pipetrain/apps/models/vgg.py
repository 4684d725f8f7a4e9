"""CIFAR-style VGG with BatchNorm for 32x32 images."""

from __future__ import annotations

import torch
from torch import nn

# Conv widths in units of the first layer's width ("M" = 2x2 max-pool); the
# standard networks use width 64, i.e. 64-128-256-512.
CONFIGS: dict[int, list[int | str]] = {
    11: [1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    13: [1, 1, "M", 2, 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M"],
    16: [1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M"],
    19: [1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M"],
}


class VGG(nn.Module):
    """VGG-`depth` (11/13/16/19): conv-BN-ReLU blocks, five pools to 1x1, one linear head.

    `width` is the first conv's channel count (64 in the paper; 8 trains on CPU in seconds).
    """

    def __init__(self, depth: int = 11, *, num_classes: int = 10, width: int = 64, in_channels: int = 3):
        super().__init__()
        if depth not in CONFIGS:
            raise ValueError(f"VGG depth must be one of {sorted(CONFIGS)}, got {depth}")
        layers: list[nn.Module] = []
        channels = in_channels
        for item in CONFIGS[depth]:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                out = int(item) * width
                layers += [nn.Conv2d(channels, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU()]
                channels = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))

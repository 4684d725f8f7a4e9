"""CIFAR-style ResNets (He et al. 2016, section 4.2) and torchvision ResNets adapted to 32x32."""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus a shortcut (1x1 conv-BN projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-`depth` for 32x32 inputs, depth = 6n+2 (20, 32, 56, ...): three groups of n blocks.

    `width` is the first group's channel count (16 in the paper); groups use width, 2x, 4x.
    """

    def __init__(self, depth: int = 20, *, num_classes: int = 10, width: int = 16, in_channels: int = 3):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 56, ...), got {depth}")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        channels = width
        for group, out in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(BasicBlock(channels, out, stride=2 if group > 0 and i == 0 else 1))
                channels = out
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def torchvision_resnet(name: str = "resnet18", *, num_classes: int = 10) -> nn.Module:
    """torchvision resnet18/34/50 (random init) with a 3x3 stride-1 stem and no max-pool, for 32x32."""
    import torchvision

    builders = {"resnet18": torchvision.models.resnet18, "resnet34": torchvision.models.resnet34,
                "resnet50": torchvision.models.resnet50}
    if name not in builders:
        raise ValueError(f"torchvision ResNet must be one of {sorted(builders)}, got {name!r}")
    model = builders[name](weights=None, num_classes=num_classes)
    # The ImageNet stem (7x7 stride 2 + max-pool) would shrink 32x32 inputs to 8x8 before block 1.
    model.conv1 = nn.Conv2d(3, 64, 3, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision does
    model.maxpool = nn.Identity()
    return model

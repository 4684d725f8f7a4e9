"""A 1-D convolutional classifier for MNIST-1D, after the benchmark paper's CNN (Greydanus 2020: three
convolutions with stride 2, ReLU, a linear head), with the channel count and the number of convolutions
as width and depth."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Conv1dClassifier(nn.Module):
    """(batch, length, features) -> (batch, num_classes): `depth` stride-2 convolutions of `width` channels
    with ReLU (kernel 5 first, then 3), the feature map flattened into a linear head."""

    def __init__(self, *, num_classes: int = 10, in_features: int = 1, length: int = 40, width: int = 32,
                 depth: int = 3):
        super().__init__()
        if depth < 1:
            raise ValueError(f"cnn1d needs at least one convolution, got depth={depth}")
        self.layers = nn.ModuleList(
            nn.Conv1d(in_features if i == 0 else width, width, kernel_size=5 if i == 0 else 3, stride=2, padding=1)
            for i in range(depth))
        for layer in self.layers:
            length = (length + 2 * layer.padding[0] - layer.kernel_size[0]) // layer.stride[0] + 1
        if length < 1:
            raise ValueError(f"cnn1d: {depth} stride-2 convolutions leave nothing of the input; use a smaller depth")
        self.head = nn.Linear(width * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)  # the datasets give (batch, length, features); Conv1d takes channels first
        for layer in self.layers:
            h = F.relu(layer(h))
        return self.head(h.flatten(1))

"""LSTM sequence classifier (residual stack) and LSTM character language model.

Each layer is its own single-layer nn.LSTM so torch.fx sees one leaf node per
layer (a partitioner can split between them); a residual connection goes around
every layer after the first.
"""

from __future__ import annotations

import torch
from torch import nn


class LSTMClassifier(nn.Module):
    """(batch, length, features) -> (batch, num_classes): `depth` residual LSTM layers of
    `width` units, mean-pool over time, linear head."""

    def __init__(self, *, num_classes: int = 10, in_features: int = 1, width: int = 64, depth: int = 2):
        super().__init__()
        self.proj = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for layer in self.layers:
            h = h + layer(h)[0]
        return self.head(self.norm(h).mean(dim=1))


class LSTMLM(nn.Module):
    """Character LM: (batch, length) token ids -> (batch, vocab, length) logits (class dim
    second, as F.cross_entropy expects); residual LSTM layers, output tied to the embedding."""

    def __init__(self, *, num_classes: int, width: int = 64, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(num_classes, width)
        # std 1/sqrt(width): with the tied output, logits of a unit-variance state start near unit scale.
        nn.init.normal_(self.embed.weight, std=width**-0.5)
        self.layers = nn.ModuleList(nn.LSTM(width, width, batch_first=True) for _ in range(depth))
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)[0]
        return torch.nn.functional.linear(self.norm(h), self.embed.weight).transpose(1, 2)

"""Transformer sequence classifier and causal character language model.

Encoder layers live in an nn.ModuleList rather than one nn.TransformerEncoder so
that torch.fx (which keeps torch.nn modules as leaves) sees one node per layer
and a partitioner can put layers on different stages.
"""

from __future__ import annotations

import torch
import torch.fx
from torch import nn
from torch.nn import functional as F


def _layers(width: int, depth: int, heads: int) -> nn.ModuleList:
    # dropout 0: runs are deterministic, so pipelined and unsplit training can be compared exactly.
    return nn.ModuleList(
        nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(depth)
    )


@torch.fx.wrap  # one graph node: its shape-dependent body is not traced
def causal_mask(tokens: torch.Tensor) -> torch.Tensor:
    """Additive (length, length) mask that hides future positions of `tokens` (batch, length)."""
    length = tokens.shape[1]
    return torch.triu(torch.full((length, length), float("-inf"), device=tokens.device), diagonal=1)


class TransformerClassifier(nn.Module):
    """(batch, length, features) -> (batch, num_classes): patches of `patch` steps, input
    projection, learned positions,
    `depth` pre-norm encoder layers of dimension `width`, mean-pool over time, linear head."""

    def __init__(self, *, num_classes: int = 10, in_features: int = 1, width: int = 64, depth: int = 2,
                 heads: int = 4, patch: int = 4, max_len: int = 512):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.patch = patch
        self.proj = nn.Linear(in_features * patch, width)
        self.pos = nn.Parameter(torch.randn(1, max_len, width) * 0.02)
        self.layers = _layers(width, depth, heads)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Tokens are `patch` consecutive steps: one scalar per token is too little for attention
        # to work with (the length must be a multiple of patch).
        x = x.reshape(x.shape[0], x.shape[1] // self.patch, x.shape[2] * self.patch)
        h = self.proj(x) + self.pos[:, : x.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(dim=1))


class TransformerLM(nn.Module):
    """Causal character LM: (batch, length) token ids -> (batch, vocab, length) logits.

    Logits put the class dimension second so F.cross_entropy(logits, targets) and
    logits.argmax(1) work exactly as for the classifiers. The output projection is
    the input embedding (tied weights).
    """

    def __init__(self, *, num_classes: int, width: int = 64, depth: int = 2, heads: int = 4, max_len: int = 512):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        self.embed = nn.Embedding(num_classes, width)
        # std 1/sqrt(width): with the tied output, logits of a unit-variance state start near unit scale.
        nn.init.normal_(self.embed.weight, std=width**-0.5)
        self.pos = nn.Parameter(torch.randn(1, max_len, width) * 0.02)
        self.layers = _layers(width, depth, heads)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:, :length]
        mask = causal_mask(tokens)
        for layer in self.layers:
            h = layer(h, src_mask=mask)
        return F.linear(self.norm(h), self.embed.weight).transpose(1, 2)

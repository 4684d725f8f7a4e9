"""Small models that exercise the runtime: plain chain, BatchNorm, a skip across stages, tied weights."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.b1 = nn.BatchNorm2d(6)
        self.c2 = nn.Conv2d(6, 8, 3, padding=1)
        self.b2 = nn.BatchNorm2d(8)
        self.c3 = nn.Conv2d(8, 8, 3, padding=1)
        self.b3 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        x = F.relu(self.b3(self.c3(x)))
        return self.head(x.mean(dim=(2, 3)))


class LongSkip(nn.Module):
    """``h`` is made at the start and added back near the end: a tensor that skips stages."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(5))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        a = h
        for layer in self.body:
            a = torch.tanh(layer(a))
        return self.out(a + h)


class DropoutSkip(LongSkip):
    """LongSkip with dropout in every body layer and on the skip: every engine must draw the same masks."""

    def __init__(self):
        super().__init__()
        self.drop = nn.ModuleList(nn.Dropout(0.3) for _ in range(5))
        self.skip_drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.inp(x)
        a = h
        for layer, drop in zip(self.body, self.drop):
            a = drop(torch.tanh(layer(a)))
        return self.out(a + self.skip_drop(h))


class TiedLM(nn.Module):
    """Input embedding and output projection share one weight."""

    vocab = 12

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.vocab, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.head = nn.Linear(16, self.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


def lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


MODELS = {"mlp": mlp, "convbn": ConvBN, "skip": LongSkip, "tied": TiedLM, "dropout": DropoutSkip}
RANDOM = {"dropout"}  # models that draw random numbers in training: no unsplit reference draws the same


def make(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def data(name: str, samples: int, seed: int = 1):
    """(inputs, targets) for ``name`` with ``samples`` rows."""
    g = torch.Generator().manual_seed(seed)
    if name == "convbn":
        return torch.randn(samples, 3, 6, 6, generator=g), torch.randint(0, 4, (samples,), generator=g)
    if name == "tied":
        tokens = torch.randint(0, TiedLM.vocab, (samples, 5), generator=g)
        return tokens, torch.randint(0, TiedLM.vocab, (samples, 5), generator=g)
    return torch.randn(samples, 8, generator=g), torch.randint(0, 4, (samples,), generator=g)


def loss_fn(name: str):
    return lm_loss if name == "tied" else F.cross_entropy


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_training(name: str, batches, micro_batches: int, optimizer=sgd) -> nn.Module:
    """The unsplit model trained with gradient accumulation over the same micro-batches."""
    model = make(name)
    opt = optimizer(model.parameters())
    fn = loss_fn(name)
    for x, y in batches:
        opt.zero_grad()
        for xb, yb in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
            (fn(model(xb), yb) * (len(xb) / len(x))).backward()
        opt.step()
    return model

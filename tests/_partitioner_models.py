"""Small models (and a pipeline runner) shared by the partitioner tests."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TransformerLM(nn.Module):
    """Embedding -> nn.TransformerEncoder -> linear head."""

    def __init__(self, vocab: int = 50, d: int = 16, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


class LSTMLM(nn.Module):
    """Embedding -> two LSTMs (tuple outputs unpacked by getitem) -> linear head."""

    def __init__(self, vocab: int = 40, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm1 = nn.LSTM(d, d, batch_first=True)
        self.lstm2 = nn.LSTM(d, d, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm1(self.embed(tokens))
        h, _ = self.lstm2(self.drop(h))
        return self.head(h)


class SkipNet(nn.Module):
    """A chain of linear layers with one skip from the first layer to the last."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(6))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = torch.tanh(self.layers[0](x))
        h = first
        for layer in self.layers[1:]:
            h = torch.tanh(layer(h))
        batch = x.size(0)  # an int that crosses stages
        return self.head(h + first).view(batch, -1)


class TiedLM(nn.Module):
    """Input embedding and output head share one weight (head.weight is embed.weight)."""

    def __init__(self, vocab: int = 30, d: int = 8, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(*(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(4)))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(tokens))
        if self.functional:  # reads the parameter with get_attr instead of calling head
            return F.linear(h, self.embed.weight)
        return self.head(h)



class DtypeAware(nn.Module):
    """Python code that reads dtypes under autocast, as Hugging Face models do: a norm computed in fp32
    and cast back to its input's dtype, and a branch computed with autocast disabled. ``int(x.shape[1])``
    keeps torch.fx out: torch.export captures it."""

    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * (int(x.shape[1]) ** -0.5)
        dtype = h.dtype  # bf16 under autocast: the capture must not bake in fp32
        normed = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            gate = torch.sigmoid(self.b(h.float()))  # fp32 whatever the caller's autocast
        return self.head(normed * gate.to(dtype))

def run_pipeline(plan, modules, inputs: tuple, loss_fn=None):
    """Run stage modules one after another like the runtime: every float tensor crossing a
    boundary is detached and re-attached; with loss_fn, back-propagate stage by stage.
    Returns the model output."""
    env, received, outs = {}, {}, {}
    out = None
    last = plan.num_stages - 1
    for k, mod in enumerate(modules):
        if k == 0:
            args = inputs
        else:
            args = []
            for name in plan.stage_inputs(k):
                v = env[name]
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v = v.detach().requires_grad_(env[name].requires_grad)
                    received[k, name] = v
                args.append(v)
        res = mod(*args)
        if k < last:
            assert isinstance(res, tuple) and len(res) == len(plan.stage_outputs(k))
            outs[k] = res
            env.update(zip(plan.stage_outputs(k), res))
        else:
            out = res
    if loss_fn is not None:
        loss_fn(out).backward()
        for k in range(last - 1, -1, -1):
            tensors, grads = [], []
            for name, v in zip(plan.stage_outputs(k), outs[k]):
                gs = [received[c, name].grad for c in plan.consumers(name)
                      if (c, name) in received and received[c, name].grad is not None]
                if isinstance(v, torch.Tensor) and v.requires_grad and gs:
                    tensors.append(v)
                    grads.append(sum(gs))
            if tensors:
                torch.autograd.backward(tensors, grads)
    return out

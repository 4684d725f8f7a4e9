"""Which stages' delays cost async-1f1b its accuracy at one micro-batch per update, found outside the pipeline.

At m = 1, stage k of N applies at its update t the gradient of a micro-batch whose forward (and backward)
ran on the stage's version t - D_k, D_k = N - k - 1, predicted along the momentum by the ``nesterov`` policy
(W - lr * v * (gamma + ... + gamma^(D_k + 1)), v and gamma those of that version), with ``stage_momentum``'s
delay-matched momentum. This script trains the zoo model by exactly that rule in plain PyTorch: one model
holds the live weights, a second one runs each micro-batch on every stage's delayed, predicted version, and
SGD with one parameter group per stage applies the gradient. tests/test_stage_delays.py checks it equals
pipetrain's pipeline step for step. Here the delays can be chosen per stage: ``3,2,1,0`` is the 4-stage
pipeline, ``0,0,0,0`` synchronous Nesterov momentum, ``3,0,0,0`` the pipeline with only stage 0 late.
The momentum follows the chosen delays by stage_momentum's rule: ``--matched-to`` matches it to other delays
(``--delays 0,0,0,0 --matched-to 3,2,1,0``: the pipeline's momentum windows without its delays),
``--window-powers`` grows the windows by other powers of 1 + D, ``--plain-momentum`` keeps the optimizer's.
``--batch-size`` trains on smaller mini-batches (one per update, as async-1f1b at m = 1 with smaller micro-batches):
the same delays in updates then lag fewer samples behind. ``--hessian-correction s`` adds s times the Hessian of the
micro-batch's loss times the displacement from the delayed, predicted weights to where synchronous Nesterov momentum
would take its gradient now (live weights less lr * beta_k * buffer, every stage's), computed exactly by double
backward: the Taylor correction of the delayed gradient that DC-ASGD approximates with g*g per parameter, here
exact and with the terms across stages.

docs/results.md (delay-matched momentum) quotes it.
"""
from __future__ import annotations

import argparse
import collections
import copy
import statistics
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import pipetrain
from pipetrain.apps.datasets import load_dataset
from pipetrain.apps.models import build_model
from pipetrain.runtime.local_shards import whole_state
from pipetrain.runtime.staleness.corrections import delay_matched_momentum

MOMENTUM, BATCH = 0.9, 64


def stage_parameter_names(model: nn.Module, example: torch.Tensor, stages: int) -> list[set[str]]:
    """The names of the parameters each stage holds when pipetrain splits ``model`` into ``stages`` (its default
    graph partitioner on its cost model, one process)."""
    pipe = pipetrain.wrap(copy.deepcopy(model), example, stages=stages, engine="local", profile=False,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    names = [set(whole_state(pipe.held_stages[k].module)) for k in range(stages)]
    pipe.close()
    return names


def window_momentum(delay: float, power: float) -> float:
    """beta = 1 - (1 - 0.9) / (1 + D)^power: the window 1 / (1 - beta) grown (1 + D)^power times; power 2 is
    stage_momentum's rule."""
    return delay_matched_momentum(MOMENTUM, delay) if power == 2 else 1 - (1 - MOMENTUM) / (1 + delay) ** power


def stage_optimizer(model: nn.Module, stage_names: list[set[str]], delays: list[float], lr: float,
                    stage_momentum: bool, power: float = 2.0) -> torch.optim.SGD:
    """SGD with one group per stage: with ``stage_momentum``, stage k's momentum matched to ``delays[k]`` and
    the effective rate lr / (1 - beta) kept through the dampening, its buffers starting at zero (the runtime's
    rule, pipetrain.runtime.staleness.corrections.match_momentum)."""
    named = dict(model.named_parameters())
    groups = []
    for names, delay in zip(stage_names, delays):
        beta = window_momentum(delay, power) if stage_momentum else MOMENTUM
        groups.append({"params": [named[n] for n in names if n in named], "momentum": beta,
                       "dampening": 1 - (1 - beta) / (1 - MOMENTUM)})
    if sum(len(g["params"]) for g in groups) != len(named):
        raise ValueError("stage_names must cover every parameter of the model once")
    optimizer = torch.optim.SGD(groups, lr=lr, momentum=MOMENTUM)
    for group in optimizer.param_groups:
        if group["momentum"] != MOMENTUM:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


def hessian_corrected(loss: torch.Tensor, params: list[torch.Tensor], displacements: list[torch.Tensor],
                      scale: float) -> list[torch.Tensor]:
    """The gradient of ``loss`` at ``params`` plus ``scale`` times its Hessian times ``displacements`` (one tensor per
    parameter), both by autograd (the Hessian-vector product by double backward): a second-order Taylor step of the
    gradient towards ``params + displacements``."""
    grads = torch.autograd.grad(loss, params, create_graph=True)
    products = torch.autograd.grad(grads, params, grad_outputs=displacements)
    return [(g + scale * h).detach() for g, h in zip(grads, products)]


class DelayedMirror:
    """Trains ``model`` with stage k's gradients computed on its version D_k updates old, predicted by the
    nesterov look-ahead, and applied to the live weights. The momentum is matched to ``matched_to`` (default:
    the delays) with the window power ``power``; ``hessian_correction`` scales the second-order correction (module
    doc; 0: none)."""

    def __init__(self, model: nn.Module, stage_names: list[set[str]], delays: list[int], lr: float,
                 stage_momentum: bool = True, matched_to: list[float] | None = None, power: float = 2.0,
                 hessian_correction: float = 0.0):
        self.delays = delays
        self.hessian_correction = hessian_correction
        self.shadow = copy.deepcopy(model)  # runs each micro-batch on the delayed versions
        self.optimizer = stage_optimizer(model, stage_names, delays if matched_to is None else matched_to, lr,
                                         stage_momentum, power)
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.stage = {id(p): k for k, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        shadows = dict(self.shadow.named_parameters())
        name_of = {id(p): n for n, p in model.named_parameters()}
        self.shadow_params = [shadows[name_of[id(p)]] for p in self.params]
        # (weights, momentum buffers) after each of the last max(D) + 1 updates, the live version last
        self.versions: collections.deque = collections.deque(maxlen=max(delays) + 1)

    def _version(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        buffers = [self.optimizer.state.get(p, {}).get("momentum_buffer") for p in self.params]
        return [p.detach().clone() for p in self.params], [None if b is None else b.clone() for b in buffers]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One update: the gradient of (x, y) on the delayed, predicted weights, applied to the live ones."""
        self.versions.append(self._version())
        with torch.no_grad():
            for i, (p, s) in enumerate(zip(self.params, self.shadow_params)):
                group = self.optimizer.param_groups[self.stage[id(p)]]
                delay = self.delays[self.stage[id(p)]]
                # Early on a stage has fewer versions than its delay: its first forwards all meet version 0.
                weights, buffers = self.versions[max(0, len(self.versions) - 1 - delay)]
                w = weights[i]
                if buffers[i] is not None:
                    gamma = group["momentum"]
                    w = w - group["lr"] * sum(gamma ** j for j in range(1, delay + 2)) * buffers[i]
                s.copy_(w)
        self.shadow.zero_grad()
        if not self.hessian_correction:
            loss = F.cross_entropy(self.shadow(x), y)
            loss.backward()
            grads = [s.grad.clone() for s in self.shadow_params]
        else:
            with sdpa_kernel(SDPBackend.MATH):  # the fused CPU attention kernels have no double backward
                loss = F.cross_entropy(self.shadow(x), y)
            grads = hessian_corrected(loss, self.shadow_params, self._to_nesterov_point(), self.hessian_correction)
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        return loss.item()

    def _to_nesterov_point(self) -> list[torch.Tensor]:
        """Per parameter: from the weights the micro-batch ran on to where synchronous Nesterov momentum would take
        the gradient now (the live weights less lr * beta_k * buffer; zero for a stage on time)."""
        with torch.no_grad():
            out = []
            for p, s in zip(self.params, self.shadow_params):
                group = self.optimizer.param_groups[self.stage[id(p)]]
                buffer = self.optimizer.state.get(p, {}).get("momentum_buffer")
                target = p.detach() if buffer is None else p.detach() - group["lr"] * group["momentum"] * buffer
                out.append(target - s.detach())
            return out


def delayed_training(model_name: str, delays: list[int], lr: float, epochs: int, seed: int,
                     samples: int | None, stage_momentum: bool, matched_to: list[float] | None = None,
                     power: float = 2.0, batch: int = BATCH, hessian_correction: float = 0.0) -> list[float]:
    """Validation accuracy (%) per epoch of the zoo model trained by DelayedMirror on MNIST-1D, mini-batches of
    ``batch``."""
    train, val = load_dataset("mnist1d", split="train"), load_dataset("mnist1d", split="val")
    x, y = (t[:samples] for t in train.tensors) if samples else train.tensors
    x_val, y_val = val.tensors
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes=10)
    names = stage_parameter_names(model, x[:batch], len(delays))
    mirror = DelayedMirror(model, names, delays, lr, stage_momentum, matched_to, power, hessian_correction)
    order = torch.Generator().manual_seed(seed)
    accuracy = []
    for _ in range(epochs):
        model.train(), mirror.shadow.train()
        permutation = torch.randperm(len(x), generator=order)
        for start in range(0, len(x) - batch + 1, batch):
            chosen = permutation[start:start + batch]
            mirror.step(x[chosen], y[chosen])
        model.eval()
        with torch.no_grad():
            accuracy.append(100 * (model(x_val).argmax(1) == y_val).float().mean().item())
    return accuracy


def _delays(text: str) -> list[int]:
    return [int(d) for d in text.split(",")]


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", choices=["transformer", "lstm"])
    parser.add_argument("--delays", nargs="+", type=_delays,
                        default=[_delays(d) for d in ("0,0,0,0", "3,2,1,0", "3,0,0,0", "0,2,0,0", "0,0,1,0", "0,2,1,0")],
                        help="one comma-separated delay per stage, for each run (the stage count is their number)")
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=BATCH, help="samples per update (default %(default)s)")
    parser.add_argument("--train-samples", type=int, help="use only the first N training samples")
    parser.add_argument("--plain-momentum", action="store_true", help="every stage keeps momentum 0.9")
    parser.add_argument("--matched-to", type=_delays,
                        help="match the momentum to these delays instead of each run's (e.g. 3,2,1,0 with --delays "
                             "0,0,0,0: the pipeline's momentum windows without its delays)")
    parser.add_argument("--window-powers", nargs="+", type=float, default=[2.0],
                        help="beta_k = 1 - 0.1 / (1 + D_k)^power for each power (2: stage_momentum's rule)")
    parser.add_argument("--hessian-correction", type=float, default=0.0,
                        help="add this times the Hessian-vector product towards the Nesterov point to each delayed "
                             "gradient (double backward; 0: off)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    momentum = "momentum 0.9" if args.plain_momentum else "delay-matched momentum"
    if args.matched_to:
        momentum += f" (matched to delays {','.join(map(str, args.matched_to))})"
    if args.hessian_correction:
        momentum += f", Hessian correction x{args.hessian_correction:g}"
    print(f"{args.model} / MNIST-1D, SGD lr {args.lr}, {momentum}, nesterov look-ahead, batch {args.batch_size}, "
          f"{args.seeds} seeds: mean validation accuracy % by epoch, and the mean of the seeds' best")
    for delays in args.delays:
        for power in args.window_powers:
            curves = [delayed_training(args.model, delays, args.lr, args.epochs, seed, args.train_samples,
                                       not args.plain_momentum, args.matched_to, power, args.batch_size,
                                       args.hessian_correction)
                      for seed in range(args.seeds)]
            mean = [statistics.mean(c[e] for c in curves) for e in range(args.epochs)]
            best = [max(c) for c in curves]
            spread = f" ± {statistics.stdev(best):.1f}" if len(best) > 1 else ""
            label = f"delays {','.join(map(str, delays))}" + (f", power {power:g}" if len(args.window_powers) > 1 else "")
            print(f"{label}: " + " ".join(f"{a:.1f}" for a in mean) + f" | best {statistics.mean(best):.1f}{spread}",
                  flush=True)


if __name__ == "__main__":
    main()

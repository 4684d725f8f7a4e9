"""How much a delay of D updates costs heavy-ball SGD, outside any pipeline, and how much the delay corrections buy.

Two parts, both independent of pipetrain's runtime:

1. On a quadratic f(x) = lambda x^2 / 2: the largest lr * lambda at which heavy ball (momentum 0.9) still
   converges when each gradient is computed at the weights of D updates earlier, plainly and with spike
   compensation, linear weight prediction or the Nesterov look-ahead (found by bisection on simulated runs);
   then the largest effective rate lr * lambda / (1 - gamma) with the Nesterov look-ahead at gamma 0.9 and at
   stage_momentum's delay-matched gamma (pipetrain.runtime.staleness.corrections).
2. The zoo's LSTM on MNIST-1D trained by plain PyTorch with the gradient of step t computed at the weights
   of step t - D (kept copies) and applied at step t: the validation accuracy per epoch for each D.

docs/results.md (delay corrections at one micro-batch per update) quotes both.
"""
from __future__ import annotations

import argparse
import collections
import copy

import torch
import torch.nn.functional as F

from pipetrain.apps.datasets import load_dataset
from pipetrain.apps.models import build_model
from pipetrain.runtime.staleness.corrections import delay_matched_momentum

VARIANTS = ("plain", "spike compensation", "linear prediction", "nesterov look-ahead")


def diverges(rate: float, delay: int, gamma: float, variant: str, steps: int = 3000) -> bool:
    """Heavy ball on lambda = 1 with step ``rate``: whether |x| grows instead of shrinking."""
    xs, buffers, buf = [1.0] * (delay + 2), [0.0] * (delay + 2), 0.0
    a, b = gamma ** delay, (1 - gamma ** delay) / (1 - gamma)
    for _ in range(steps):
        x_then, buf_then = xs[-1 - delay], buffers[-1 - delay]
        if variant == "linear prediction":  # W - D * lr * v at the forward
            x_then -= delay * rate * buf_then
        elif variant == "nesterov look-ahead":  # W - lr * v * (gamma + ... + gamma^(D + 1))
            x_then -= gamma * (1 - gamma ** (delay + 1)) / (1 - gamma) * rate * buf_then
        g = x_then
        buf = gamma * buf + g
        step = a * buf + b * g if variant == "spike compensation" else buf
        xs.append(xs[-1] - rate * step)
        buffers.append(buf)
        if abs(xs[-1]) > 1e6:
            return True
    return abs(xs[-1]) > 1e-3 and abs(xs[-1]) > abs(xs[-200])


def stability_bound(delay: int, gamma: float, variant: str) -> float:
    low, high = 0.0, 10.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if diverges(middle, delay, gamma, variant) else (middle, high)
    return low


def delayed_training(delay: int, lr: float, epochs: int, samples: int | None, seed: int) -> list[float]:
    """Validation accuracy (%) per epoch of the zoo LSTM trained with gradients D updates stale."""
    train, val = load_dataset("mnist1d", split="train"), load_dataset("mnist1d", split="val")
    x, y = (t[:samples] for t in train.tensors) if samples else train.tensors
    x_val, y_val = val.tensors
    torch.manual_seed(seed)
    model = build_model("lstm", num_classes=10)
    stale = copy.deepcopy(model)  # runs the forward and backward at the kept weights
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    kept = collections.deque(maxlen=delay + 1)
    order = torch.Generator().manual_seed(seed)
    accuracy = []
    for _ in range(epochs):
        model.train(), stale.train()
        permutation = torch.randperm(len(x), generator=order)
        for start in range(0, len(x) - 63, 64):
            batch = permutation[start:start + 64]
            kept.append([p.detach().clone() for p in model.parameters()])
            with torch.no_grad():
                for s, w in zip(stale.parameters(), kept[0]):
                    s.copy_(w)
            stale.zero_grad()
            F.cross_entropy(stale(x[batch]), y[batch]).backward()
            for p, s in zip(model.parameters(), stale.parameters()):
                p.grad = s.grad.clone()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy.append(100 * (model(x_val).argmax(1) == y_val).float().mean().item())
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0,1,2,3", help="comma-separated D values")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-samples", type=int, help="use only the first N training samples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    delays = [int(d) for d in args.delays.split(",")]
    print("largest stable lr * lambda, heavy ball gamma 0.9, gradient D updates stale (a quadratic):")
    print(f"{'D':>3} " + " ".join(f"{v:>20}" for v in VARIANTS))
    for d in delays:
        print(f"{d:>3} " + " ".join(f"{stability_bound(d, 0.9, v):>20.3f}" for v in VARIANTS))
    print("\nlargest stable effective rate lr * lambda / (1 - gamma), nesterov look-ahead:")
    print(f"{'D':>3} {'gamma 0.9':>10} {'delay-matched gamma':>20} {'its bound':>10}")
    for d in delays:
        matched = delay_matched_momentum(0.9, d)
        print(f"{d:>3} {stability_bound(d, 0.9, 'nesterov look-ahead') / 0.1:>10.2f} {matched:>20.4f} "
              f"{stability_bound(d, matched, 'nesterov look-ahead') / (1 - matched):>10.2f}")
    print(f"\nLSTM / MNIST-1D, heavy ball lr {args.lr}, batch 64, seed {args.seed}: validation accuracy % by epoch")
    for d in delays:
        curve = delayed_training(d, args.lr, args.epochs, args.train_samples, args.seed)
        print(f"D = {d}: " + ", ".join(f"{a:.1f}" for a in curve) + f" (best {max(curve):.1f})")


if __name__ == "__main__":
    main()

"""Size, CPU speed and plain-SGD convergence of every zoo family on its default dataset.

Single process, no pipeline: the baseline the staleness comparisons start from.
    python examples/benchmarks/bench_models.py [--models vgg lstm] [--epochs 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pipetrain.apps.datasets import dataset_info, load_dataset, make_loader
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS, DEFAULT_SIZE, build_model


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, repeats: int = 10) -> float:
    """Median seconds of one forward + backward on batch (x, y)."""
    times = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        if i >= 2:  # the first calls allocate and warm up kernels
            times.append(time.perf_counter() - start)
    model.zero_grad()
    return statistics.median(times)


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset) -> tuple[float, float]:
    """(mean loss, accuracy) over the dataset, accuracy per token for the language models."""
    model.eval()
    loss = correct = count = 0.0
    for x, y in make_loader(dataset, 256, shuffle=False, seed=0, drop_last=False):
        out = model(x)
        loss += F.cross_entropy(out, y, reduction="sum").item()
        correct += (out.argmax(1) == y).sum().item()
        count += y.numel()
    model.train()
    return loss / count, correct / count


def run(name: str, epochs: int, seed: int, lr: float | None, batch_size: int | None) -> None:
    dataset = DEFAULT_DATASET[name]
    info = dataset_info(dataset)
    hp = dict(DEFAULT_HPARAMS[name])
    hp.update({k: v for k, v in (("lr", lr), ("batch_size", batch_size)) if v is not None})
    train, val = load_dataset(dataset, split="train", seed=seed), load_dataset(dataset, split="val", seed=seed)
    torch.manual_seed(seed)
    model = build_model(name, num_classes=info.num_classes)
    params = sum(p.numel() for p in model.parameters())
    x64, y64 = next(iter(make_loader(train, 64, shuffle=True, seed=seed, drop_last=True)))
    t64 = step_time(model, x64, y64)
    width, depth = DEFAULT_SIZE[name]
    print(f"\n{name} (width {width}, depth {depth}) on {dataset}: {params:,} params, "
          f"fwd+bwd {t64 * 1e3:.1f} ms / batch 64; lr {hp['lr']} bs {hp['batch_size']} momentum 0.9")
    torch.manual_seed(seed)
    model = build_model(name, num_classes=info.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=0.9)
    loader = make_loader(train, hp["batch_size"], shuffle=True, seed=seed, drop_last=True)
    steps = 0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            steps += 1
        seconds = time.perf_counter() - start
        val_loss, val_acc = evaluate(model, val)
        print(f"  epoch {epoch}: {steps:5d} steps  {seconds:5.1f} s  val loss {val_loss:.3f}  val acc {val_acc:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_HPARAMS))
    parser.add_argument("--epochs", type=int, default=None, help="default: each family's recommended epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lr", type=float, default=None, help="override the recommended learning rate")
    parser.add_argument("--batch-size", type=int, default=None, help="override the recommended batch size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.models:
        run(name, args.epochs or DEFAULT_HPARAMS[name]["epochs"], args.seed, args.lr, args.batch_size)


if __name__ == "__main__":
    main()

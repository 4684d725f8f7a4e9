"""SpecTrain's per-micro-batch cost: the two weight predictions (before the forward and before the
backward) against the stage's forward + backward, side by side in one run.

    .venv/bin/python examples/benchmarks/bench_prediction.py [--repeats 30]

For each model of the staleness comparison (whole model as one stage, one micro-batch of the
comparison's size) and for SGD-momentum and Adam, after a few optimizer steps, it times:

  forward+backward   the stage's forward and backward on the predicted weights (functional_call)
  prediction         SpecTrainPolicy.forward_weights + before_backward (what the runtime adds)
  per-parameter      the same two predictions written one parameter at a time, finding each
                     parameter's group by scanning all groups and recomputing Adam's direction on
                     every load: how the predictions were written before (for comparison)

Timings are medians over interleaved repeats (the machine is shared); the ratios are what to read.
Every repeat of "prediction" also recomputes the smoothed update, which the runtime does once per
optimizer step (m micro-batches): the column is an upper bound of the per-micro-batch cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from pipetrain.apps.datasets import dataset_info
from pipetrain.apps.models import build_model
from pipetrain.optim import smoothed_update
from pipetrain.runtime.staleness import SpecTrainPolicy

CASES = {  # model family, width, depth, dataset, micro-batch size (the comparison's 64 / 8 micro-batches)
    "transformer": ("transformer", None, None, "mnist1d", 8),
    "vgg": ("vgg", None, None, "digits", 8),
    "transformer-w256": ("transformer", 256, 4, "mnist1d", 32),
}


def per_parameter_prediction(optimizer, params, outs, steps):
    """The earlier implementation, kept here as the baseline: per parameter, scan the groups for its
    learning rate and recompute the smoothed update (Adam's m_hat / (sqrt(v_hat) + eps)) every time."""
    with torch.no_grad():
        for p, out in zip(params, outs):
            v = smoothed_update(optimizer, p)
            lr = next(g["lr"] for g in optimizer.param_groups if any(q is p for q in g["params"]))
            torch.add(p.detach(), v, alpha=-(steps * lr), out=out.data)


def measure(name: str, optimizer_name: str, repeats: int) -> dict[str, float]:
    family, width, depth, dataset, size = CASES[name]
    info = dataset_info(dataset)
    torch.manual_seed(0)
    model = build_model(family, num_classes=info.num_classes, width=width, depth=depth)
    x = torch.randn(size, *info.input_shape)
    y = torch.randint(0, info.num_classes, (size,))
    params = list(model.parameters())
    optimizer = (torch.optim.SGD(params, lr=0.05, momentum=0.9) if optimizer_name == "sgd"
                 else torch.optim.Adam(params, lr=1e-3))
    for _ in range(3):  # optimizer state to predict from
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    policy = SpecTrainPolicy(model, optimizer, 0, 4, micro_batches=8)
    names = [n for n, _ in model.named_parameters()]
    outs = [policy.scratch[n] for n in names]
    u = 40  # a micro-batch past the warm-up
    steps = policy.distance(u)

    def compute():
        loss = F.cross_entropy(functional_call(model, policy.scratch, (x,)), y)
        loss.backward()
        for w in outs:
            w.grad = None

    def predict():
        policy.forward_weights(u)
        policy.before_backward(u)
        policy.distances.clear()
        policy.errors.clear()

    def naive():
        per_parameter_prediction(optimizer, params, outs, steps)
        per_parameter_prediction(optimizer, params, outs, policy.s_bwd)

    variants = {"forward+backward": compute, "prediction": predict, "per-parameter": naive}
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            policy.on_step()  # the direction cache lasts one optimizer step: count its refresh in every repeat
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()} | {"params": sum(p.numel() for p in params),
                                                                   "tensors": len(params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| stage | optimizer | parameters (tensors) | forward+backward | prediction | per-parameter | "
          "prediction / f+b | per-parameter / f+b |")
    print("|---|---|---|---|---|---|---|---|")
    for name in CASES:
        for opt in ("sgd", "adam"):
            r = measure(name, opt, args.repeats)
            fb = r["forward+backward"]
            print(f"| {name} | {opt} | {r['params']:,} ({r['tensors']}) | {1e3 * fb:.2f} ms | "
                  f"{1e3 * r['prediction']:.3f} ms | {1e3 * r['per-parameter']:.3f} ms | "
                  f"{r['prediction'] / fb:.1%} | {r['per-parameter'] / fb:.1%} |", flush=True)


if __name__ == "__main__":
    main()

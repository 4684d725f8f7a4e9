"""examples/benchmarks/bench_stage_delays.py's plain-PyTorch mirror of async-1f1b at m = 1 trains exactly as the
pipeline does, so what it finds about per-stage delays holds for pipetrain's runs.

The pipeline (nesterov policy, stage_momentum, SGD) and the mirror start from the same weights and take the same
micro-batches; after 8 updates, past the 3 of the pipeline's warm-up, every weight must agree to float32
rounding accumulated over 8 steps (the two compute the same sums in other orders)."""
from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

import pipetrain
from pipetrain.apps.datasets import load_dataset
from pipetrain.apps.models import build_model

BENCH = Path(__file__).resolve().parents[1] / "examples" / "benchmarks" / "bench_stage_delays.py"
STEPS, LR = 8, 0.03


def bench():
    spec = importlib.util.spec_from_file_location("bench_stage_delays", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model_name", ["transformer", "lstm"])
@pytest.mark.parametrize("stage_momentum", [True, False])
def test_the_mirror_trains_like_the_pipeline(model_name, stage_momentum):
    mirror_module = bench()
    x, y = load_dataset("mnist1d", split="train").tensors
    batches = [(x[64 * i:64 * (i + 1)], y[64 * i:64 * (i + 1)]) for i in range(STEPS)]
    torch.manual_seed(0)
    model = build_model(model_name, num_classes=10)
    start = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in start.named_parameters()}
    pipe = pipetrain.wrap(model, x[:64], stages=4, micro_batches=1, schedule="async-1f1b", staleness="nesterov",
                          stage_momentum=stage_momentum, engine="local", profile=False,
                          optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9))
    list(pipe.train(batches))
    names = mirror_module.stage_parameter_names(start, x[:64], 4)
    mirror = mirror_module.DelayedMirror(start, names, [3, 2, 1, 0], LR, stage_momentum)
    for xb, yb in batches:
        mirror.step(xb, yb)
    trained = pipe.state_dict()
    for name, p in start.named_parameters():
        torch.testing.assert_close(trained[name], p.detach(), rtol=0, atol=1e-6, msg=name)
    # the weights moved far more than the tolerance: the comparison says something
    assert max((p.detach() - initial[n]).abs().max().item() for n, p in start.named_parameters()) > 1e-3


def test_the_hessian_correction_is_the_gradients_second_order_step():
    # g(w) + s * H(w) d against the central difference of autograd's own gradient along d, in float64 on a small
    # tanh network: (g(w + e*d) - g(w - e*d)) / (2e) = H d + O(e^2 * third derivative). With e = 1e-4 that term
    # is ~1e-8 of |H d| here and the rounding ~1e-16 / e = 1e-12, so agreeing to 1e-6 (relative to the largest
    # entry) checks the double backward, while a correction scaled or aimed wrong misses by orders more.
    mirror_module = bench()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    params = list(net.parameters())
    displacements = [torch.randn_like(p) for p in params]

    def gradient() -> list[torch.Tensor]:
        return list(torch.autograd.grad(torch.nn.functional.cross_entropy(net(x), y), params))

    g = gradient()
    corrected = mirror_module.hessian_corrected(torch.nn.functional.cross_entropy(net(x), y), params,
                                                displacements, 0.5)
    e = 1e-4
    with torch.no_grad():
        for p, d in zip(params, displacements):
            p.add_(e * d)
    ahead = gradient()
    with torch.no_grad():
        for p, d in zip(params, displacements):
            p.sub_(2 * e * d)
    behind = gradient()
    for c, g0, a, b in zip(corrected, g, ahead, behind):
        want = g0 + 0.5 * (a - b) / (2 * e)
        scale = want.abs().max().item()
        assert (c - want).abs().max().item() <= 1e-6 * scale
        assert ((c - g0).abs().max().item()) > 1e-3 * scale  # the correction is not negligible

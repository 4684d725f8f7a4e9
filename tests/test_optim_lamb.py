"""LAMB against its paper's update written out here in float64 (You et al. 2019, Algorithm 2), and where the
pipeline treats it as it treats LARS: whole-tensor ZeRO ownership and weight prediction from its direction."""

import copy
import math

import pytest
import torch

from helpers import wrap_unprofiled
from pipetrain.allreduce.slices import steps_elementwise
from pipetrain.optim import LAMB, smoothed_update
from runtime_models import data, make

pytestmark = pytest.mark.exact

LR, BETAS, EPS, WD = 0.05, (0.9, 0.999), 1e-6, 0.01


class PaperLAMB:
    """One tensor's LAMB, element by element in python floats: Adam's bias-corrected moments,
    r = m_hat / (sqrt(v_hat) + eps) + wd * w, and the step lr * phi(||w||) / ||r|| * r with phi the identity
    (1 when either norm is 0); ``adapt=False`` (a 1-D tensor of the BERT recipe): no decay, no ratio."""

    def __init__(self, w: torch.Tensor, adapt: bool, wd: float = WD):
        self.w, self.adapt, self.wd = w.flatten().tolist(), adapt, wd
        self.m, self.v, self.t = [0.0] * len(self.w), [0.0] * len(self.w), 0

    def direction(self) -> list[float]:
        b1, b2 = BETAS
        r = [m / (1 - b1**self.t) / (math.sqrt(v / (1 - b2**self.t)) + EPS) for m, v in zip(self.m, self.v)]
        if not self.adapt:
            return r
        r = [ri + self.wd * wi for ri, wi in zip(r, self.w)]
        w_norm, r_norm = math.sqrt(sum(x * x for x in self.w)), math.sqrt(sum(x * x for x in r))
        ratio = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
        return [ratio * ri for ri in r]

    def step(self, g: torch.Tensor) -> None:
        b1, b2 = BETAS
        self.t += 1
        g = g.flatten().tolist()
        self.m = [b1 * m + (1 - b1) * gi for m, gi in zip(self.m, g)]
        self.v = [b2 * v + (1 - b2) * gi * gi for v, gi in zip(self.v, g)]
        self.w = [wi - LR * d for wi, d in zip(self.w, self.direction())]

    def weights(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.w, dtype=torch.float64).view_as(like)


def test_lamb_matches_the_paper_over_several_steps_with_weight_decay_and_a_zero_tensor():
    torch.manual_seed(0)
    start = {"matrix": torch.randn(4, 3, dtype=torch.float64), "bias": torch.randn(4, dtype=torch.float64),
             "zeros": torch.zeros(2, 5, dtype=torch.float64)}  # ||w|| = 0: ratio 1 on its first step
    params = {k: torch.nn.Parameter(w.clone()) for k, w in start.items()}
    opt = LAMB(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    paper = {k: PaperLAMB(w, adapt=w.dim() > 1) for k, w in start.items()}
    for step in range(5):
        for k, p in params.items():  # gradients of different scales: the ratio, not their size, sets the step
            p.grad = torch.randn_like(p) * 10.0**(step - 2)
            paper[k].step(p.grad)
        opt.step()
        for k, p in params.items():
            torch.testing.assert_close(p.detach(), paper[k].weights(p), rtol=1e-12, atol=1e-12, msg=f"{k} {step}")
    assert not torch.equal(params["zeros"].detach(), start["zeros"])  # a zero tensor still moves


def test_exclude_1d_off_adapts_a_bias_too():
    w = torch.randn(6, dtype=torch.float64)
    p = torch.nn.Parameter(w.clone())
    opt = LAMB([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, exclude_1d=False)
    paper = PaperLAMB(w, adapt=True)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        paper.step(p.grad)
        opt.step()
    torch.testing.assert_close(p.detach(), paper.weights(p), rtol=1e-12, atol=1e-12)


def test_smoothed_update_is_the_papers_direction_at_the_current_weights():
    w = torch.randn(3, 3, dtype=torch.float64)
    p = torch.nn.Parameter(w.clone())
    opt = LAMB([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    assert smoothed_update(opt, p) is None  # no history yet: predict W itself
    paper = PaperLAMB(w, adapt=True)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        paper.step(p.grad)
        opt.step()
    expected = torch.tensor(paper.direction(), dtype=torch.float64).view_as(p)
    torch.testing.assert_close(smoothed_update(opt, p), expected, rtol=1e-12, atol=1e-12)


def test_state_dict_round_trip_continues_alike():
    torch.manual_seed(2)
    a, b = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.zeros(4, 4))
    first = LAMB([a])
    a.grad = torch.randn(4, 4)
    first.step()
    b.data.copy_(a.detach())
    second = LAMB([b])
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # load_state_dict shares tensors
    for p, opt in ((a, first), (b, second)):
        p.grad = torch.ones(4, 4)
        opt.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lamb_reads_whole_tensors_so_zero_gives_it_whole_tensors():
    # A slice's norm is not the tensor's: ZeRO must give LAMB's replicas whole tensors, as LARS's.
    assert not steps_elementwise(LAMB([torch.nn.Parameter(torch.zeros(2))]))


def test_lamb_with_spectrain_predicts_along_its_direction():
    x, y = data("mlp", 24, seed=3)
    batches = [(x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]) for i in range(6)]
    pipe = wrap_unprofiled(make("mlp"), batches[0][0], stages=3, micro_batches=1, schedule="async-1f1b",
                           staleness="spectrain", optimizer=lambda p: LAMB(p, lr=0.01), partitioner="uniform",
                           engine="local")
    assert all(math.isfinite(r.loss) for r in pipe.train(batches))
    rt = pipe.held_stages[0]
    name, p = next((n, q) for n, q in rt.module.named_parameters() if q.dim() > 1)
    rt.policy.forward_weights(5)  # stage 0 of 3 predicts 0 // 2 + 3 - 0 - 1 = 2 updates ahead
    expected = p.detach() - 2 * 0.01 * smoothed_update(rt.optimizer, p)
    torch.testing.assert_close(rt.policy.scratch[name].detach(), expected, atol=1e-7, rtol=0)

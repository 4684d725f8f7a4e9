"""LARS and LAMB over the recipe's gradient reductions, against their papers' updates on the unsplit model (issue 59):
2 stages x 2 replicas on 4 gloo ranks, fp16- and bf16-compressed all-reduces, flat and hierarchical, at ZeRO 0-2.

The reference is written here from the papers (test_optim_lars's LARS step and test_optim_lamb's LAMB, element by
element in python floats) and fed the unsplit model's gradients, each replica's half of the mini-batch accumulated
over its 2 micro-batches, then reduced as the wire reduces them: each replica's half-weighted gradient rounded to the
wire dtype, the two summed once in float32 and rounded to it again (a sum of two terms has one rounding, whatever the
order gloo or a reduce-scatter takes).

Exact by construction on any CPU's kernels: model, data and optimizer state are float64, so the pipeline's per-replica
gradients equal the reference's to ~1e-16 of their size and round to the same fp16 or bf16 values (unless one lies
within ~1e-16 of a rounding boundary: probability ~1e-13 per element). What remains is float64 arithmetic in the
optimizers, ~1e-16 per operation; LAMB divides by sqrt(v) + eps (eps 1e-6, lr 0.05), which can turn a 1e-17
difference in an uncompressed near-zero gradient into 5e-13 of weight. TOL = 1e-10 covers three steps of both with
room, and is over 1e4 times smaller than what compression itself changes (checked: the compressed references lie
farther than that from the uncompressed one, so a pipeline that did not compress would fail).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from dist_harness import run_world
from helpers import batches, wrap_unprofiled
from pipetrain.optim import LAMB, LARS
from runtime_models import make
from test_optim_lamb import BETAS, EPS, LR as LAMB_LR, WD as LAMB_WD, PaperLAMB
from test_optim_lars import _lars_step_by_hand

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

MICRO, REPLICAS, STEPS, SIZE = 2, 2, 3, 8
TOL = 1e-10
LARS_LR, LARS_MOMENTUM, LARS_WD, LARS_TRUST, LARS_EPS = 1.0, 0.9, 1e-4, 0.01, 1e-8
WIRE = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}

# name -> wrap options: the reductions the recipe rides on (hierarchical (1, 2): reduce-scatter, all-gather)
CASES = {
    "flat": dict(allreduce="flat"),
    "flat-fp16": dict(allreduce="flat", compress="fp16"),
    "hierarchical-fp16": dict(allreduce="hierarchical", hierarchy=(1, 2), compress="fp16"),
    "hierarchical-bf16-zero1": dict(allreduce="hierarchical", hierarchy=(1, 2), compress="bf16", zero=1),
    "flat-fp16-zero2": dict(allreduce="flat", compress="fp16", zero=2),
}


def lars(params):
    return LARS(params, lr=LARS_LR, momentum=LARS_MOMENTUM, weight_decay=LARS_WD, trust_coefficient=LARS_TRUST,
                eps=LARS_EPS)


def lamb(params):
    return LAMB(params, lr=LAMB_LR, betas=BETAS, eps=EPS, weight_decay=LAMB_WD)


OPTIMIZERS = {"lars": lars, "lamb": lamb}


def mini_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.double(), y) for x, y in batches("mlp", STEPS, size=SIZE)]


def scenarios(rank: int, world: int) -> dict:
    out, steps = {}, mini_batches()
    for optimizer, factory in OPTIMIZERS.items():
        for case, options in CASES.items():
            pipe = wrap_unprofiled(make("mlp").double(), steps[0][0][: SIZE // REPLICAS // MICRO], stages=2,
                                   micro_batches=MICRO, data_parallel=REPLICAS, optimizer=factory,
                                   loss_fn=F.cross_entropy, partitioner="uniform", engine="distributed", **options)
            for x, y in steps:
                pipe.step(x, y)
            out[optimizer, case] = pipe.state_dict()
            pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(4, "test_large_batch_compositions", "scenarios", tmp_path_factory.mktemp("large_batch"))


class PaperLARS:
    """One tensor's LARS (You et al. 2017) by test_optim_lars's hand computation."""

    def __init__(self, w: torch.Tensor):
        self.w, self.buffer = w.clone(), None

    def step(self, g: torch.Tensor) -> None:
        self.w, self.buffer = _lars_step_by_hand(self.w, g, self.buffer, LARS_LR, LARS_MOMENTUM, LARS_WD, LARS_TRUST,
                                                 LARS_EPS, clip=False)

    def weights(self, like: torch.Tensor) -> torch.Tensor:
        return self.w.view_as(like)


def reduced(halves: list[list[torch.Tensor]], wire: torch.dtype | None) -> list[torch.Tensor]:
    """The replicas' average as the reducer makes it: each replica's gradient times its weight (1/2), sent in
    ``wire``, the two summed in float32 and rounded to ``wire`` once."""
    out = []
    for a, b in zip(*halves):
        if wire is None:
            out.append(a * 0.5 + b * 0.5)
        else:
            out.append(((a * 0.5).to(wire).float() + (b * 0.5).to(wire).float()).to(wire).double())
    return out


@functools.cache  # each test reads it; none changes it
def reference(optimizer: str, wire: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The unsplit model trained by the paper's optimizer on the reduced gradients of the same mini-batches."""
    model = make("mlp").double()
    params = dict(model.named_parameters())
    paper = {k: PaperLARS(p.detach()) if optimizer == "lars" else PaperLAMB(p.detach(), adapt=p.dim() > 1, wd=LAMB_WD)
             for k, p in params.items()}
    for x, y in mini_batches():
        halves = []
        for xr, yr in zip(x.tensor_split(REPLICAS), y.tensor_split(REPLICAS)):
            model.zero_grad()
            for xb, yb in zip(xr.tensor_split(MICRO), yr.tensor_split(MICRO)):
                (F.cross_entropy(model(xb), yb) * (len(xb) / len(xr))).backward()
            halves.append([p.grad.clone() for p in params.values()])
        with torch.no_grad():
            for (k, p), g in zip(params.items(), reduced(halves, wire)):
                paper[k].step(g)
                p.copy_(paper[k].weights(p))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def merged(ranks: list[dict], key: tuple[str, str], replica: int) -> dict[str, torch.Tensor]:
    """Replica ``replica``'s two stages' weights (ranks 2r and 2r + 1), keyed as the unsplit model's."""
    return {**ranks[2 * replica][key], **ranks[2 * replica + 1][key]}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_reduction_trains_as_the_paper_does_on_the_unsplit_model(ranks, optimizer, case):
    wire = WIRE[CASES[case].get("compress")]
    expected = reference(optimizer, wire)
    for replica in range(REPLICAS):
        state = merged(ranks, (optimizer, case), replica)
        assert state.keys() == expected.keys()
        for k, value in expected.items():
            torch.testing.assert_close(state[k], value, rtol=0, atol=TOL,
                                       msg=f"{optimizer} {case} replica {replica} {k}")
    if wire is not None:  # guards the comparison: the wire's rounding moved the weights by far more than TOL
        uncompressed = reference(optimizer, None)
        assert max((expected[k] - uncompressed[k]).abs().max().item() for k in expected) > 1e4 * TOL

"""Muon for the matrices and AdamW for the rest as one stage optimizer (pipetrain.optim.CombinedOptimizer,
muon_with_adamw): against the inner optimizers stepped by hand and the unsplit model, through checkpoints,
schedulers, clipping and skipped steps, and with every staleness policy and delay correction (predicted, or
refused naming what works).

Models run in float64 where results are claimed equal. Muon's Newton-Schulz iteration runs in bfloat16 whatever
the parameter's dtype, so two runs agree only where the matrices it is fed round to the same bfloat16 values:
float64 gradients that differ by a few units in the 16th digit do (a flip needs a value within 1e-16 of a
bfloat16 rounding boundary), float32 ones would not reliably.
"""
import copy
import math

import pytest
import torch
from torch import nn

import pipetrain
from dist_harness import run_world
from helpers import wrap_unprofiled
from pipetrain.assembly.stages import make_optimizer
from pipetrain.optim import CombinedOptimizer, muon_with_adamw, smoothed_update
from pipetrain.options import PipelineOptions
from runtime_models import data, make
from test_staleness_reference import SIZE, Reference, chain, lag, stream

LR, ADAMW_LR = 0.02, 0.01
FACTORY = muon_with_adamw(lr=LR, adamw_lr=ADAMW_LR, weight_decay=0.01, adamw_weight_decay=0.01)


def by_hand(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    """The pair torch's Muon documentation writes out: Muon over the 2-D parameters, AdamW over the others."""
    params = list(model.parameters())
    return (torch.optim.Muon([p for p in params if p.dim() == 2], lr=LR, weight_decay=0.01),
            torch.optim.AdamW([p for p in params if p.dim() != 2], lr=ADAMW_LR, weight_decay=0.01))


def mlp64() -> nn.Module:
    return make("mlp").double()


def batches64(steps: int, size: int = 8, seed: int = 1) -> list:
    x, y = data("mlp", steps * size, seed=seed)
    return [(x[i * size:(i + 1) * size].double(), y[i * size:(i + 1) * size]) for i in range(steps)]


def train_unsplit(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, micro_batches: int,
                  max_grad_norm: float | None = None, schedulers: tuple = ()) -> None:
    """Gradient accumulation over the micro-batches, clipping as torch.nn.utils.clip_grad_norm_, one step each."""
    for x, y in batches:
        optimizer.zero_grad()
        for xb, yb in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches)):
            (nn.functional.cross_entropy(model(xb), yb) * (len(xb) / len(x))).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        for s in schedulers:
            s.step()


# ----- the combined optimizer on its own -------------------------------------------------------------------


def test_combined_steps_and_schedules_exactly_as_its_inner_optimizers_by_hand():
    mine, theirs = mlp64(), mlp64()
    combined = FACTORY(list(mine.parameters()))
    pair = by_hand(theirs)
    halve = lambda step: 0.5 ** step  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(combined, halve)
    by_hand_scheds = [torch.optim.lr_scheduler.LambdaLR(o, halve) for o in pair]
    for x, y in batches64(4):
        for model, opts in ((mine, [combined]), (theirs, pair)):
            for o in opts:
                o.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            for o in opts:
                o.step()
        sched.step()
        for s in by_hand_scheds:
            s.step()
    # The scheduler reached the inner optimizers' rates: Muon's group and AdamW's, each halved 4 times.
    assert [g["lr"] for o in combined.optimizers for g in o.param_groups] == [LR / 16, ADAMW_LR / 16]
    for (name, a), b in zip(mine.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # the same kernels on the same values


def test_state_dict_round_trip_resumes_exactly():
    first, second = mlp64(), mlp64()
    data_ = batches64(4)
    opt = FACTORY(list(first.parameters()))
    train_unsplit(first, opt, data_[:2], 1)
    second.load_state_dict(first.state_dict())
    resumed = FACTORY(list(second.parameters()))
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch's load_state_dict shares tensors
    train_unsplit(first, opt, data_[2:], 1)
    train_unsplit(second, resumed, data_[2:], 1)
    for a, b in zip(first.parameters(), second.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # One state per parameter, routed to the optimizer that steps it: Muon's buffer or AdamW's moments.
    assert {k for s in resumed.state.values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}


def test_a_factory_returning_several_optimizers_is_combined_and_a_shared_parameter_refused():
    model = mlp64()
    optimizer = make_optimizer(list(model.parameters()), lambda params: list(by_hand(model)))
    assert isinstance(optimizer, CombinedOptimizer) and len(optimizer.param_groups) == 2
    p = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="in two of the optimizers"):
        CombinedOptimizer([torch.optim.Muon([p]), torch.optim.AdamW([p])])


def test_every_stage_gets_both_groups_even_without_matrices():
    # The same two groups on every stage: checkpoints then load at any stage count.
    only_bias = FACTORY([nn.Parameter(torch.zeros(3))])
    assert [len(g["params"]) for g in only_bias.param_groups] == [0, 1]
    assert "ns_steps" in only_bias.param_groups[0] and "betas" in only_bias.param_groups[1]


# ----- Muon's predicted update ------------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov,adjust", [(True, None), (False, "match_rms_adamw")])
def test_pipetrains_muon_steps_whole_matrices_bit_for_bit_as_torchs(nesterov, adjust):
    torch.manual_seed(0)
    weights = [torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)]
    ours, theirs = [[nn.Parameter(w.clone()) for w in weights] for _ in range(2)]
    settings = dict(lr=0.05, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust)
    optimizers = pipetrain.optim.Muon(ours, **settings), torch.optim.Muon(theirs, **settings)
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for params, optimizer in zip((ours, theirs), optimizers):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(optimizers[0].state[a]["momentum_buffer"], optimizers[1].state[b]["momentum_buffer"])


def next_step_direction(muon: torch.optim.Muon, p: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """(W - W_next) / lr for one step of a copy of ``muon`` with gradient ``grad``: what torch's Muon applies."""
    twin = nn.Parameter(p.detach().clone())
    group = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
    copy_ = torch.optim.Muon([twin], **group)
    copy_.state[twin] = {"momentum_buffer": muon.state[p]["momentum_buffer"].clone()}
    twin.grad = grad.clone()
    copy_.step()
    return (p.detach() - twin.detach()) / group["lr"]


@pytest.mark.parametrize("shape,adjust", [((5, 3), None), ((3, 7), "match_rms_adamw")])
@pytest.mark.parametrize("nesterov", [True, False])
def test_predicted_update_is_the_next_step_when_the_gradient_stays(shape, adjust, nesterov):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(*shape, dtype=torch.float64))
    muon = torch.optim.Muon([p], lr=0.05, momentum=0.5, nesterov=nesterov, weight_decay=0.1, adjust_lr_fn=adjust)
    combined = CombinedOptimizer([muon, torch.optim.AdamW([nn.Parameter(torch.zeros(2))])])
    assert smoothed_update(combined, p) is None  # no momentum yet: the prediction is W itself
    # Quarter-integer gradients are exact in bfloat16; after 60 steps at momentum 0.5 the buffer is the gradient
    # to float64 precision, so its bfloat16 rounding is the gradient's and the next step's input is known exactly.
    steady = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(1)).double() / 4
    for _ in range(60):
        p.grad = steady.clone()
        combined.step()
    expected = next_step_direction(muon, p, steady)
    # Both sides: the same bfloat16 Newton-Schulz result, scaled and decayed in float64 (a few ulps apart).
    torch.testing.assert_close(smoothed_update(combined, p), expected, rtol=1e-12, atol=1e-12)


# ----- a 2-stage pipeline against the unsplit model ---------------------------------------------------------


def wrap_mlp(schedule: str = "1f1b", stages: int = 2, **options) -> pipetrain.Pipeline:
    options = {"lr_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)), **options}
    return wrap_unprofiled(mlp64(), batches64(1)[0][0][:2], stages=stages, micro_batches=4, schedule=schedule,
                           optimizer=FACTORY, partitioner="uniform", engine="local", **options)


def assert_equal_to(pipe: pipetrain.Pipeline, model: nn.Module) -> None:
    state = pipe.state_dict()
    for name, p in model.named_parameters():
        # Float64 gradients accumulated in another order; the bfloat16 Newton-Schulz inputs round alike.
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_stages_train_like_the_unsplit_model_with_clipping_and_a_scheduler(schedule):
    data_ = batches64(4)
    pipe = wrap_mlp(schedule, max_grad_norm=0.5)
    for x, y in data_:
        pipe.step(x, y)
    model = mlp64()
    optimizer = FACTORY(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    train_unsplit(model, optimizer, data_, 4, max_grad_norm=0.5, schedulers=(scheduler,))
    assert_equal_to(pipe, model)
    assert all(isinstance(s.optimizer, CombinedOptimizer) for s in pipe.held_stages.values())


def zero_worlds(rank: int, world: int) -> dict:
    """2 stages x 2 replicas at zero 0-3: each rank's stage weights and the tensors its optimizer steps (at zero=3
    FSDP2's shards: half of each matrix, its rows cut in two)."""
    out = {}
    for zero in (0, 1, 2, 3):
        pipe = wrap_unprofiled(mlp64(), batches64(1)[0][0][:2], stages=2, micro_batches=2, data_parallel=2,
                               optimizer=FACTORY, partitioner="uniform", engine="distributed", zero=zero,
                               max_grad_norm=0.5)
        for x, y in batches64(3):
            pipe.step(x, y)
        stepped = [(pipetrain.parameter_name(p), tuple(p.to_local().shape if zero == 3 else p.shape), "ns_steps" in g)
                   for rt in pipe.held_stages.values() for g in rt.optimizer.param_groups for p in g["params"]]
        out[zero] = {"state": pipe.state_dict(), "stepped": stepped}
        pipe.close()
    return out


@pytest.mark.slow
def test_muon_trains_like_the_unsplit_model_under_zero_0_to_3(tmp_path):
    """zero 1 and 2 give each replica whole matrices to step; zero=3 steps FSDP2's shards, each update
    orthogonalised whole (gathered) and cut again."""
    ranks = run_world(4, "test_optim_muon", "zero_worlds", tmp_path)
    model = mlp64()
    # The global batch of 8: 2 replicas x 2 micro-batches of 2 samples, the mean of equal-sized parts.
    train_unsplit(model, FACTORY(list(model.parameters())), batches64(3), 4, max_grad_norm=0.5)
    reference = dict(model.named_parameters())
    for zero in (0, 1, 2, 3):
        for rank, out in enumerate(ranks):
            for name, value in out[zero]["state"].items():
                torch.testing.assert_close(value, reference[name].detach(), rtol=1e-12, atol=1e-12,
                                           msg=f"zero={zero} rank {rank} {name}")
        if zero == 3:  # each replica steps the half of every tensor of its stage it holds, matrices with Muon
            for out in ranks:
                assert out[3]["stepped"] and all(
                    shape[0] * 2 == reference[n].shape[0] and shape[1:] == tuple(reference[n].shape[1:])
                    and muon == (len(shape) == 2) for n, shape, muon in out[3]["stepped"])
        if zero in (0, 3):
            continue
        # The two replicas of each stage (the ranks holding its names) split its tensors, each whole, matrices to Muon.
        stages = {}
        for out in ranks:
            stages.setdefault(frozenset(out[zero]["state"]), []).append(out[zero]["stepped"])
        assert len(stages) == 2
        for held, (a, b) in stages.items():
            names = {n for n, _, _ in a} | {n for n, _, _ in b}
            assert a and b and not {n for n, _, _ in a} & {n for n, _, _ in b}
            assert names == held
            assert all(shape == tuple(reference[n].shape) and muon == (len(shape) == 2) for n, shape, muon in a + b)


def test_checkpoint_resumes_exactly_at_another_stage_count(tmp_path):
    data_ = batches64(4)
    first = wrap_mlp()
    for x, y in data_[:2]:
        first.step(x, y)
    first.save(tmp_path / "ckpt")
    resumed = wrap_mlp(stages=3)
    resumed.load(tmp_path / "ckpt")
    for x, y in data_[2:]:
        resumed.step(x, y)
    model = mlp64()
    optimizer = FACTORY(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    train_unsplit(model, optimizer, data_, 4, schedulers=(scheduler,))
    assert_equal_to(resumed, model)


def test_a_nonfinite_step_is_skipped_leaving_weights_and_muon_state_as_they_were():
    data_ = batches64(3)
    pipe = wrap_mlp(nonfinite="skip")
    pipe.step(*data_[0])
    before = copy.deepcopy([(s.module.state_dict(), s.optimizer.state_dict()) for s in pipe.held_stages.values()])
    x, y = data_[1]
    x = x.clone()
    x[0, 0] = math.nan
    pipe.step(x, y)
    after = [(s.module.state_dict(), s.optimizer.state_dict()) for s in pipe.held_stages.values()]
    for (weights, opt), (weights2, opt2) in zip(before, after):
        for name in weights:
            assert torch.equal(weights[name], weights2[name]), name
        for inner, inner2 in zip(opt["optimizers"], opt2["optimizers"]):
            for k, state in inner["state"].items():
                for key, value in state.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(inner2["state"][k][key])), key


# ----- staleness policies: an independent step-by-step reference --------------------------------------------

BETA1 = 0.9  # AdamW's default beta1: the bias's momentum in the nesterov look-ahead


def policy_factory(policy: str):
    # staleness="nesterov" makes the Nesterov look-ahead itself and refuses an optimizer that also does.
    return muon_with_adamw(lr=LR, adamw_lr=ADAMW_LR, weight_decay=0.01, nesterov=policy != "nesterov")


class MuonReference(Reference):
    """test_staleness_reference's reference in float64, each stage's matrix stepped by its own torch.optim.Muon
    and its bias by its own torch.optim.AdamW; ``buffers`` holds each version's predicted direction v, taken
    from the next step of a copy of Muon whose gradient is its momentum buffer (SpecTrain's stationarity),
    and from AdamW's moments as torch documents its update."""

    def __init__(self, stages: int, m: int, policy: str):
        super().__init__(stages, m, policy)
        self.params = [[[t.double() for t in version] for version in stage] for stage in self.params]
        self.live = [[nn.Parameter(t.clone()) for t in stage[0]] for stage in self.params]
        self.opts = [(torch.optim.Muon([w], lr=LR, weight_decay=0.01, nesterov=policy != "nesterov"),
                      torch.optim.AdamW([b], lr=ADAMW_LR, weight_decay=0.01)) for w, b in self.live]

    def weights(self, k: int, version: int, steps: float, nesterov_delay: float | None = None) -> list:
        w, v = self.params[k][version], self.buffers[k][version]
        if v is None:
            return w
        out = []
        for p, d, lr, decay in zip(w, v, (LR, ADAMW_LR), (1.0, BETA1)):  # Muon's update keeps its size: decay 1
            s = steps if nesterov_delay is None else look_ahead(decay, nesterov_delay)
            out.append(p - s * lr * d)
        return out

    def train(self, batches: list) -> None:
        for t, (x, y) in enumerate(batches):
            total = self.summed_gradients(t, x, y)
            for k in range(self.stages):
                (w, b), (muon, adamw) = self.live[k], self.opts[k]
                w.grad, b.grad = total[k]
                muon.step()
                adamw.step()
                self.params[k].append([w.detach().clone(), b.detach().clone()])
                self.buffers[k].append([next_step_direction(muon, w, muon.state[w]["momentum_buffer"]),
                                        adamw_direction(adamw, b)])


def adamw_direction(adamw: torch.optim.AdamW, p: nn.Parameter) -> torch.Tensor:
    group, state = adamw.param_groups[0], adamw.state[p]
    beta1, beta2 = group["betas"]
    t = float(state["step"])
    m_hat, v_hat = state["exp_avg"] / (1 - beta1 ** t), state["exp_avg_sq"] / (1 - beta2 ** t)
    return m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p.detach()


def look_ahead(gamma: float, delay: float) -> float:
    """gamma + ... + gamma^(delay + 1), summed term by term (delay + 1 terms at gamma = 1)."""
    return sum(gamma ** i for i in range(1, int(delay) + 2))


@pytest.mark.parametrize("policy,m", [("vanilla", 1), ("stash", 1), ("2bw", 2), ("spectrain", 1), ("spectrain", 2),
                                      ("nesterov", 1), ("nesterov", 2)])
def test_async_policies_train_muon_like_the_step_by_step_reference(policy, m):
    stages, steps = 3, 5
    batches = [(x.double(), y) for x, y in stream(steps, m)]
    pipe = wrap_unprofiled(chain(stages).double(), batches[0][0][:SIZE], stages=stages, micro_batches=m,
                           schedule="async-1f1b", staleness=policy, partitioner=[str(k) for k in range(1, stages)],
                           optimizer=policy_factory(policy), engine="local")
    list(pipe.train(batches))
    ref = MuonReference(stages, m, policy)
    ref.train(batches)
    state = pipe.state_dict()
    for k in range(stages):
        prefix = f"{k}.0" if k < stages - 1 else f"{k}"
        for i, name in enumerate(("weight", "bias")):
            torch.testing.assert_close(state[f"{prefix}.{name}"], ref.params[k][steps][i], rtol=1e-12, atol=1e-12,
                                       msg=f"{policy} m={m} stage {k} {name}")
    assert any(lag(u, 0, stages, m) > 0 for u in range(steps * m))  # stage 0's gradients were late


def wrap_async(policy: str = "stash", optimizer=FACTORY, **options) -> pipetrain.Pipeline:
    return wrap_unprofiled(chain(3).double(), stream(1, 1)[0][0][:SIZE].double(), stages=3, micro_batches=1,
                           schedule="async-1f1b", staleness=policy, partitioner=["1", "2"], optimizer=optimizer,
                           engine="local", **options)


def test_nesterov_refuses_muon_that_looks_ahead_itself():
    with pytest.raises(ValueError, match="use nesterov=False"):
        wrap_async("nesterov", muon_with_adamw(lr=LR, adamw_lr=ADAMW_LR, nesterov=True))


def test_spike_compensation_refuses_muon_naming_what_works():
    with pytest.raises(ValueError, match="with Muon use error_feedback, stage_momentum, dc_lambda or stage_lr_warmup"):
        wrap_async(spike_compensation=True)


@pytest.mark.parametrize("split", [{"zero": 3, "data_parallel": 2}, {"tensor_parallel": 2}])
def test_torchs_own_muon_on_a_split_matrix_is_refused_at_wrap_naming_pipetrains(split):
    def torchs(params):
        return [torch.optim.Muon([p for p in params if p.dim() == 2], lr=LR),
                torch.optim.AdamW([p for p in params if p.dim() != 2], lr=ADAMW_LR)]

    with pytest.raises(ValueError, match="would orthogonalise each part.*use pipetrain.optim.Muon"):
        PipelineOptions(engine="distributed", optimizer=torchs, **split)
    PipelineOptions(engine="distributed", optimizer=FACTORY, **split)  # pipetrain's Muon gathers: taken


def test_stage_momentum_lengthens_muons_window_with_the_stage_delay():
    pipe = wrap_async(stage_momentum=True)
    for k, rt in pipe.held_stages.items():
        muon_group, adamw_group = rt.optimizer.param_groups
        delay = 3 - k - 1  # stage k of 3 at one micro-batch per mini-batch: N - k - 1 updates late
        assert muon_group["momentum"] == pytest.approx(1 - (1 - 0.95) / (1 + delay) ** 2, rel=1e-15)
        assert adamw_group["betas"][0] == pytest.approx(1 - (1 - 0.9) / (1 + delay) ** 2, rel=1e-15)


@pytest.mark.parametrize("correction", [{"error_feedback": True}, {"dc_lambda": 0.5}, {"stage_lr_warmup": 4},
                                        {"stage_momentum": True}])
def test_the_other_corrections_act_on_muons_matrices(correction):
    # Each changes stage 0's Muon-stepped matrix (its gradients are 2 updates late) and keeps it finite.
    batches = [(x.double(), y) for x, y in stream(4, 1)]
    plain, corrected = wrap_async(), wrap_async(**correction)
    for pipe in (plain, corrected):
        list(pipe.train(batches))
    a, b = plain.state_dict()["0.0.weight"], corrected.state_dict()["0.0.weight"]
    assert torch.isfinite(b).all() and not torch.allclose(a, b, rtol=0, atol=1e-9)

"""async-1f1b staleness policies checked against hand computations from PipeDream / SpecTrain theory.

With one micro-batch per mini-batch, stage k of p runs the forward of mini-batch t after
max(0, t - (p-k-1)) optimizer updates and its backward after t updates.
"""

import pytest
import torch
from torch import nn

from runtime_models import data, make
from schedules import ActionKind, async_1f1b_actions
from helpers import wrap_unprofiled

LR, MOMENTUM = 0.1, 0.9


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps, for every step, the gradient it applied and the weights/momentum after it."""

    def __init__(self, params):
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.weights = [[p.detach().clone() for p in self.params]]  # weights after u updates
        self.momenta = [None]
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for p in self.params])
        super().step(closure)
        self.weights.append([p.detach().clone() for p in self.params])
        self.momenta.append([self.state[p]["momentum_buffer"].clone() for p in self.params])


def stream(steps, size=4):
    x, y = data("mlp", steps * size, seed=3)
    return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size]) for i in range(steps)]


def run_async(staleness, stages, steps=7, **kw):
    pipe = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=stages, micro_batches=1, schedule="async-1f1b",
                           staleness=staleness, optimizer=RecordingSGD, partitioner="uniform",
                           engine="local", **kw)
    results = list(pipe.train(stream(steps)))
    return pipe, results


def stage_names(pipe):
    return {v: [n for n, _ in rt.module.named_parameters()] for v, rt in pipe.held_stages.items()}


def hand_gradients(pipe, t, x, y, versions):
    """Gradients of the unsplit model on (x, y) with stage k's weights taken after versions[k] updates."""
    model = make("mlp")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for v, rt in pipe.held_stages.items():
            for name, w in zip(stage_names(pipe)[v], rt.optimizer.weights[versions[v]]):
                params[name].copy_(w)
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in params.items()}


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stash_applies_the_gradient_of_the_forward_weight_version(stages):
    steps = 7
    pipe, _ = run_async("stash", stages, steps)
    batches = stream(steps)
    for t in range(steps):
        versions = {v: max(0, t - (stages - v - 1)) for v in pipe.held_stages}
        expected = hand_gradients(pipe, t, *batches[t], versions)
        for v, rt in pipe.held_stages.items():
            for name, g in zip(stage_names(pipe)[v], rt.optimizer.grads[t]):
                torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=f"t={t} {name}")


def test_vanilla_differs_from_the_stashed_gradient():
    steps, stages = 7, 3
    pipe, _ = run_async("vanilla", stages, steps)
    batches = stream(steps)
    worst = 0.0
    for t in range(stages, steps):
        versions = {v: max(0, t - (stages - v - 1)) for v in pipe.held_stages}
        expected = hand_gradients(pipe, t, *batches[t], versions)
        for name, g in zip(stage_names(pipe)[0], pipe.held_stages[0].optimizer.grads[t]):
            worst = max(worst, (g - expected[name]).abs().max().item())
    # Stage 0 backpropagates through stage 1's newer weights: a real, not rounding-sized, difference.
    assert worst > 1e-4


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_stash_holds_p_minus_k_versions_spectrain_one(stages):
    pipe, results = run_async("stash", stages, steps=2 * stages + 2)
    assert [pipe.held_stages[v].policy.peak_versions for v in range(stages)] == [stages - k for k in range(stages)]
    assert all(rt.policy.versions_held() == 0 for rt in pipe.held_stages.values())  # drained at the end
    pipe, results = run_async("spectrain", stages, steps=stages + 2)
    for v, rt in pipe.held_stages.items():
        # One predicted copy per stage, none where both distances floor(k/2)+p-k-1 and floor(k/2) are 0.
        copies = 1 if (v // 2 + stages - v - 1, v // 2) != (0, 0) else 0
        one_copy = sum(p.numel() * p.element_size() for p in rt.module.parameters())
        assert rt.policy.versions_held() == copies and results[-1].weight_version_bytes[v] == copies * one_copy


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_version_lag_is_p_minus_k_minus_1(stages):
    _, results = run_async("vanilla", stages, steps=3 * stages)
    steady = results[stages:2 * stages]
    for r in steady:
        assert r.version_lag == [stages - k - 1 for k in range(stages)]


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_spectrain_uses_predicted_weights_in_forward_and_backward(stages):
    steps = 2 * stages + 1
    pipe = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=stages, micro_batches=1, schedule="async-1f1b",
                           staleness="spectrain", optimizer=RecordingSGD, partitioner="uniform",
                           engine="local")
    seen = {v: {"forward": [], "backward": []} for v in pipe.held_stages}
    for v, rt in pipe.held_stages.items():
        first = next(m for m in rt.module.modules() if isinstance(m, nn.Linear))
        # The forward sees the weights functional_call put in place; the backward reads the scratch copy.
        first.register_forward_hook(lambda m, i, o, v=v: seen[v]["forward"].append(m.weight.detach().clone()))
        name = next(n for n, p in rt.module.named_parameters() if p is first.weight)
        scratch = rt.policy.scratch[name]
        scratch.register_hook(lambda g, v=v, s=scratch: seen[v]["backward"].append(s.detach().clone()))
    list(pipe.train(stream(steps)))
    for v, rt in pipe.held_stages.items():
        k, opt = v, rt.optimizer
        s_fwd, s_bwd = k // 2 + stages - k - 1, k // 2
        name_index = 0  # the first Linear's weight is the stage's first parameter

        def predicted(u, s):
            w = opt.weights[u][name_index]
            return w if u == 0 else w - s * LR * opt.momenta[u][name_index]

        for t in range(steps):
            torch.testing.assert_close(seen[v]["forward"][t], predicted(max(0, t - (stages - k - 1)), s_fwd),
                                       atol=1e-7, rtol=0, msg=f"stage {k} forward t={t}")
            torch.testing.assert_close(seen[v]["backward"][t], predicted(t, s_bwd),
                                       atol=1e-7, rtol=0, msg=f"stage {k} backward t={t}")


def test_spectrain_needs_a_smoothed_update():
    with pytest.raises(TypeError, match="momentum"):
        wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=2, micro_batches=1, schedule="async-1f1b",
                        staleness="spectrain", optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        partitioner="uniform", engine="local")


def test_async_stream_consumes_lazily_and_yields_every_mini_batch():
    pulled = []

    def source():
        for i, b in enumerate(stream(9)):
            pulled.append(i)
            yield b

    pipe = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=3, micro_batches=1, schedule="async-1f1b",
                           staleness="stash", partitioner="uniform", engine="local")
    it = pipe.train(source())
    first = next(it)
    # Never reads far beyond what the pipeline holds (3 in flight at stage 0, plus one round of the local engine).
    assert first.step == 1 and len(pulled) <= 2 * 3
    assert len([first, *it]) == 9


def test_async_with_several_micro_batches_accumulates_within_a_mini_batch():
    # With micro_batches=m, each streamed mini-batch is one update of the mean gradient over its micro-batches.
    pipe2 = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=2, micro_batches=2, schedule="async-1f1b",
                            staleness="stash", optimizer=RecordingSGD, partitioner="uniform",
                            engine="local")
    results2 = list(pipe2.train(stream(5)))
    assert len(results2) == 5 and all(len(rt.optimizer.grads) == 5 for rt in pipe2.held_stages.values())
    # The first mini-batch sees no staleness at all, so its update equals the synchronous one.
    x, y = stream(5)[0]
    model = make("mlp")
    nn.functional.cross_entropy(model(x), y).backward()
    for v, rt in pipe2.held_stages.items():
        for name, g in zip(stage_names(pipe2)[v], rt.optimizer.grads[0]):
            torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, atol=1e-6, rtol=1e-5)


def forward_versions(stages, micro_batches, steps):
    """(stage, micro-batch) -> optimizer steps the stage takes before that micro-batch's forward,
    read off the stage's action list (the one the runtime executes)."""
    versions = {}
    for k in range(stages):
        done = 0
        for a in async_1f1b_actions(k, stages, micro_batches, lambda t: t < steps):
            if a.kind is ActionKind.STEP:
                done += 1
            elif a.kind is ActionKind.FORWARD:
                versions[(k, a.micro_batch)] = done
    return versions


@pytest.mark.parametrize("stages,m", [(3, 2), (4, 4), (4, 8)])
def test_stash_with_several_micro_batches_uses_each_micro_batch_forward_version(stages, m):
    # Each update is the mean over the mini-batch's micro-batches of the unsplit model's gradient
    # with every stage's weights as that stage's forward of the micro-batch saw them.
    steps, size = 5, 2
    batches = stream(steps, size=size * m)
    pipe = wrap_unprofiled(make("mlp"), batches[0][0][:size], stages=stages, micro_batches=m,
                           schedule="async-1f1b", staleness="stash", optimizer=RecordingSGD, partitioner="uniform",
                           engine="local")
    results = list(pipe.train(batches))
    versions = forward_versions(stages, m, steps)
    # Stage k's forward runs stages - k - 1 micro-batches ahead of its backward, so within a
    # mini-batch only that many micro-batches can straddle an update: the lag is below one step.
    lags = [t - versions[(k, g)] for (k, g) in versions for t in [g // m]]
    assert max(lags) == 1 and all(lag in (0, 1) for lag in lags)
    for t in range(steps):
        x, y = batches[t]
        parts = [hand_gradients(pipe, t, x[j * size:(j + 1) * size], y[j * size:(j + 1) * size],
                                {k: versions[(k, t * m + j)] for k in pipe.held_stages}) for j in range(m)]
        for v, rt in pipe.held_stages.items():
            for name, g in zip(stage_names(pipe)[v], rt.optimizer.grads[t]):
                expected = sum(part[name] for part in parts) / m
                torch.testing.assert_close(g, expected, atol=1e-6, rtol=1e-5, msg=f"t={t} stage {v} {name}")
    # The reported lag is the mean over the mini-batch's micro-batches (steady state: the last one).
    assert results[-2].version_lag == [sum(t - versions[(k, g)] for g in range(t * m, (t + 1) * m)) / m
                                       for k in range(stages) for t in [steps - 2]]


@pytest.mark.parametrize("staleness", ["vanilla", "stash", "spectrain"])
def test_async_local_engine_is_deterministic(staleness):
    # The local engine is the reference the distributed one is compared with: two runs must agree bit for bit.
    runs = [run_async(staleness, 4, steps=9)[0].state_dict() for _ in range(2)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


@pytest.mark.parametrize("stages", [2, 3])
def test_spectrain_forward_only_predicts_p_minus_k_minus_1_and_reuses_it_backward(stages):
    steps = 2 * stages + 1
    pipe = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=stages, micro_batches=1, schedule="async-1f1b",
                           staleness="spectrain", spectrain_variant="forward-only", optimizer=RecordingSGD,
                           partitioner="uniform", engine="local")
    seen = {v: [] for v in pipe.held_stages}
    for v, rt in pipe.held_stages.items():
        first = next(m for m in rt.module.modules() if isinstance(m, nn.Linear))
        first.register_forward_hook(lambda m, i, o, v=v: seen[v].append(m.weight.detach().clone()))
    list(pipe.train(stream(steps)))
    batches = stream(steps)
    for v, rt in pipe.held_stages.items():
        opt, s = rt.optimizer, stages - v - 1
        for t in range(steps):
            u = max(0, t - s)
            w = opt.weights[u][0]
            expected = w if u == 0 else w - s * LR * opt.momenta[u][0]
            torch.testing.assert_close(seen[v][t], expected, atol=1e-7, rtol=0, msg=f"stage {v} t={t}")
    # The backward reuses the forward's prediction: the applied gradient is the gradient at those weights.
    for t in range(steps):
        model = make("mlp")
        params = dict(model.named_parameters())
        with torch.no_grad():
            for v, rt in pipe.held_stages.items():
                s = stages - v - 1
                u = max(0, t - s)
                for i, name in enumerate(stage_names(pipe)[v]):
                    w = rt.optimizer.weights[u][i]
                    params[name].copy_(w if u == 0 else w - s * LR * rt.optimizer.momenta[u][i])
        nn.functional.cross_entropy(model(batches[t][0]), batches[t][1]).backward()
        for v, rt in pipe.held_stages.items():
            for name, g in zip(stage_names(pipe)[v], rt.optimizer.grads[t]):
                torch.testing.assert_close(g, params[name].grad, atol=1e-6, rtol=1e-5, msg=f"t={t} {name}")


def test_spectrain_with_lars_predicts_from_its_scaled_momentum():
    from pipetrain.optim import LARS

    pipe = wrap_unprofiled(make("mlp"), stream(1)[0][0], stages=3, micro_batches=1, schedule="async-1f1b",
                           staleness="spectrain", optimizer=lambda p: LARS(p, lr=0.1, momentum=0.9),
                           partitioner="uniform", engine="local")
    results = list(pipe.train(stream(6)))
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in results)
    rt = pipe.held_stages[0]
    name, p = next(iter(rt.module.named_parameters()))
    rt.policy.forward_weights(5)  # past the warm-up, stage 0 of 3 predicts 0 // 2 + 3 - 0 - 1 = 2 updates ahead
    expected = p.detach() - 2 * 0.1 * rt.optimizer.state[p]["momentum_buffer"]
    torch.testing.assert_close(rt.policy.scratch[name].detach(), expected, atol=1e-7, rtol=0)


class TiedHead(nn.Module):
    """An embedding whose matrix the output layer reuses (tied, as language models do)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def test_weight_swap_equals_functional_call_with_ties_and_puts_the_parameters_back():
    from pipetrain.runtime.weight_swap import WeightSwap

    torch.manual_seed(0)
    model = TiedHead()
    live = dict(model.named_parameters())
    weights = {n: (p.detach() + 0.1 * torch.randn_like(p)).requires_grad_() for n, p in live.items()}
    assert "head.weight" not in weights  # the tie: one weight set entry serves both slots
    tokens = torch.tensor([[1, 4, 7], [2, 9, 0]])
    swapped = WeightSwap(model)(weights, (tokens,))
    expected = torch.func.functional_call(model, weights, (tokens,), tie_weights=True)
    torch.testing.assert_close(swapped, expected, rtol=0, atol=0)  # the same ops on the same tensors
    swapped.square().sum().backward()
    assert all(p.grad is None for p in live.values())  # the gradient went to the weight set, not the live weights
    assert weights["embed.weight"].grad is not None and weights["mix.bias"].grad is not None
    assert dict(model.named_parameters()) == live and model.head.weight is model.embed.weight

    def failing(_):
        raise RuntimeError("boom")

    model.mix.register_forward_hook(lambda *a: failing(a))
    with pytest.raises(RuntimeError, match="boom"):
        WeightSwap(model)(weights, (tokens,))
    assert dict(model.named_parameters()) == live and model.head.weight is model.embed.weight

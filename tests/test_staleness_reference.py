"""async-1f1b staleness policies against an independent step-by-step reference.

The model is a chain of Linear layers, one per stage (tanh between them). The reference below
knows nothing of the runtime: it computes every micro-batch's forward and backward by hand with
the weights the policy's definition names for that micro-batch, mini-batch after mini-batch,
and applies torch's SGD-momentum update itself. Which weight version a micro-batch meets is the
closed form of the async-1f1b schedule (stage k forwards N-k-1 micro-batches ahead of its oldest
backward and steps after every m-th backward), written here independently of schedules.StreamLags.
"""
import pytest
import torch
from torch import nn

from pipetrain.runtime.staleness import look_ahead_steps
from schedules import ActionKind, StreamLags, async_1f1b_actions
from helpers import wrap_unprofiled

WIDTH, CLASSES, LR, MOMENTUM, SIZE = 6, 3, 0.2, 0.9, 2


def chain(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(stages - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, CLASSES))


def stream(steps: int, m: int) -> list:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, m * SIZE, WIDTH, generator=g)
    y = torch.randint(0, CLASSES, (steps, m * SIZE), generator=g)
    return list(zip(x, y))


def lag(u: int, k: int, stages: int, m: int) -> int:
    return u // m - max(u - (stages - k - 1), 0) // m


def run_pipeline(staleness: str, stages: int, m: int, steps: int, **options):
    pipe = wrap_unprofiled(chain(stages), stream(1, m)[0][0][:SIZE], stages=stages, micro_batches=m,
                           schedule="async-1f1b", staleness=staleness, partitioner=[str(k) for k in range(1, stages)],
                           optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
                           engine="local", **options)
    results = list(pipe.train(stream(steps, m)))
    return pipe, results


class Reference:
    """Stage k's weights after j updates (W[k][j], b[k][j]) and momentum buffers, built update by update."""

    def __init__(self, stages: int, m: int, policy: str, lookahead: float = 1.0):
        model = chain(stages)
        linears = [blk[0] if isinstance(blk, nn.Sequential) else blk for blk in model]
        self.params = [[[lin.weight.detach().clone(), lin.bias.detach().clone()]] for lin in linears]
        self.buffers = [[None] for _ in linears]
        self.stages, self.m, self.policy, self.lookahead = stages, m, policy, lookahead

    def weights(self, k: int, version: int, steps: float, nesterov_delay: float | None = None) -> list:
        w = self.params[k][version]
        buf = self.buffers[k][version]
        if buf is None:
            return w
        if nesterov_delay is not None:
            steps = look_ahead_steps(self.momentum(k), nesterov_delay)
        return [p - steps * LR * self.scale(k, version) * v for p, v in zip(w, buf)]

    def scale(self, k: int, t: int) -> float:
        """The factor on stage k's rate at its update t (1: none; test_delay_corrections' PipeMare rates)."""
        return 1.0

    def momentum(self, k: int) -> float:
        """Stage k's momentum (test_delay_corrections' stage_momentum changes it)."""
        return MOMENTUM

    def versions(self, u: int, k: int) -> tuple[list, list]:
        """(forward weights, backward weights) of micro-batch u at stage k, by the policy's definition."""
        N, m, t = self.stages, self.m, u // self.m
        d = lag(u, k, N, m)
        before_forward = t - d  # updates the stage has applied when u's forward runs
        if self.policy == "vanilla":
            return self.weights(k, before_forward, 0), self.weights(k, t, 0)
        if self.policy == "stash":
            w = self.weights(k, before_forward, 0)
            return w, w
        if self.policy == "2bw":
            w = self.weights(k, max(t - 1, 0), 0)
            return w, w
        if self.policy == "spectrain":
            offset = (k // 2) / m
            return (self.weights(k, before_forward, self.lookahead * (d + offset)),
                    self.weights(k, t, self.lookahead * offset))
        if self.policy == "nesterov":
            w = self.weights(k, before_forward, 0, nesterov_delay=self.lookahead * d)
            return w, w
        raise ValueError(self.policy)

    def gradients(self, u: int, x: torch.Tensor, y: torch.Tensor) -> list:
        """Hand-written forward and backward of one micro-batch through the chain; the loss is the
        micro-batch's mean cross-entropy divided by m (its share of the mini-batch mean)."""
        N = self.stages
        pairs = [self.versions(u, k) for k in range(N)]
        inputs, outputs = [], []
        h = x
        for k, (fwd, _) in enumerate(pairs):
            inputs.append(h)
            z = h @ fwd[0].T + fwd[1]
            h = torch.tanh(z) if k < N - 1 else z
            outputs.append(h)
        probs = torch.softmax(h, dim=1)
        delta = (probs - nn.functional.one_hot(y, CLASSES).to(probs.dtype)) / (len(y) * self.m)
        grads = [None] * N
        for k in reversed(range(N)):
            if k < N - 1:
                delta = delta * (1 - outputs[k] ** 2)  # tanh' from the forward's saved output
            grads[k] = [delta.T @ inputs[k], delta.sum(0)]
            delta = delta @ pairs[k][1][0]  # the input gradient reads the backward's weights
        return grads

    def summed_gradients(self, t: int, x: torch.Tensor, y: torch.Tensor) -> list:
        """Each stage's gradients of mini-batch t, summed over its m micro-batches."""
        total = [[torch.zeros_like(p) for p in self.params[k][0]] for k in range(self.stages)]
        for j in range(self.m):
            part = slice(j * SIZE, (j + 1) * SIZE)
            for k, g in enumerate(self.gradients(t * self.m + j, x[part], y[part])):
                total[k] = [a + b for a, b in zip(total[k], g)]
        return total

    def train(self, batches: list) -> None:
        for t, (x, y) in enumerate(batches):
            total = self.summed_gradients(t, x, y)
            for k in range(self.stages):  # torch.optim.SGD: buf = momentum * buf + g; W -= lr * buf
                old = self.buffers[k][t]
                buf = total[k] if old is None else [MOMENTUM * b + g for b, g in zip(old, total[k])]
                self.buffers[k].append(buf)
                self.params[k].append([p - LR * b for p, b in zip(self.params[k][t], buf)])


CASES = [(policy, stages, m) for policy in ("spectrain", "nesterov", "2bw", "stash", "vanilla")
         for stages, m in ((3, 1), (4, 1), (3, 2), (4, 3), (4, 8)) if not (policy == "2bw" and m < stages - 1)]


@pytest.mark.parametrize("policy,stages,m", CASES)
def test_training_equals_the_step_by_step_reference(policy, stages, m):
    steps = 6
    pipe, _ = run_pipeline(policy, stages, m, steps)
    ref = Reference(stages, m, policy)
    ref.train(stream(steps, m))
    state = pipe.state_dict()
    for k in range(stages):
        prefix = f"{k}.0" if k < stages - 1 else f"{k}"
        # Six updates of a few float32 multiply-adds each, in another order than the runtime's kernels.
        torch.testing.assert_close(state[f"{prefix}.weight"], ref.params[k][steps][0], atol=1e-6, rtol=1e-5,
                                   msg=f"{policy} N={stages} m={m} stage {k}")
        torch.testing.assert_close(state[f"{prefix}.bias"], ref.params[k][steps][1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["spectrain", "nesterov"])
def test_lookahead_scales_the_prediction(policy):
    pipe, _ = run_pipeline(policy, 4, 2, 5, lookahead=2.5)
    ref = Reference(4, 2, policy, lookahead=2.5)
    ref.train(stream(5, 2))
    state = pipe.state_dict()
    torch.testing.assert_close(state["0.0.weight"], ref.params[0][5][0], atol=1e-6, rtol=1e-5)


def test_two_buffered_holds_at_most_two_versions():
    pipe, _ = run_pipeline("2bw", 4, 3, 8)
    assert [rt.policy.peak_versions for rt in pipe.held_stages.values()] == [2, 2, 2, 2]
    assert all(rt.policy.versions_held() == 0 for rt in pipe.held_stages.values())  # released when the stream ends


def test_two_buffered_needs_enough_micro_batches():
    with pytest.raises(ValueError, match="micro_batches >= stages - 1 = 3"):
        run_pipeline("2bw", 4, 2, 1)


def test_nesterov_refuses_an_optimizer_that_looks_ahead_itself():
    with pytest.raises(ValueError, match="nesterov=False"):
        wrap_unprofiled(chain(2), stream(1, 1)[0][0][:SIZE], stages=2, micro_batches=1, schedule="async-1f1b",
                        staleness="nesterov", partitioner=["1"], engine="local",
                        optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM, nesterov=True))


def test_lookahead_only_where_something_is_predicted():
    with pytest.raises(ValueError, match="leave lookahead at 1.0"):
        run_pipeline("stash", 2, 1, 1, lookahead=2.0)


# -- the prediction distances, read off the action lists --------------------------------------------------


def hand_count(stage: int, stages: int, m: int, mini_batches: int) -> dict[int, int]:
    """micro-batch -> STEP actions between its F and its B, counted by position in the list."""
    actions = list(async_1f1b_actions(stage, stages, m, lambda t: t < mini_batches))
    where = {(a.kind, a.micro_batch): i for i, a in enumerate(actions)
             if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)}
    steps = [i for i, a in enumerate(actions) if a.kind is ActionKind.STEP]
    return {u: sum(where[(ActionKind.FORWARD, u)] < s < where[(ActionKind.BACKWARD, u)] for s in steps)
            for u in range(mini_batches * m)}


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_spectrain_distances_equal_a_hand_count_on_the_action_lists(stages, m):
    mini_batches = 12
    pipe = wrap_unprofiled(chain(stages), stream(1, m)[0][0][:SIZE], stages=stages, micro_batches=m,
                           schedule="async-1f1b", staleness="spectrain", partitioner=[str(k) for k in range(1, stages)],
                           optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
                           engine="local")
    for k, rt in pipe.held_stages.items():
        counted = hand_count(k, stages, m, mini_batches)
        assert [rt.policy.distance(u) for u in counted] == [counted[u] + (k // 2) / m for u in counted]
        assert rt.policy.s_bwd == (k // 2) / m
        assert [StreamLags(k, stages, m)(u) for u in counted] == [lag(u, k, stages, m) for u in counted]
        # The mean lag past the warm-up is (N-k-1)/m updates.
        steady = [counted[u] for u in range(4 * m, 8 * m)]
        assert sum(steady) / len(steady) == (stages - k - 1) / m


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_with_one_micro_batch_spectrain_predicts_the_papers_distances(stages):
    pipe, _ = run_pipeline("spectrain", stages, 1, 1)
    for k, rt in pipe.held_stages.items():
        u = 3 * stages  # past the warm-up
        assert rt.policy.distance(u) == k // 2 + stages - k - 1
        assert rt.policy.s_bwd == k // 2


def test_diagnostics_report_distance_and_error_per_stage():
    stages, m = 4, 2
    _, results = run_pipeline("spectrain", stages, m, 10)
    _, vanilla = run_pipeline("vanilla", stages, m, 10)
    last = results[-1]
    for k in range(stages):
        # Mean over the mini-batch's micro-batches of lag(u) + floor(k/2)/m.
        expected = sum(lag(u, k, stages, m) for u in range(9 * m, 10 * m)) / m + (k // 2) / m
        assert last.prediction_distance[k] == pytest.approx(expected)
        assert vanilla[-1].prediction_distance[k] == 0.0
    errors = [[r.prediction_error[k] for r in vanilla[3:]] for k in range(stages)]
    measured = [[e for e in per_stage if e == e] for per_stage in errors]  # NaN: not sampled that mini-batch
    assert all(measured)
    # The last stage's forward weights are the ones its gradient is applied to: no error at all.
    assert max(measured[-1]) == 0.0
    # Vanilla's first stage computes on weights lagging by whole updates: its error is of the order of
    # the updates it missed (one update has size lr*|v|, the unit).
    assert 0.0 < max(measured[0]) < 3 * max(lag(u, 0, stages, m) for u in range(20))


@pytest.mark.parametrize("optimizer", ["adam", "lars", "lamb"])
def test_nesterov_and_spectrain_predict_from_adam_lars_and_lamb_state(optimizer):
    # W - s * lr * v with v computed here from the optimizer's state: Adam's bias-corrected
    # m_hat / (sqrt(v_hat) + eps) with beta1 as the momentum, LARS's scaled momentum buffer, and LAMB's
    # r = Adam's direction + weight_decay * W scaled by ||W|| / ||r|| (the paper's; 1-D tensors: Adam's alone).
    from pipetrain.optim import LAMB, LARS

    make_opt = {"adam": lambda p: torch.optim.Adam(p, lr=0.01), "lars": lambda p: LARS(p, lr=0.1, momentum=0.8),
                "lamb": lambda p: LAMB(p, lr=0.01, weight_decay=0.01)}[optimizer]
    for policy in ("nesterov", "spectrain"):
        pipe = wrap_unprofiled(chain(3), stream(1, 2)[0][0][:SIZE], stages=3, micro_batches=2, schedule="async-1f1b",
                               staleness=policy, partitioner=["1", "2"], optimizer=make_opt,
                               engine="local")
        results = list(pipe.train(stream(4, 2)))
        assert all(r.loss == r.loss for r in results)
        rt = pipe.held_stages[0]
        opt = rt.optimizer
        group = opt.param_groups[0]
        u = 9  # lag 1 at stage 0 of 3 with 2 micro-batches (u // 2 - (u - 2) // 2)
        assert lag(u, 0, 3, 2) == 1
        if policy == "nesterov":
            gamma = group["momentum"] if optimizer == "lars" else group["betas"][0]
            steps = gamma + gamma ** 2
            weights = rt.policy._make_version(u)
        else:
            steps = 1  # lag(u) + floor(0 / 2) / m
            weights = rt.policy.forward_weights(u)
        for name, p in rt.module.named_parameters():
            state = opt.state[p]
            if optimizer in ("adam", "lamb"):
                beta1, beta2 = group["betas"]
                t = float(state["step"])
                v = (state["exp_avg"] / (1 - beta1 ** t)) / ((state["exp_avg_sq"] / (1 - beta2 ** t)).sqrt() + group["eps"])
                if optimizer == "lamb" and p.dim() > 1:
                    r = v + group["weight_decay"] * p.detach()
                    v = p.detach().norm() / r.norm() * r
            else:
                v = state["momentum_buffer"]
            torch.testing.assert_close(weights[name].detach(), p.detach() - steps * group["lr"] * v,
                                       atol=1e-7, rtol=1e-6, msg=f"{policy} {optimizer} {name}")

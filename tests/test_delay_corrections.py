"""The async-1f1b delay corrections (spike compensation, DC-ASGD-a, PipeMare's per-stage rates, delay-matched
momentum, error feedback on the update) against a hand-written reference of their update rules.

The reference extends test_staleness_reference's: the same chain of Linear layers and hand-written forward
and backward with the weights the policy's definition names, and the optimizer's update written out here
(SGD-momentum, with or without Nesterov, and Adam) with each correction applied by its paper's formula, from
the closed-form lag of the async-1f1b schedule. Nothing of the runtime is used.
"""
import pytest
import torch

from test_staleness_reference import LR, MOMENTUM, SIZE, Reference, chain, lag, run_pipeline, stream
from dist_harness import run_world
from helpers import wrap_unprofiled

ADAM_LR, BETAS, EPS = 0.05, (0.8, 0.99), 1e-8
DC_AVERAGE, DC_EPS = 0.95, 1e-7


def gradient_delay(policy: str, u: int, k: int, stages: int, m: int) -> int:
    """Updates between the weights micro-batch u's gradient is computed at and those it is applied to."""
    if policy == "2bw":
        return 1 if u // m >= 1 else 0
    return lag(u, k, stages, m)


class CorrectedReference(Reference):
    """Reference training with the corrections applied to each stage's update by hand."""

    def __init__(self, stages, m, policy, spike=False, dc=0.0, warmup=0, optimizer="sgd", stage_momentum=False,
                 error_feedback=False):
        super().__init__(stages, m, policy)
        self.spike, self.dc, self.warmup, self.optimizer = spike, dc, warmup, optimizer
        self.stage_momentum, self.error_feedback = stage_momentum, error_feedback
        self.previous_update = [None] * stages  # error feedback: u_{t-1} per stage
        self.mean_square = [None] * stages
        self.adam = [[None, None, 0] for _ in range(stages)]  # exp_avg, exp_avg_sq, steps per stage
        # The delay past the warm-up: (N - k - 1) / m on average, 1 for 2bw.
        self.steady = [1.0 if policy == "2bw" else
                       sum(lag(u, k, stages, m) for u in range(8 * m, 9 * m)) / m for k in range(stages)]

    def momentum(self, k: int, base: float = MOMENTUM) -> float:
        """Stage k's momentum: with stage_momentum, the window 1 / (1 - beta) times (1 + D_k)^2."""
        return 1 - (1 - base) / (1 + self.steady[k]) ** 2 if self.stage_momentum else base

    def scale(self, k: int, t: int) -> float:
        if not self.warmup:
            return 1.0
        return (1.0 + self.steady[k]) ** -(1.0 - min(t / self.warmup, 1.0))

    def train(self, batches):
        N, m = self.stages, self.m
        for t, (x, y) in enumerate(batches):
            total = [[torch.zeros_like(p) for p in self.params[k][0]] for k in range(N)]
            stale = [[torch.zeros_like(p) for p in self.params[k][0]] for k in range(N)]
            for j in range(m):
                u = t * m + j
                part = slice(j * SIZE, (j + 1) * SIZE)
                for k, g in enumerate(self.gradients(u, x[part], y[part])):
                    total[k] = [a + b for a, b in zip(total[k], g)]
                    stale[k] = [s + w / m for s, w in zip(stale[k], self.versions(u, k)[0])]
            for k in range(N):
                delay = sum(gradient_delay(self.policy, t * m + j, k, N, m) for j in range(m)) / m
                w = self.params[k][t]
                g = total[k]
                if self.dc:
                    old = self.mean_square[k]
                    ms = [(1 - DC_AVERAGE) * gi * gi if old is None else DC_AVERAGE * o + (1 - DC_AVERAGE) * gi * gi
                          for gi, o in zip(g, old or g)]
                    self.mean_square[k] = ms
                    g = [gi + self.dc * gi * gi / (s.sqrt() + DC_EPS) * (wi - si)
                         for gi, s, wi, si in zip(g, ms, w, stale[k])]
                lr_scale = self.scale(k, t)
                if self.optimizer == "adam":
                    self.params[k].append(self.fed_back(k, w, self.adam_update(k, w, g, delay, ADAM_LR * lr_scale),
                                                        delay))
                    self.buffers[k].append(None)
                    continue
                old = self.buffers[k][t]
                beta = self.momentum(k)
                # the same lr / (1 - beta) through dampening; the buffer starts at zero where beta changed
                kept = (1 - beta) / (1 - MOMENTUM)
                if old is None and beta != MOMENTUM:
                    old = [torch.zeros_like(gi) for gi in g]
                buf = g if old is None else [beta * b + kept * gi for b, gi in zip(old, g)]
                self.buffers[k].append(buf)
                if self.optimizer == "nag":
                    update = [gi + MOMENTUM * b for gi, b in zip(g, buf)]
                    if self.spike and delay:  # a scales gamma * buf; the gradient's own term takes the rest
                        a = MOMENTUM ** delay
                        beta = 1 + MOMENTUM * (1 - MOMENTUM ** delay) / (1 - MOMENTUM)
                        update = [beta * gi + a * MOMENTUM * b for gi, b in zip(g, buf)]
                else:
                    update = buf
                    if self.spike and delay:  # the gradient's share of buf is kept, not 1
                        a, b_ = beta ** delay, (1 - beta ** delay) / (1 - beta)
                        update = [a * b + b_ * kept * gi for b, gi in zip(buf, g)]
                self.params[k].append(self.fed_back(k, w, [p - LR * lr_scale * d for p, d in zip(w, update)], delay))

    def fed_back(self, k, w, stepped, delay):
        """Error feedback: W(t+1) = W(t) + u_t + D (u_t - u_{t-1}), u_t = stepped - W(t) the step's own update."""
        if not self.error_feedback:
            return stepped
        update = [n - p for n, p in zip(stepped, w)]
        previous, self.previous_update[k] = self.previous_update[k], update
        if previous is None or delay == 0:
            return stepped
        return [n + delay * (u - v) for n, u, v in zip(stepped, update, previous)]

    def adam_update(self, k, w, g, delay, lr):
        exp_avg, exp_avg_sq, steps = self.adam[k]
        beta1, beta2 = self.momentum(k, BETAS[0]), BETAS[1]
        exp_avg = [(1 - beta1) * gi if exp_avg is None else beta1 * e + (1 - beta1) * gi for gi, e in zip(g, exp_avg or g)]
        exp_avg_sq = [(1 - beta2) * gi * gi if exp_avg_sq is None else beta2 * e + (1 - beta2) * gi * gi
                      for gi, e in zip(g, exp_avg_sq or g)]
        steps += 1
        self.adam[k] = [exp_avg, exp_avg_sq, steps]
        a = beta1 ** delay if self.spike else 1.0
        numerators = [a * e + (1 - a) * gi for e, gi in zip(exp_avg, g)]
        return [p - lr * n / (1 - beta1 ** steps) / ((s / (1 - beta2 ** steps)).sqrt() + EPS)
                for p, n, s in zip(w, numerators, exp_avg_sq)]


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM),
    "nag": lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=ADAM_LR, betas=BETAS, eps=EPS),
}
CORRECTIONS = {"spike": dict(spike_compensation=True), "dc": dict(dc_lambda=0.5), "warmup": dict(stage_lr_warmup=4),
               "momentum": dict(stage_momentum=True), "feedback": dict(error_feedback=True),
               "all": dict(spike_compensation=True, dc_lambda=0.5, stage_lr_warmup=4, stage_momentum=True,
                           error_feedback=True)}
CASES = [("stash", 4, 1, "sgd", "spike"), ("stash", 3, 2, "sgd", "spike"), ("stash", 4, 3, "nag", "spike"),
         ("stash", 4, 1, "adam", "spike"), ("2bw", 4, 3, "sgd", "spike"), ("stash", 4, 1, "sgd", "dc"),
         ("stash", 3, 2, "adam", "dc"), ("2bw", 3, 2, "sgd", "dc"), ("nesterov", 4, 1, "sgd", "warmup"),
         ("stash", 4, 3, "adam", "warmup"), ("nesterov", 4, 1, "sgd", "momentum"), ("spectrain", 4, 1, "sgd", "momentum"),
         ("stash", 4, 2, "adam", "momentum"), ("2bw", 3, 2, "sgd", "momentum"), ("2bw", 4, 3, "sgd", "feedback"),
         ("2bw", 3, 2, "adam", "feedback"), ("2bw", 4, 3, "nag", "feedback"), ("stash", 4, 1, "sgd", "feedback"),
         ("nesterov", 4, 1, "sgd", "all"), ("stash", 3, 2, "adam", "all")]


def equal_to_reference(policy, stages, m, optimizer, correction, steps=7):
    options = CORRECTIONS[correction]
    pipe = wrap_unprofiled(chain(stages), stream(1, m)[0][0][:SIZE], stages=stages, micro_batches=m,
                           schedule="async-1f1b", staleness=policy, partitioner=[str(k) for k in range(1, stages)],
                           optimizer=OPTIMIZERS[optimizer], engine="local", **options)
    list(pipe.train(stream(steps, m)))
    ref = CorrectedReference(stages, m, policy, spike=options.get("spike_compensation", False),
                             dc=options.get("dc_lambda", 0.0), warmup=options.get("stage_lr_warmup", 0),
                             optimizer=optimizer, stage_momentum=options.get("stage_momentum", False),
                             error_feedback=options.get("error_feedback", False))
    ref.train(stream(steps, m))
    return pipe.state_dict(), ref


@pytest.mark.parametrize("policy,stages,m,optimizer,correction", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_each_correction_equals_its_hand_written_update_rule(policy, stages, m, optimizer, correction):
    steps = 7
    state, ref = equal_to_reference(policy, stages, m, optimizer, correction, steps)
    for k in range(stages):
        prefix = f"{k}.0" if k < stages - 1 else f"{k}"
        # Seven updates of a few float32 operations each, in another order than the runtime's kernels.
        torch.testing.assert_close(state[f"{prefix}.weight"], ref.params[k][steps][0], atol=2e-6, rtol=1e-5,
                                   msg=f"{policy} N={stages} m={m} {optimizer} {correction}: stage {k}")
        torch.testing.assert_close(state[f"{prefix}.bias"], ref.params[k][steps][1], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("correction", ["spike", "dc", "warmup", "momentum", "feedback"])
def test_each_correction_moves_the_delayed_first_stage(correction):
    # Against plain stash, so the test above cannot pass with a correction silently off.
    stages, m, steps = 4, 1, 7
    state, _ = equal_to_reference("stash", stages, m, "sgd", correction, steps)
    plain = Reference(stages, m, "stash")
    plain.train(stream(steps, m))
    assert not torch.allclose(state["0.0.weight"], plain.params[0][steps][0], atol=1e-4)


def test_refusals_name_what_works():
    x = stream(1, 1)[0][0][:SIZE]
    common = dict(stages=2, micro_batches=1, partitioner=["1"], engine="local")
    with pytest.raises(ValueError, match="forward-only"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="vanilla", dc_lambda=1.0, **common)
    for correction in CORRECTIONS.values():
        with pytest.raises(ValueError, match="has none: leave them off"):
            wrap_unprofiled(chain(2), x, schedule="1f1b", **correction, **common)
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="2bw", error_feedback=1, **common)
    with pytest.raises(ValueError, match="torch.optim.SGD .*Adam"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="stash", spike_compensation=True,
                        optimizer=lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9), **common)
    with pytest.raises(ValueError, match="momentum > 0"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="stash", spike_compensation=True,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01), **common)
    with pytest.raises(ValueError, match="nesterov=False with staleness='nesterov'"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="stash", stage_momentum=True,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, nesterov=True), **common)
    with pytest.raises(ValueError, match="stage_momentum is defined for torch.optim.SGD"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="stash", stage_momentum=True,
                        optimizer=lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9), **common)
    with pytest.raises(ValueError, match="stage_lr_warmup must be a whole number"):
        wrap_unprofiled(chain(2), x, schedule="async-1f1b", staleness="stash", stage_lr_warmup=-1, **common)


DISTRIBUTED = [("nesterov", 1, "sgd", "all"), ("stash", 2, "adam", "all"), ("2bw", 2, "nag", "spike"),
               ("spectrain", 1, "sgd", "momentum"), ("2bw", 2, "adam", "feedback")]


def train_corrected(staleness, m, optimizer, correction, engine, steps=6):
    pipe = wrap_unprofiled(chain(2), stream(1, m)[0][0][:SIZE], stages=2, micro_batches=m, schedule="async-1f1b",
                           staleness=staleness, partitioner=["1"], optimizer=OPTIMIZERS[optimizer], engine=engine,
                           **CORRECTIONS[correction])
    losses = [r.loss for r in pipe.train(stream(steps, m))]
    return losses, pipe.state_dict()


def distributed_runs(rank, world):
    return [train_corrected(*case, engine="distributed") for case in DISTRIBUTED]


@pytest.mark.slow
def test_the_distributed_engine_equals_the_local_one(tmp_path, one_thread):
    per_rank = run_world(2, "test_delay_corrections", "distributed_runs", tmp_path)
    for i, case in enumerate(DISTRIBUTED):
        losses, state = train_corrected(*case, engine="local")
        merged = {k: v for rank in per_rank for k, v in rank[i][1].items()}
        assert per_rank[0][i][0] == losses, case  # every rank reports the same losses, bit for bit
        assert set(merged) == set(state), case
        for name, value in state.items():
            assert torch.equal(merged[name], value), f"{case}: {name}"


def test_stage_momentum_follows_the_delays_of_the_layout_a_checkpoint_resumes_at(tmp_path):
    # Saved at 4 stages (stage 0's delay 3), resumed at 2 (stage 0's delay 1): each stage's momentum is
    # the rule's for its new delay, from the groups' own 0.9, not the saved stage's 0.99.
    x = stream(1, 1)[0][0][:SIZE]

    def pipe(stages):
        return wrap_unprofiled(chain(4), x, stages=stages, micro_batches=1, schedule="async-1f1b",
                               staleness="nesterov", partitioner=[str(k) for k in range(4 // stages, 4, 4 // stages)],
                               optimizer=OPTIMIZERS["sgd"], engine="local", stage_momentum=True)

    four = pipe(4)
    assert [four.held_stages[k].optimizer.param_groups[0]["momentum"] for k in range(4)] == pytest.approx(
        [1 - 0.1 / 16, 1 - 0.1 / 9, 1 - 0.1 / 4, 0.9])
    list(four.train(stream(3, 1)))
    four.save(tmp_path)
    two = pipe(2)
    two.load(tmp_path)
    list(two.train(stream(1, 1)))
    groups = [two.held_stages[k].optimizer.param_groups[0] for k in range(2)]
    assert [g["momentum"] for g in groups] == pytest.approx([1 - 0.1 / 4, 0.9])
    assert [g["dampening"] for g in groups] == pytest.approx([1 - 0.25, 0.0])

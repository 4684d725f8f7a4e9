"""Global gradient clipping (max_grad_norm) and learning-rate schedules (lr_scheduler) against the unsplit
model trained with torch.nn.utils.clip_grad_norm_ and the same scheduler; resumes with both, bit for bit.

Tolerances: the global norm is summed per stage, then over stages (the unsplit model sums every tensor's norm
at once), so it differs from clip_grad_norm_'s in the last bits of float32; 1e-5 relative on parameters after
a few steps covers that, as for every other fp32 comparison with the unsplit model here.
"""
from __future__ import annotations

import math

import pytest
import torch

import pipetrain
from dist_harness import run_world
from runtime_models import data, loss_fn, make
from helpers import batches, wrap_unprofiled

MICRO = 4


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def warmup_cosine(optimizer):
    """Two warm-up steps, then cosine decay to 0 over 6: the shape every LM recipe uses."""
    def factor(step):
        if step < 2:
            return (step + 1) / 2
        return 0.5 * (1 + math.cos(math.pi * min(step - 2, 6) / 6))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def linear_after_constant(optimizer):
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=2),
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=4)], milestones=[2])


def unsplit(name, steps, optimizer=sgd, max_norm=None, norm_type=2.0, scheduler=None):
    """The unsplit model with gradient accumulation over MICRO micro-batches, clipped by clip_grad_norm_."""
    model = make(name)
    opt = optimizer(model.parameters())
    sched = scheduler(opt) if scheduler else None
    norms = []
    for x, y in batches(name, steps, draw_per_step=True):
        opt.zero_grad()
        for xb, yb in zip(x.tensor_split(MICRO), y.tensor_split(MICRO)):
            (loss_fn(name)(model(xb), yb) * (len(xb) / len(x))).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else math.inf,
                                                           norm_type)))
        opt.step()
        if sched:
            sched.step()
    return model, norms, opt


def piped(name, stages, steps, engine="local", **options):
    pipe = wrap_unprofiled(make(name), data(name, 2)[0], stages=stages, micro_batches=MICRO, partitioner="uniform",
                           engine=engine, loss_fn=loss_fn(name), **{"optimizer": sgd, **options})
    norms = []
    for x, y in batches(name, steps, draw_per_step=True):
        pipe.step(x, y)
        norms.append(pipe.last_result.grad_norm)
    return pipe, norms


def assert_close_to(pipe, model, rtol=1e-5):
    state = pipe.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=rtol, atol=1e-7, msg=k)


@pytest.mark.parametrize("name, stages", [("mlp", 2), ("mlp", 4), ("tied", 2), ("tied", 4), ("skip", 3)])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_by_the_global_norm_equals_clip_grad_norm_on_the_unsplit_model(name, stages, norm_type):
    # max_norm 0.05: every step is clipped (the norms are 0.3-2 here), so a per-stage clip would differ at once.
    model, expected, _ = unsplit(name, 3, max_norm=0.05, norm_type=norm_type)
    pipe, norms = piped(name, stages, 3, max_grad_norm=0.05, norm_type=norm_type)
    assert all(n > 0.05 for n in expected)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=0)  # tied copies counted once
    assert_close_to(pipe, model)


def test_the_norm_is_reported_without_clipping_and_adamw_clips_like_torch():
    model, expected, _ = unsplit("tied", 3, optimizer=adamw)
    pipe, norms = piped("tied", 2, 3, optimizer=adamw)
    torch.testing.assert_close(norms, expected, rtol=1e-5, atol=0)
    assert_close_to(pipe, model)
    model, expected, _ = unsplit("tied", 3, optimizer=adamw, max_norm=0.5)
    pipe, norms = piped("tied", 2, 3, optimizer=adamw, max_grad_norm=0.5)
    assert_close_to(pipe, model)


def test_fp16_takes_the_norm_after_unscaling():
    _, expected, _ = unsplit("mlp", 2)
    _, norms = piped("mlp", 2, 2, precision="fp16")
    # The loss scale is 2**16: a norm taken before unscaling would be 65536 times larger.
    torch.testing.assert_close(norms, expected, rtol=2e-2, atol=0)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", [warmup_cosine, linear_after_constant])
def test_a_learning_rate_schedule_steps_once_per_update_like_the_unsplit_model(stages, schedule):
    model, _, opt = unsplit("mlp", 5, max_norm=1.0, scheduler=schedule)
    pipe, _ = piped("mlp", stages, 5, max_grad_norm=1.0, lr_scheduler=schedule)
    assert_close_to(pipe, model)
    for stage in pipe.held_stages.values():
        assert stage.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_a_skipped_update_does_not_advance_the_schedule():
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=MICRO, partitioner="uniform",
                           engine="local", optimizer=sgd, lr_scheduler=warmup_cosine, nonfinite="skip")
    x, y = data("mlp", 8)
    pipe.step(x, y)
    x_nan = x.clone()
    x_nan[0, 0] = float("nan")
    pipe.step(x_nan, y)
    assert pipe.last_result.skipped and pipe.last_result.grad_norm != pipe.last_result.grad_norm  # NaN norm
    for stage in pipe.held_stages.values():
        assert stage.schedulers[0].last_epoch == 1 and stage.optimizer.param_groups[0]["lr"] == 0.1


def _resumable(stages, **options):
    return wrap_unprofiled(make("tied"), data("tied", 2)[0], stages=stages, micro_batches=MICRO, partitioner="uniform",
                           engine="local", loss_fn=loss_fn("tied"), optimizer=adamw,
                           lr_scheduler=warmup_cosine, max_grad_norm=0.5, **options)


def test_a_resume_with_a_schedule_and_clipping_equals_an_uninterrupted_run(tmp_path):
    steps = batches("tied", 6, draw_per_step=True)
    straight = _resumable(2)
    for i, batch in enumerate(steps):
        straight.step(*batch)
        if i == 2:
            straight.save(tmp_path)
    for stages, exact in ((2, True), (4, False)):
        resumed = _resumable(stages)
        resumed.load(tmp_path)
        for group in resumed.held_stages[0].optimizer.param_groups:
            assert group["initial_lr"] == 1e-2  # restored, as Optimizer.load_state_dict restores it
        for batch in steps[3:]:
            resumed.step(*batch)
        got, expected = resumed.state_dict(), straight.state_dict()
        for k in expected:
            if exact:  # the same layout: the same bits
                assert torch.equal(got[k], expected[k]), k
            else:  # another stage count sums the global norm in another order
                torch.testing.assert_close(got[k], expected[k], rtol=1e-5, atol=1e-7)
        assert resumed.held_stages[0].optimizer.param_groups[0]["lr"] == \
            straight.held_stages[0].optimizer.param_groups[0]["lr"]


def test_resuming_a_scheduled_run_without_its_scheduler_state_is_refused(tmp_path):
    plain = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=MICRO, partitioner="uniform",
                            engine="local", optimizer=sgd)
    plain.step(*data("mlp", 8))
    plain.save(tmp_path)
    scheduled = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=MICRO, partitioner="uniform",
                                engine="local", optimizer=sgd, lr_scheduler=warmup_cosine)
    with pytest.raises(pipetrain.CheckpointError, match="holds no learning-rate scheduler state.*weights="):
        scheduled.load(tmp_path)


def test_async_clips_each_update_by_the_global_norm_of_its_mini_batch():
    # SGD without momentum, lr 1: each stage moves by -coef * its gradient, coef the same on every stage, so the
    # whole update's norm is min(norm, max_norm) where norm is the mini-batch's global gradient norm.
    plain = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, partitioner="uniform",
                           engine="local", optimizer=plain, schedule="async-1f1b",
                           staleness="stash", max_grad_norm=0.05)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    results = []
    for result in pipe.train(batches("mlp", 1, draw_per_step=True)):
        results.append(result)
    after = pipe.state_dict()
    moved = math.sqrt(sum(float((after[k] - before[k]).pow(2).sum()) for k in before))
    assert results[0].grad_norm > 0.05
    assert moved == pytest.approx(0.05, rel=1e-4)


# ----- distributed: replicas and ZeRO shards agree on one norm ------------------------------------------

def hybrid_clipping(rank, world):
    out = {}
    for zero in (0, 1, 2):
        pipe = wrap_unprofiled(make("tied"), data("tied", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                               partitioner="uniform", loss_fn=loss_fn("tied"), optimizer=adamw,
                               max_grad_norm=0.5, lr_scheduler=warmup_cosine, zero=zero)
        norms = []
        for x, y in batches("tied", 3, draw_per_step=True):
            pipe.step(x, y)
            norms.append(pipe.last_result.grad_norm)
        out[zero] = (pipe.state_dict(), norms)
    # An async stream clipped by the inf-norm: its agreement carries no report and maximises the norm parts.
    pipe = _async_inf(engine="distributed")
    out["async"] = (pipe.state_dict(), [r.grad_norm for r in pipe.train(batches("tied", 3, draw_per_step=True))], pipe.state_dict())
    return out


def _async_inf(engine):
    return wrap_unprofiled(make("tied"), data("tied", 2)[0], stages=4, micro_batches=2, partitioner="uniform",
                           loss_fn=loss_fn("tied"), optimizer=sgd, schedule="async-1f1b",
                           staleness="stash", max_grad_norm=0.05, norm_type=math.inf, engine=engine)


@pytest.mark.slow
def test_replicas_and_zero_shards_clip_by_one_global_norm(tmp_path):
    per_rank = run_world(4, "test_clipping_and_schedules", "hybrid_clipping", tmp_path)
    model = make("tied")
    opt = adamw(model.parameters())
    sched = warmup_cosine(opt)
    expected = []
    for x, y in batches("tied", 3, draw_per_step=True):  # the global batch, 2 micro-batches per replica: 4 of 2 samples
        opt.zero_grad()
        for xb, yb in zip(x.tensor_split(4), y.tensor_split(4)):
            (loss_fn("tied")(model(xb), yb) * (len(xb) / len(x))).backward()
        expected.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        sched.step()
    local = _async_inf(engine="local")
    local_norms = [r.grad_norm for r in local.train(batches("tied", 3, draw_per_step=True))]
    assert all(per_rank[r]["async"][1] == local_norms for r in range(4)), (local_norms, per_rank[0]["async"][1])
    got = {k: v for r in range(4) for k, v in per_rank[r]["async"][2].items()}
    assert all(torch.equal(got[k], v) for k, v in local.state_dict().items())  # the engines agree bit for bit
    assert all(n > 0.05 for n in local_norms)  # every update was clipped
    for zero in (0, 1, 2):
        norms = [per_rank[r][zero][1] for r in range(4)]
        assert all(n == norms[0] for n in norms), norms  # every rank, every replica: the same bits
        torch.testing.assert_close(norms[0], expected, rtol=1e-5, atol=0)
        got = {k: v for r in range(4) for k, v in per_rank[r][zero][0].items()}
        for k, v in model.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-7, msg=f"zero={zero} {k}")

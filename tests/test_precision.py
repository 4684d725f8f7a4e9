"""Precision policies and the cross-rank dynamic loss scaler (4 gloo ranks = 2 stages x 2 replicas)."""


import pytest
import torch
import torch.distributed as dist

from dist_harness import run_checks, run_world
from pipetrain.runtime.precision import DynamicLossScaler, precision_policy

WORLD = 4
OVERFLOW_RANK, OVERFLOW_STEP = 3, 2


def _run_steps(rank, scaler, steps):
    """Fake training: grad = scale * (rank + 1), inf on one rank at OVERFLOW_STEP. Records per step."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    log = []
    for step in range(steps):
        scale_before = scaler.scale_value
        loss = scaler.scale(torch.tensor(float(rank + 1)))
        p.grad = torch.full((3,), float(loss))
        if rank == OVERFLOW_RANK and step == OVERFLOW_STEP:
            p.grad[1] = float("inf")
        before = p.detach().clone()
        found_inf = scaler.unscale_([p])
        unscaled = p.grad.clone()
        if not found_inf:
            opt.step()
        scaler.update(found_inf)
        opt.zero_grad()
        log.append(dict(found_inf=found_inf, scale_before=scale_before, scale_after=scaler.scale_value,
                        moved=not torch.equal(before, p.detach()), unscaled=unscaled))
    return log


def _check_agreement(rank, pipe, dp):
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, groups=[pipe, dp])
    log = _run_steps(rank, scaler, 7)
    for step, entry in enumerate(log):
        assert entry["found_inf"] == (step == OVERFLOW_STEP), (step, entry)
        assert entry["moved"] == (step != OVERFLOW_STEP)
        if step != OVERFLOW_STEP:  # unscaled in place: back to the true gradient
            torch.testing.assert_close(entry["unscaled"], torch.full((3,), float(rank + 1)))
    # scales by hand: 2 clean steps, overflow halves (and restarts the count), 3 clean steps double
    assert [e["scale_after"] for e in log] == [1024, 1024, 512, 512, 512, 1024, 1024]


def _check_default_group(rank):
    log = _run_steps(rank, DynamicLossScaler(init_scale=8.0, growth_interval=100), 3)
    assert [e["found_inf"] for e in log] == [False, False, True]
    assert log[-1]["scale_after"] == 4.0


def _check_one_group_is_not_enough(rank, pipe):
    """Only the pipeline group: the replica without the overflow disagrees (why groups matter)."""
    log = _run_steps(rank, DynamicLossScaler(init_scale=8.0, groups=[pipe]), 3)
    assert log[OVERFLOW_STEP]["found_inf"] == (rank in (2, 3))


def checks_on_rank(rank, world):
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # stages of replica 0 / replica 1
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # replicas of stage 0 / stage 1
    pipe, dp = pipes[rank // 2], dps[rank % 2]
    checks = {
        "agreement_pipe_and_dp_groups": lambda: _check_agreement(rank, pipe, dp),
        "agreement_default_group": lambda: _check_default_group(rank),
        "single_group_only_reaches_its_members": lambda: _check_one_group_is_not_enough(rank, pipe),
    }
    return run_checks(checks)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_world(WORLD, "test_precision", "checks_on_rank", tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize(
    "name", ["agreement_pipe_and_dp_groups", "agreement_default_group", "single_group_only_reaches_its_members"]
)
def test_distributed_check(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name, 'not run')}"


def test_local_scaler_step_and_state_dict():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    for g, stepped, scale in [([8.0, 4.0], True, 4.0), ([float("nan"), 0.0], False, 1.0), ([2.0, 2.0], True, 1.0),
                              ([1.0, 1.0], True, 3.0)]:
        p.grad = torch.tensor(g)
        assert scaler.step(opt) is stepped
        assert scaler.scale_value == scale
    # steps taken: -[2, 1] (scale 4), skip, -[2, 2] (scale 1), -[1, 1] (scale 1)
    torch.testing.assert_close(p.detach(), torch.tensor([-5.0, -4.0]))
    other = DynamicLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.state_dict() == scaler.state_dict() == {
        "scale": 3.0, "growth_factor": 3.0, "backoff_factor": 0.25, "growth_interval": 2, "good_steps": 0}
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_precision_policies():
    fp32, bf16, fp16 = (precision_policy(n) for n in ("fp32", "bf16", "fp16"))
    assert (fp32.autocast_dtype, fp32.activation_dtype, fp32.needs_loss_scaling) == (None, torch.float32, False)
    assert (bf16.autocast_dtype, bf16.activation_dtype, bf16.needs_loss_scaling) == (torch.bfloat16, torch.bfloat16, False)
    assert (fp16.autocast_dtype, fp16.activation_dtype, fp16.needs_loss_scaling) == (torch.float16, torch.float16, True)
    layer = torch.nn.Linear(3, 3)
    with bf16.autocast("cpu"):
        assert layer(torch.ones(1, 3)).dtype == torch.bfloat16
    with fp32.autocast("cpu"):
        assert layer(torch.ones(1, 3)).dtype == torch.float32
    with pytest.raises(ValueError, match="fp16"):
        precision_policy("fp8")


def test_fp16_with_async_is_refused_with_the_reason():
    import pipetrain
    from runtime_models import data, make

    with pytest.raises(ValueError, match="fp16 loss scaling needs every stage to agree on skipped steps"):
        pipetrain.wrap(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, schedule="async-1f1b",
                       staleness="stash", precision="fp16", partitioner="uniform", profile=False, engine="local")

"""Precision policies and the fp16 dynamic loss scaler. The cross-rank overflow decision is the
skip-or-step agreement's (test_hybrid: an overflow on one rank skips the same step everywhere)."""


import pytest
import torch

from pipetrain.runtime.precision import DynamicLossScaler, precision_policy
from helpers import wrap_unprofiled

OVERFLOW_STEP = 2


def _run_steps(scaler, steps):
    """Fake training the way OptimizerStep drives the scaler: grad = scale * 3, inf at OVERFLOW_STEP."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.5)
    log = []
    for step in range(steps):
        scale_before = scaler.scale_value
        p.grad = torch.full((3,), 3.0 * scaler.scale_value)
        if step == OVERFLOW_STEP:
            p.grad[1] = float("inf")
        before = p.detach().clone()
        found_inf = bool(scaler.unscale_local_([p]).item() > 0)
        unscaled = p.grad.clone()
        if not found_inf:
            opt.step()
        scaler.update(found_inf)
        opt.zero_grad()
        log.append(dict(found_inf=found_inf, scale_before=scale_before, scale_after=scaler.scale_value,
                        moved=not torch.equal(before, p.detach()), unscaled=unscaled))
    return log


def test_scaler_unscales_in_place_backs_off_and_grows():
    log = _run_steps(DynamicLossScaler(init_scale=2.0**10, growth_interval=3), 7)
    for step, entry in enumerate(log):
        assert entry["found_inf"] == (step == OVERFLOW_STEP), (step, entry)
        assert entry["moved"] == (step != OVERFLOW_STEP)
        if step != OVERFLOW_STEP:  # unscaled in place: back to the true gradient
            torch.testing.assert_close(entry["unscaled"], torch.full((3,), 3.0))
    # scales by hand: 2 clean steps, overflow halves (and restarts the count), 3 clean steps double
    assert [e["scale_after"] for e in log] == [1024, 1024, 512, 512, 512, 1024, 1024]


def test_unscale_flag_lives_on_the_requested_device():
    scaler = DynamicLossScaler(init_scale=8.0)
    p = torch.nn.Parameter(torch.ones(2))
    assert scaler.unscale_local_([p]).device.type == "cpu"  # no gradient: the flag still exists (0)
    p.grad = torch.full((2,), 16.0)
    flag = scaler.unscale_local_([p], torch.device("cpu"))
    assert flag.item() == 0 and torch.equal(p.grad, torch.full((2,), 2.0))


def test_local_scaler_step_and_state_dict():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = DynamicLossScaler(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2)
    for g, stepped, scale in [([8.0, 4.0], True, 4.0), ([float("nan"), 0.0], False, 1.0), ([2.0, 2.0], True, 1.0),
                              ([1.0, 1.0], True, 3.0)]:
        p.grad = torch.tensor(g)
        found_inf = bool(scaler.unscale_local_([p]).item() > 0)
        if not found_inf:
            opt.step()
        scaler.update(found_inf)
        assert (not found_inf) is stepped
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
    assert (fp32.autocast_dtype, bf16.autocast_dtype, fp16.autocast_dtype) == (None, torch.bfloat16, torch.float16)
    with pytest.raises(ValueError, match="fp16"):
        precision_policy("fp8")


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_stages_compute_under_the_policy_s_autocast(precision, dtype):
    import pipetrain
    from runtime_models import data, make

    x, y = data("mlp", 4)
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=2, micro_batches=2, precision=precision,
                           partitioner="uniform", engine="local")
    seen = []
    for rt in pipe.held_stages.values():
        for layer in rt.module.modules():
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    pipe.step(x, y)
    assert seen and set(seen) == {dtype}


def test_fp16_with_async_is_refused_with_the_reason():
    import pipetrain
    from runtime_models import data, make

    with pytest.raises(ValueError, match="fp16 loss scaling needs every stage to agree on skipped steps"):
        wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, schedule="async-1f1b",
                        staleness="stash", precision="fp16", partitioner="uniform", engine="local")


@pytest.mark.parametrize("stages", [2, 3])
def test_dtype_code_and_autocast_disabled_regions_train_like_the_unsplit_model(stages):
    # A model whose Python code reads dtypes and turns autocast off for a branch (captured by torch.export),
    # split across stages: the very calls of the unsplit model under the same autocast, so the same bits.
    import pipetrain
    from _partitioner_models import DtypeAware

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.manual_seed(0)
    reference = DtypeAware()
    torch.manual_seed(0)
    pipe = wrap_unprofiled(DtypeAware(), x[:2], stages=stages, micro_batches=2, precision="bf16",
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), partitioner="uniform",
                           engine="local")
    losses = [pipe.step(x, y) for _ in range(2)]
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for loss in losses:
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(x.tensor_split(2), y.tensor_split(2)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                part = torch.nn.functional.cross_entropy(reference(xi), yi) / 2
            part.backward()
            total += part.item()
        opt.step()
        assert loss == total
    state = pipe.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())

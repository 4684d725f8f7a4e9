"""LARS, LR schedules and smoothed update directions against hand computations."""

import math

import pytest
import torch

from pipetrain.optim.lr_schedules import linear_scaling_rule, linear_warmup, warmup_poly_decay
from pipetrain.optim import LARS, smoothed_update


def _norm(t):
    return math.sqrt(sum(float(x) ** 2 for x in t.flatten()))


def _lars_step_by_hand(w, g, buf, lr, m, wd, eta, eps, clip):
    """One LARS step written out element by element with python floats."""
    w_norm, g_norm = _norm(w), _norm(g)
    trust = eta * w_norm / (g_norm + wd * w_norm + eps)
    if clip:
        trust = min(trust / lr, 1.0)
    upd = [trust * (gi + wd * wi) for gi, wi in zip(g.flatten().tolist(), w.flatten().tolist())]
    new_buf = upd if buf is None else [m * b + u for b, u in zip(buf, upd)]
    new_w = [wi - lr * b for wi, b in zip(w.flatten().tolist(), new_buf)]
    return torch.tensor(new_w, dtype=torch.float64).view_as(w), new_buf


@pytest.mark.parametrize("clip", [False, True])
def test_lars_two_steps_match_hand_computation(clip):
    torch.manual_seed(0)
    w0 = torch.randn(3, 4, dtype=torch.float64)
    grads = [torch.randn(3, 4, dtype=torch.float64) * 0.1, torch.randn(3, 4, dtype=torch.float64)]
    lr, m, wd, eta, eps = 0.5, 0.9, 0.01, 0.02, 1e-8
    p = torch.nn.Parameter(w0.clone())
    opt = LARS([p], lr=lr, momentum=m, weight_decay=wd, trust_coefficient=eta, eps=eps, clip=clip)
    w, buf = w0.clone(), None
    for g in grads:
        p.grad = g.clone()
        opt.step()
        w, buf = _lars_step_by_hand(w, g, buf, lr, m, wd, eta, eps, clip)
        torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-12)
    assert torch.allclose(opt.state[p]["momentum_buffer"].flatten(), torch.tensor(buf, dtype=torch.float64))


def test_lars_clip_caps_local_rate_at_global_rate():
    # huge trust ratio (tiny gradient): clipped LARS degenerates to SGD with momentum
    w0 = torch.ones(2, 2)
    p, q = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    lars = LARS([p], lr=0.1, momentum=0.0, trust_coefficient=1.0, clip=True)
    sgd = torch.optim.SGD([q], lr=0.1)
    for opt, t in ((lars, p), (sgd, q)):
        t.grad = torch.full((2, 2), 1e-3)
        opt.step()
    torch.testing.assert_close(p, q)
    unclipped = torch.nn.Parameter(w0.clone())
    unclipped.grad = torch.full((2, 2), 1e-3)
    LARS([unclipped], lr=0.1, momentum=0.0, trust_coefficient=1.0).step()
    assert (w0 - unclipped).abs().max() > 10 * (w0 - p).abs().max()


def test_excluded_params_get_plain_momentum_sgd():
    # exclude_1d: MLPerf's variant (biases and normalisation scales at the global rate, no decay); lars_exclude groups
    torch.manual_seed(1)
    bias, weight, other = torch.randn(5), torch.randn(5, 3), torch.randn(4, 2)
    lars_bias, lars_other = torch.nn.Parameter(bias.clone()), torch.nn.Parameter(other.clone())
    lars_weight = torch.nn.Parameter(weight.clone())
    ref_bias, ref_other = torch.nn.Parameter(bias.clone()), torch.nn.Parameter(other.clone())
    lars = LARS(
        [{"params": [lars_bias, lars_weight]}, {"params": [lars_other], "lars_exclude": True, "weight_decay": 0.05}],
        lr=0.1, momentum=0.9, weight_decay=0.01, exclude_1d=True,
    )
    sgd = torch.optim.SGD(
        [{"params": [ref_bias], "weight_decay": 0.0}, {"params": [ref_other], "weight_decay": 0.05}],
        lr=0.1, momentum=0.9,
    )
    for _ in range(3):
        g_b, g_o, g_w = torch.randn(5), torch.randn(4, 2), torch.randn(5, 3)
        lars_bias.grad, ref_bias.grad = g_b.clone(), g_b.clone()
        lars_other.grad, ref_other.grad = g_o.clone(), g_o.clone()
        lars_weight.grad = g_w
        lars.step()
        sgd.step()
    torch.testing.assert_close(lars_bias, ref_bias)
    torch.testing.assert_close(lars_other, ref_other)
    # the 2-D weight of the same group is adapted, so it must differ from plain SGD
    assert not torch.allclose(lars_weight, weight)
    kept = torch.nn.Parameter(bias.clone())
    kept.grad = torch.ones(5)
    LARS([kept], lr=0.1, momentum=0.0, weight_decay=0.01, trust_coefficient=0.5).step()  # by default, adapted too
    trust = 0.5 * _norm(bias) / (_norm(torch.ones(5)) + 0.01 * _norm(bias) + 1e-8)
    torch.testing.assert_close(kept.detach(), bias - 0.1 * trust * (torch.ones(5) + 0.01 * bias))


def test_zero_weight_tensor_moves_like_sgd():
    p = torch.nn.Parameter(torch.zeros(3, 3))
    p.grad = torch.ones(3, 3)
    LARS([p], lr=0.1, momentum=0.9).step()
    torch.testing.assert_close(p.detach(), torch.full((3, 3), -0.1))


def test_schedules_by_hand():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = warmup_poly_decay(opt, warmup_steps=4, total_steps=10, power=2, start_factor=0.25)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    warm = [2.0 * (0.25 + 0.75 * s / 4) for s in range(4)]
    decay = [2.0 * (1 - s / 6) ** 2 for s in range(6)]
    expected = warm + decay + [0.0, 0.0]
    assert seen == pytest.approx(expected)
    opt2 = torch.optim.SGD([p], lr=1.0)
    w = linear_warmup(opt2, warmup_steps=3)
    lrs = []
    for _ in range(5):
        lrs.append(opt2.param_groups[0]["lr"])
        opt2.step()
        w.step()
    assert lrs == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0, 1.0])
    assert linear_scaling_rule(0.1, 8192) == pytest.approx(3.2)
    assert linear_scaling_rule(0.1, 64, base_batch_size=32) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="total_steps"):
        warmup_poly_decay(opt, warmup_steps=5, total_steps=5)


def _run(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("kwargs", [{}, {"dampening": 0.5}, {"nesterov": True}, {"weight_decay": 0.1}])
def test_smoothed_update_sgd_momentum(kwargs):
    torch.manual_seed(2)
    grads = [torch.randn(3) for _ in range(3)]
    w = torch.randn(3)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.8, **kwargs)
    assert smoothed_update(opt, p) is None
    _run(opt, p, grads)
    # hand: buf_1 = d_1, buf_t = m buf + (1 - damp) d_t with d_t = g_t + wd * w_{t-1}
    damp, wd, nesterov = kwargs.get("dampening", 0.0), kwargs.get("weight_decay", 0.0), kwargs.get("nesterov", False)
    buf, ww = None, w.clone()
    for g in grads:
        d = g + wd * ww
        buf = d.clone() if buf is None else 0.8 * buf + (1 - damp) * d
        ww = ww - 0.1 * ((d + 0.8 * buf) if nesterov else buf)
    torch.testing.assert_close(p.detach(), ww)
    torch.testing.assert_close(smoothed_update(opt, p), buf)


@pytest.mark.parametrize("cls,kwargs", [
    (torch.optim.Adam, {}),
    (torch.optim.Adam, {"weight_decay": 0.1}),
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.Adam, {"amsgrad": True}),
])
def test_smoothed_update_adam(cls, kwargs):
    torch.manual_seed(3)
    grads = [torch.randn(4) for _ in range(3)]
    w = torch.randn(4)
    p = torch.nn.Parameter(w.clone())
    opt = cls([p], lr=0.01, betas=(0.8, 0.9), eps=1e-6, **kwargs)
    _run(opt, p, grads)
    wd = kwargs.get("weight_decay", 0.0)
    decoupled = cls is torch.optim.AdamW
    m = v = vmax = torch.zeros(4)
    ww = w.clone()
    for t, g in enumerate(grads, start=1):
        if wd and not decoupled:
            g = g + wd * ww
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        vmax = torch.maximum(vmax, v)
        second = vmax if kwargs.get("amsgrad") else v
        direction = (m / (1 - 0.8**t)) / ((second / (1 - 0.9**t)).sqrt() + 1e-6)
        if decoupled:
            direction = direction + wd * ww
        ww = ww - 0.01 * direction
    torch.testing.assert_close(p.detach(), ww)
    expected = (m / (1 - 0.8**3)) / ((second / (1 - 0.9**3)).sqrt() + 1e-6)
    if decoupled:
        expected = expected + wd * p.detach()
    torch.testing.assert_close(smoothed_update(opt, p), expected)


def test_smoothed_update_lars_is_next_step_direction():
    torch.manual_seed(4)
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = LARS([p], lr=0.1, momentum=0.9, trust_coefficient=0.01)
    _run(opt, p, [torch.randn(4, 4), torch.randn(4, 4)])
    v = smoothed_update(opt, p)
    assert v is opt.state[p]["momentum_buffer"] and v is opt.smoothed_update(p)
    # with a zero next gradient the next update is exactly lr * momentum * v
    before = p.detach().clone()
    expected = before - 0.1 * 0.9 * v
    p.grad = torch.zeros(4, 4)
    opt.step()
    torch.testing.assert_close(p.detach(), expected)


def test_smoothed_update_errors_name_the_fix():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="momentum > 0.*LARS"):
        smoothed_update(torch.optim.SGD([p], lr=0.1), p)
    with pytest.raises(TypeError, match="RMSprop.*stash"):
        smoothed_update(torch.optim.RMSprop([p], lr=0.1), p)
    with pytest.raises(ValueError, match="not managed"):
        smoothed_update(torch.optim.SGD([p], lr=0.1, momentum=0.9), torch.nn.Parameter(torch.zeros(2)))

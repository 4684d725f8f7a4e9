"""A step that raises leaves no trace: the next steps equal, bit for bit, a run that never saw that batch.

The reference is a second pipeline built the same way that trains on the good batches only; both run the
same code on the same inputs, so parameters, buffers (batch-norm statistics) and optimizer state must be
identical, not merely close.
"""
from __future__ import annotations

import signal
import threading

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain import NonFiniteError
from runtime_models import ConvBN
from helpers import wrap_unprofiled

SCHEDULES = [("1f1b", {}), ("gpipe", {"recompute": "always"}), ("zb-h1", {}),
             ("interleaved-1f1b", {"stages": 2, "chunks": 2})]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return ConvBN()


def _batches() -> tuple[list, tuple]:
    g = torch.Generator().manual_seed(1)
    good = [(torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    y[-1] = 9  # a label out of range in the last micro-batch: the loss raises after earlier backwards ran
    return good, (x, y)


def _wrap(schedule: str, extra: dict, **options) -> pipetrain.Pipeline:
    kw = dict(stages=3, micro_batches=4, schedule=schedule, partitioner="uniform", engine="local",
              optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))
    kw.update(extra)
    kw.update(options)
    return wrap_unprofiled(_model(), _batches()[0][0][0][:2], **kw)


def _assert_identical(a: pipetrain.Pipeline, b: pipetrain.Pipeline) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert a.updates == b.updates and a.skipped_steps == b.skipped_steps
    for held in (a.held_stages, b.held_stages):
        for stage in held.values():
            assert all(p.grad is None for p in stage.module.parameters())
            assert not stage.in_flight and not stage.weight_pending


def _good_steps_are_identical(failed: pipetrain.Pipeline, reference: pipetrain.Pipeline, good: list) -> None:
    """Both pipelines step on the good batches; afterwards they must hold the same bits."""
    for x, y in good:
        failed.step(x, y)
        reference.step(x, y)
    _assert_identical(failed, reference)


def _optimizer_states(pipe: pipetrain.Pipeline) -> list:
    return [[v for state in s.optimizer.state.values() for v in state.values()] for s in pipe.held_stages.values()]


@pytest.mark.parametrize("schedule,extra", SCHEDULES)
def test_a_failing_loss_leaves_no_trace(schedule, extra):
    good, bad = _batches()
    failed, reference = _wrap(schedule, extra), _wrap(schedule, extra)
    failed.step(*good[0])
    with pytest.raises(IndexError):
        failed.step(*bad)
    failed.step(*good[1])
    for x, y in good:
        reference.step(x, y)
    _assert_identical(failed, reference)
    for ours, theirs in zip(_optimizer_states(failed), _optimizer_states(reference)):
        assert all(torch.equal(u, v) for u, v in zip(ours, theirs))


def test_bad_data_in_the_first_stage_and_a_non_finite_loss_leave_no_trace():
    good, _ = _batches()
    failed, reference = _wrap("1f1b", {}), _wrap("1f1b", {})
    with pytest.raises(RuntimeError):
        failed.step(torch.randn(8, 5, 6, 6), good[0][1])  # 5 channels where the model takes 3
    nan = good[0][0].clone()
    nan[6] = float("nan")  # micro-batch 3 of 4
    with pytest.raises(NonFiniteError):
        failed.step(nan, good[0][1])
    _good_steps_are_identical(failed, reference, good)


def test_fp16_loss_scale_is_untouched_by_a_failed_step():
    good, bad = _batches()
    failed, reference = _wrap("1f1b", {}, precision="fp16"), _wrap("1f1b", {}, precision="fp16")
    failed.step(*good[0])
    reference.step(*good[0])
    scale = failed.loss_scale
    with pytest.raises(IndexError):
        failed.step(*bad)
    assert failed.loss_scale == scale
    failed.step(*good[1])
    reference.step(*good[1])
    _assert_identical(failed, reference)


ARMED = {"calls": None}  # forwards of ConvBN.c2 left before Ctrl-C; None: not armed


def _ctrl_c_hook(module, inputs, output):
    """Raises KeyboardInterrupt in the armed forward (the stage modules hold copies of the hook)."""
    if ARMED["calls"] is not None:
        ARMED["calls"] -= 1
        if ARMED["calls"] == 0:
            ARMED["calls"] = None
            raise KeyboardInterrupt


def test_ctrl_c_before_any_update_abandons_the_step():
    good, _ = _batches()

    def model():
        m = _model()
        m.c2.register_forward_hook(_ctrl_c_hook)
        return m
    kw = dict(stages=3, micro_batches=4, partitioner="uniform", engine="local")
    failed, reference = (wrap_unprofiled(model(), good[0][0][:2], **kw) for _ in range(2))
    ARMED["calls"] = 3  # the third forward of the stage holding c2, with earlier micro-batches in flight
    with pytest.raises(KeyboardInterrupt):
        failed.step(*good[0])
    assert ARMED["calls"] is None
    _good_steps_are_identical(failed, reference, good)


def test_ctrl_c_once_a_stage_applied_its_update_finishes_the_step_then_raises():
    assert threading.current_thread() is threading.main_thread()  # only the main thread takes signals
    # Python's own Ctrl-C handler, as in a user's script: a test run earlier in this worker process (or the
    # worker itself) may have left SIGINT ignored or at the system default, which pipetrain leaves alone.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_after_the_last_stage_applied_its_update()
    finally:
        signal.signal(signal.SIGINT, previous)


def _ctrl_c_after_the_last_stage_applied_its_update() -> None:
    good, _ = _batches()
    interrupted, reference = _wrap("1f1b", {}), _wrap("1f1b", {})
    last = max(interrupted.held_stages.items())[1].optimizer
    step = last.step

    def step_then_ctrl_c(*args, **kwargs):
        out = step(*args, **kwargs)
        last.step = step
        # Ctrl-C after the last stage applied its update, before stage 0: the handler in force is called as the
        # interpreter calls it when SIGINT lands here; raising a real signal would test when it lands.
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return out
    last.step = step_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        interrupted.step(*good[0])
    assert interrupted.updates == 1
    reference.step(*good[0])
    _assert_identical(interrupted, reference)


def test_a_stream_that_raises_or_is_left_drops_its_micro_batches_in_flight():
    good, bad = _batches()
    pipe = _wrap("async-1f1b", {}, staleness="stash")
    with pytest.raises(IndexError):
        for _ in pipe.train([good[0], bad, good[1]]):
            pass
    for stage in pipe.held_stages.values():
        assert not stage.in_flight and all(p.grad is None for p in stage.module.parameters())
        assert len(stage.policy.versions) == 0
    results = pipe.train([good[0], good[1], good[0]])
    next(results)
    results.close()  # the caller stops iterating with micro-batches still in flight
    for stage in pipe.held_stages.values():
        assert not stage.in_flight and all(p.grad is None for p in stage.module.parameters())
    assert all(r.loss > 0 for r in pipe.train(good))

"""The example scripts (local engine) and the shared training loop: loss goes down, validation,
TensorBoard scalars, and resuming equals not stopping."""
from __future__ import annotations

import pytest
import torch

import pipetrain

from _example_runs import CASES, COMMON, decreased, run_example, scalars
from pipetrain.apps.training import RunConfig, evaluate, optimizer_factory, run

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_trains_locally(name, tmp_path, capsys):
    run_example(name, [*COMMON, *CASES[name], "--logdir", str(tmp_path)])
    losses = scalars(tmp_path, "train/loss")
    assert len(losses) == 2 * (192 // 16)
    assert decreased(losses), losses
    assert len(scalars(tmp_path, "val/accuracy")) == 2
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "2 epochs (24 steps)" in summary and "max val accuracy" in summary


def tiny(**kw) -> RunConfig:
    base = dict(model="vgg", width=4, stages=2, micro_batches=1, schedule="async-1f1b", staleness="stash",
                partitioner="params", train_samples=96, val_samples=40, batch_size=16, epochs=2, lr=0.05,
                progress=False, engine="local")
    base.update(kw)
    return RunConfig(**base)


def test_resume_continues_the_same_data_order(tmp_path):
    whole = run(tiny(checkpoint_dir=str(tmp_path / "whole")))
    first = run(tiny(epochs=1, checkpoint_dir=str(tmp_path / "split")))
    resumed = run(tiny(checkpoint_dir=str(tmp_path / "split"), resume="auto"))
    assert first.step_losses == whole.step_losses[:6]
    assert [e.epoch for e in resumed.epochs] == [2]
    assert resumed.step_losses == whole.step_losses[6:]  # bit-identical, as README promises
    assert (resumed.epochs[0].val_loss, resumed.epochs[0].val_accuracy) == (whole.epochs[1].val_loss,
                                                                            whole.epochs[1].val_accuracy)
    assert_same_parameters(tmp_path / "whole", tmp_path / "split")


def assert_same_parameters(a, b):
    """The newest checkpoints under ``a`` and ``b`` hold bit-identical tensors."""
    first, second = pipetrain.export_state_dict(a), pipetrain.export_state_dict(b)
    assert set(first) == set(second)
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


def snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_over_a_damaged_checkpoint_stops_instead_of_starting_over(tmp_path):
    run(tiny(epochs=1, checkpoint_dir=str(tmp_path)))
    (tmp_path / "step-00000006" / "manifest.json").unlink()
    before = snapshot(tmp_path)
    with pytest.raises(pipetrain.CheckpointError, match="step-00000006.*manifest.json does not exist"):
        run(tiny(checkpoint_dir=str(tmp_path), resume="auto"))
    assert snapshot(tmp_path) == before


def test_a_rerun_without_resume_refuses_to_save_below_the_earlier_run(tmp_path):
    run(tiny(checkpoint_dir=str(tmp_path)))  # steps 6 and 12
    before = snapshot(tmp_path)
    with pytest.raises(pipetrain.CheckpointError, match="--resume auto"):
        run(tiny(checkpoint_dir=str(tmp_path)))  # the same command again: its step 6 is below 12
    assert snapshot(tmp_path) == before


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="checkpoint-dir"):
        run(tiny(resume="auto"))


class _Fixed:
    """A stand-in pipeline whose predictions are given logits."""

    def __init__(self, logits):
        self.logits = logits

    def predict(self, x):
        return self.logits[x]


def test_evaluate_against_hand_computation():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 0.5], [1.0, 0.0]])
    y = torch.tensor([0, 0, 0, 1, 1])
    data = torch.utils.data.TensorDataset(torch.arange(5), y)
    loss, acc = evaluate(_Fixed(logits), data, batch_size=2)  # two full batches and a tail of one
    expected = torch.nn.functional.cross_entropy(logits, y).item()
    assert loss == pytest.approx(expected)
    assert acc == pytest.approx(3 / 5)


def test_missing_cifar_exits_with_the_path_and_the_download_flag(tmp_path):
    from pipetrain.apps.training import example_main

    with pytest.raises(SystemExit) as info:
        example_main(["vgg"], "vgg", ["--dataset", "cifar10", "--data-dir", str(tmp_path), "--no-progress"])
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py") in message and "--download" in message


def test_adam_option_trains_with_adam_and_its_default_rate():
    assert RunConfig(optimizer="adam").resolved().lr == 1e-3  # the families' tuned rates are SGD's
    assert RunConfig(optimizer="adam", lr=0.01).resolved().lr == 0.01
    assert RunConfig().resolved().lr == 0.05  # vgg's SGD rate
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; choose one of sgd, adam"):
        RunConfig(optimizer="rmsprop").resolved()
    opt = optimizer_factory("adam", 0.002, 0.9)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 0.002
    # SpecTrain predicts with Adam's smoothed update: an async run trains end to end
    summary = run(tiny(optimizer="adam", lr=None, staleness="spectrain", epochs=1))
    assert summary.steps == 6 and all(torch.isfinite(torch.tensor(summary.step_losses)))


"""The example scripts (local engine) and the shared training loop: loss goes down, validation,
TensorBoard scalars, and resuming equals not stopping."""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipetrain
import pipetrain.runner  # the tests patch Runner._finish to watch each step

from _example_runs import CASES, COMMON, decreased, run_example, scalars
from pipetrain.apps.run_config import RunConfig, add_arguments, config_from_args, optimizer_factory
from pipetrain.apps.training import evaluate, run

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
    with pytest.raises(pipetrain.CheckpointError, match="--resume"):
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
    with pytest.raises(SystemExit) as info:
        run_example("vgg", ["--dataset", "cifar10", "--data-dir", str(tmp_path)])
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py") in message and "--download" in message


def test_adam_option_trains_with_adam_and_its_default_rate():
    assert RunConfig(optimizer="adam").resolved().lr == 1e-3  # the families' tuned rates are SGD's
    assert RunConfig(optimizer="adam", lr=0.01).resolved().lr == 0.01
    assert RunConfig().resolved().lr == 0.05  # vgg's SGD rate
    assert RunConfig(optimizer="nag").resolved().lr == 0.05  # Nesterov momentum takes the SGD rate
    with pytest.raises(ValueError, match="unknown optimizer 'rmsprop'; choose one of sgd, nag, adam, nadam"):
        RunConfig(optimizer="rmsprop").resolved()
    opt = optimizer_factory("adam", 0.002, 0.9)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 0.002
    nag = optimizer_factory("nag", 0.1, 0.9)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(nag, torch.optim.SGD) and nag.param_groups[0]["nesterov"]
    assert RunConfig(optimizer="nadam").resolved().lr == 1e-3  # NAdam is adaptive: Adam's rate
    nadam = optimizer_factory("nadam", 0.002, 0.9)([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(nadam, torch.optim.NAdam) and nadam.param_groups[0]["lr"] == 0.002
    # SpecTrain predicts with Adam's smoothed update: an async run trains end to end
    summary = run(tiny(optimizer="adam", lr=None, staleness="spectrain", epochs=1))
    assert summary.steps == 6 and all(torch.isfinite(torch.tensor(summary.step_losses)))


def test_nadam_steps_with_nesterov_momentum_at_adams_beta1_from_the_first_step():
    # Dozat's NAdam with a constant mu = beta1, by hand in float64 over four steps of fixed gradients:
    # m and v as Adam's; the step is lr * (beta1 m_t / (1 - beta1^(t+1)) + (1 - beta1) g / (1 - beta1^t))
    # / (sqrt(v_t / (1 - beta2^t)) + eps).
    lr, beta1, beta2, eps = 0.002, 0.9, 0.999, 1e-8
    grads = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25], [2.0, 1.0]], dtype=torch.float64)
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = optimizer_factory("nadam", lr, beta1)([param])
    expected, m, v = (torch.zeros(2, dtype=torch.float64) for _ in range(3))
    for t, g in enumerate(grads, start=1):
        param.grad = g.clone()
        opt.step()
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        denom = (v / (1 - beta2 ** t)).sqrt() + eps
        expected -= lr * (beta1 * m / (1 - beta1 ** (t + 1)) + (1 - beta1) * g / (1 - beta1 ** t)) / denom
        # torch keeps the step count as a float32 tensor and computes mu and its products from it in float32, so
        # the step's coefficients carry float32 rounding (~6e-8 each, a few per step, four steps): rtol 1e-6. The
        # default schedule (momentum_decay 4e-3) ends 28% away here.
        torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=0)


def test_muon_option_steps_matrices_with_muon_and_the_rest_with_adamw_at_a_share_of_one_rate():
    assert RunConfig(optimizer="muon").resolved().lr == 0.02  # Keller Jordan's and torch's examples
    made = optimizer_factory("muon", 0.04, 0.9)([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2))])
    (muon,), (adamw,) = [o.param_groups for o in made.optimizers]
    assert isinstance(made.optimizers[0], torch.optim.Muon) and isinstance(made.optimizers[1], torch.optim.AdamW)
    assert (muon["lr"], adamw["lr"], muon["nesterov"]) == (0.04, 0.04 * 0.05, True)
    # staleness="nesterov" makes the look-ahead itself: the run's Muon has its own off, and trains
    config = tiny(optimizer="muon", lr=None, staleness="nesterov", epochs=1)
    assert config.resolved().wrap_options()["optimizer"]([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0][
        "nesterov"] is False
    summary = run(config)
    assert summary.steps == 6 and all(torch.isfinite(torch.tensor(summary.step_losses)))


def test_the_run_times_every_stages_optimizer_step_and_each_epochs_training():
    sync = run(tiny(schedule="1f1b", staleness="none", micro_batches=2, epochs=1))
    recipe = run(tiny(epochs=1))
    for summary in (sync, recipe):  # 96 samples in mini-batches of 16: 6 updates, each stepping both stages
        assert summary.steps == 6 and summary.optimizer_steps == 2 * 6
        assert 0 < summary.optimizer_seconds < summary.train_seconds
        assert summary.epochs[0].train_seconds == summary.train_seconds


# ----- command-line flags: declared once on RunConfig, they reach the config and wrap() -----

def other_value(action: argparse.Action):
    """A value of ``action``'s flag that is not its default, as the parser stores it."""
    if action.nargs == 0:  # store_true, store_false, store_const (--resume): the constant the flag stores
        return action.const
    if action.choices:
        return [c for c in action.choices if c != action.default][-1]
    if action.type in (int, float):
        return action.type((action.default or 0) + 3)
    return f"{action.dest}-value"


def test_every_flag_reaches_the_config_and_every_wrap_option_reaches_wrap():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ["vgg", "resnet"])
    argv, given = [], {}
    for action in parser._actions:
        if action.dest == "help":
            continue
        given[action.dest] = other_value(action)
        argv += [action.option_strings[0]] + ([] if action.nargs == 0 else [str(given[action.dest])])
    config = config_from_args(parser.parse_args(argv))
    defaults = RunConfig()
    assert all(given[name] != getattr(defaults, name) for name in given), given  # every flag really changes
    assert {name: getattr(config, name) for name in given} == given
    wrapped = {f.metadata["wrap"]: f.name for f in dataclasses.fields(RunConfig) if f.metadata["wrap"]}
    assert set(wrapped) - {"engine"} <= set(given)  # engine alone has no flag: torchrun decides it
    options = config.wrap_options(updates=10)  # --lr-schedule spreads over the run's updates
    assert {option: options[option] for option in wrapped if option != "engine"} == {
        option: given[name] for option, name in wrapped.items() if name != "engine"}
    assert set(options) == {"stages", "micro_batches", "schedule", "staleness", "partitioner", "loss_fn",
                            "precision", "data_parallel", "engine", "logdir", "seed", "lookahead", "profile",
                            "optimizer", "lr_scheduler", "spectrain_variant", "spike_compensation", "dc_lambda",
                            "stage_lr_warmup", "stage_momentum", "error_feedback"}
    assert set(options) <= {f.name for f in dataclasses.fields(pipetrain.PipelineOptions)}
    assert options["engine"] == "auto" and options["profile"] is False  # the uniform partitioner times nothing
    assert options["optimizer"]([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]["lr"] == given["lr"]


def test_every_pipeline_option_of_run_config_has_the_default_of_pipeline_options():
    library = {f.name: f.default for f in dataclasses.fields(pipetrain.PipelineOptions)}
    # RunConfig.optimizer is not wrap's factory but the name of one (sgd, adam, ...): wrap_options builds it.
    shared = {f.name: f for f in dataclasses.fields(RunConfig) if f.name in library and f.name != "optimizer"}
    assert set(shared) == {"stages", "micro_batches", "schedule", "staleness", "partitioner", "precision",
                           "data_parallel", "engine", "logdir", "seed", "lookahead", "profile", "spectrain_variant",
                           "spike_compensation", "dc_lambda", "stage_lr_warmup", "stage_momentum",
                           "error_feedback"}
    assert {name: f.default for name, f in shared.items()} == {name: library[name] for name in shared}
    assert RunConfig().micro_batches == pipetrain.PipelineOptions().micro_batches == 8
    # What reaches wrap under an option's name is the field of that name.
    assert {f.metadata["wrap"] for f in dataclasses.fields(RunConfig) if f.metadata["wrap"]} == set(shared) - {"profile"}
    assert all(f.metadata["wrap"] in (None, f.name) for f in dataclasses.fields(RunConfig))


def test_staleness_defaults_to_the_schedules_policy_and_compare_has_no_schedule_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ["vgg"])
    assert config_from_args(parser.parse_args(["--schedule", "async-1f1b"])).staleness == "spectrain"
    assert config_from_args(parser.parse_args(["--schedule", "gpipe"])).staleness == "none"
    no_schedule = argparse.ArgumentParser()
    add_arguments(no_schedule, ["vgg"], pipeline=False)
    config = config_from_args(no_schedule.parse_args(["--stages", "2"]))
    assert (config.stages, config.schedule, config.staleness, config.lookahead, config.resume) == (
        2, "1f1b", "none", 1.0, "never")
    flags = {option for action in no_schedule._actions for option in action.option_strings}
    assert flags.isdisjoint({"--schedule", "--staleness", "--lookahead", "--data-parallel", "--checkpoint-dir",
                             "--resume"}) and "--micro-batches" in flags


# ----- preemption: SIGTERM saves at the next mini-batch and the resume is exact -----

HERE = Path(__file__).parent


def worker_env() -> dict:
    paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), OMP_NUM_THREADS="1")


def sigterm_after_step(cmd: list[str], step: int) -> tuple[int, str]:
    """Start ``cmd``, send it SIGTERM once it printed "step <step>", and return (exit status, output)."""
    proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.strip().endswith(f"step {step}"):
                proc.send_signal(signal.SIGTERM)
                break
        lines += proc.stdout.readlines()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    return proc.returncode, "".join(lines)


def saved_step(root: Path) -> int:
    return int((root / "latest").read_text().strip().split("-")[1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "async-1f1b"])
def test_sigterm_saves_mid_epoch_and_the_resume_is_exact(tmp_path, schedule):
    from preempt_worker import PAUSE_AT, config

    root = tmp_path / "ckpt"
    status, output = sigterm_after_step([sys.executable, str(HERE / "preempt_worker.py"), str(root),
                                         str(tmp_path / "stopped"), schedule, "local"], PAUSE_AT)
    assert status == 0, output
    stopped = torch.load(tmp_path / "stopped.rank0")
    step = saved_step(root)
    assert stopped["preempted"] and len(stopped["losses"]) == step and "stopped by SIGTERM" in output
    assert 6 < step < 12  # inside the second epoch: the resume must start at the right mini-batch of it
    resumed = run(config(schedule, "local", checkpoint_dir=str(root), resume="auto"))
    assert not resumed.preempted and [e.epoch for e in resumed.epochs] == [2, 3]
    whole = run(config(schedule, "local", checkpoint_dir=str(tmp_path / "whole")))
    if schedule == "1f1b":
        assert step == PAUSE_AT  # the mini-batch in flight when the signal came was the last one
        assert stopped["losses"] + resumed.step_losses == whole.step_losses
        assert_same_parameters(root, tmp_path / "whole")
    else:
        # async-1f1b drained the mini-batches it had taken; up to there it is the uninterrupted run, after it
        # it differs by that one extra drain (see README), so only the prefix can be compared bit for bit.
        assert step >= PAUSE_AT and stopped["losses"] == whole.step_losses[:step]
        assert len(resumed.step_losses) == 18 - step


def test_request_stop_is_reported_from_the_next_step_on():
    from runtime_models import data, make, sgd

    pipe = pipetrain.wrap(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, optimizer=sgd,
                          partitioner="uniform", profile=False, engine="local")
    x, y = data("mlp", 8)
    assert [r.stop_requested for r in pipe.train([(x, y)])] == [False]
    pipe.request_stop()
    assert [r.stop_requested for r in pipe.train([(x, y), (x, y)])] == [True, True]


def test_sigterm_handler_only_with_a_checkpoint_dir_and_restored_after(tmp_path, monkeypatch):
    seen = []
    real_finish = pipetrain.runner.Runner._finish

    def finish(self, result):
        seen.append(signal.getsignal(signal.SIGTERM))
        return real_finish(self, result)

    monkeypatch.setattr(pipetrain.runner.Runner, "_finish", finish)
    before = signal.getsignal(signal.SIGTERM)
    run(tiny(epochs=1, schedule="1f1b", staleness="none"))
    assert set(seen) == {before}  # without a checkpoint directory SIGTERM keeps its meaning
    seen.clear()
    run(tiny(epochs=1, checkpoint_dir=str(tmp_path)))
    assert len(seen) == 6 and all(h is not before for h in seen)
    assert signal.getsignal(signal.SIGTERM) is before


COLLECTIVES = ("all_reduce", "gather", "broadcast", "all_gather", "reduce_scatter", "reduce", "scatter")


def count_collectives(call) -> int:
    """How many collectives of torch.distributed ``call()`` starts (each still runs for real)."""
    import torch.distributed as dist

    started = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, original in originals.items():
        setattr(dist, name, lambda *a, _original=original, **k: started.append(1) or _original(*a, **k))
    try:
        call()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return len(started)


def sigterm_on_rank0_only(rank, world, root):
    """Both schedules on the distributed engine; only rank 0 gets SIGTERM (after step 8). First, the
    collectives of a 2-epoch run with and without a checkpoint directory (no signal)."""
    from preempt_worker import PAUSE_AT, config

    collectives = [count_collectives(lambda: run(config("1f1b", "distributed", epochs=2, **kw)))
                   for kw in ({}, {"checkpoint_dir": f"{root}/counted"})]
    real_finish = pipetrain.runner.Runner._finish

    def finish(self, result):
        result = real_finish(self, result)
        if rank == 0 and result.step == PAUSE_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    pipetrain.runner.Runner._finish = finish
    out = {}
    for schedule in ("1f1b", "async-1f1b"):
        summary = run(config(schedule, "distributed", checkpoint_dir=f"{root}/{schedule}"))
        out[schedule] = (summary.preempted, summary.step_losses)
    out["collectives"] = collectives
    return out


@pytest.mark.slow
def test_ranks_agree_on_where_to_stop_when_only_one_got_sigterm(tmp_path):
    from dist_harness import run_world
    from preempt_worker import PAUSE_AT

    per_rank = run_world(2, "test_training", "sigterm_on_rank0_only", tmp_path / "ranks", str(tmp_path))
    # The stop request rides in the step report every rank already exchanges: watching for SIGTERM adds
    # no collective per mini-batch, only one vote at the epoch boundary (a signal during validation or the save).
    for rank in range(2):
        without, watching = per_rank[rank]["collectives"]
        assert watching == without + 1, (rank, without, watching)
    for schedule in ("1f1b", "async-1f1b"):
        step = saved_step(tmp_path / schedule)
        assert per_rank[0][schedule] == per_rank[1][schedule]  # same stop, same reported losses
        assert per_rank[0][schedule][0] and len(per_rank[0][schedule][1]) == step
        # Rank 0 signalled itself after step 8's report: the request rides in step 9's, and both stop there.
        # Distributed async-1f1b stops at the epoch's end.
        assert step == (PAUSE_AT + 1 if schedule == "1f1b" else 12)

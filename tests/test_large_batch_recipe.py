"""The large-batch recipe from the command line (Jia et al. 2018): --optimizer lars / lamb at the global rate,
--lr-schedule warmup-poly with --warmup and --poly-power, checkpointed, and `pipetrain compare`'s +bs=N at the
rate each optimizer's scaling rule gives."""

import copy
import math

import pytest
import torch

import pipetrain
from _example_runs import run_example
from pipetrain.apps.compare import lr_scale, method_config, warmup_updates
from pipetrain.apps.run_config import RunConfig, optimizer_factory
from pipetrain.optim import LAMB, LARS, warmup_cosine_decay, warmup_poly_decay


def made(name: str, lr: float) -> torch.optim.Optimizer:
    return optimizer_factory(name, lr, 0.9)([torch.nn.Parameter(torch.zeros(2, 2))])


def test_lars_and_lamb_take_the_papers_settings_and_lr_is_the_global_rate():
    lars, lamb = made("lars", 3.0), made("lamb", 0.002)
    assert isinstance(lars, LARS) and isinstance(lamb, LAMB)
    # every tensor adapted, biases too (You et al.'s layer-wise rule; MLPerf's exclusion needs normalised networks)
    assert {k: lars.defaults[k] for k in ("lr", "momentum", "trust_coefficient", "weight_decay", "exclude_1d")} == {
        "lr": 3.0, "momentum": 0.9, "trust_coefficient": 0.001, "weight_decay": 5e-4, "exclude_1d": False}
    assert {k: lamb.defaults[k] for k in ("lr", "betas", "weight_decay")} == {
        "lr": 0.002, "betas": (0.9, 0.999), "weight_decay": 0.01}
    assert RunConfig(optimizer="lars").resolved().lr == 1.0  # 1000x SGD's: trust coefficient 0.001
    assert RunConfig(optimizer="lamb").resolved().lr == 1e-3  # Adam's


def rates(factory, updates: int = 12) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler, seen = factory(optimizer), []
    for _ in range(updates):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_lr_schedule_is_jia_et_als_warmup_then_polynomial_decay_over_the_run():
    assert RunConfig().lr_scheduler(10) is None  # the default: constant, as before
    poly = RunConfig(lr_schedule="warmup-poly", warmup=3, poly_power=1.5).lr_scheduler(10)
    assert rates(poly) == rates(lambda o: warmup_poly_decay(o, 3, 10, 1.5))
    assert rates(poly)[3] == 2.0 and rates(poly)[10:] == [0.0, 0.0]  # the peak after the warm-up, 0 at the end
    cosine = RunConfig(lr_schedule="warmup-cosine", warmup=3).lr_scheduler(10)
    assert rates(cosine) == rates(lambda o: warmup_cosine_decay(o, 3, 10))


@pytest.mark.parametrize("given, message", [
    (dict(warmup=3), "add --lr-schedule warmup-poly or drop --warmup"),
    (dict(poly_power=1.0, lr_schedule="warmup-cosine"), "add --lr-schedule warmup-poly or drop --poly-power"),
    (dict(lr_schedule="warmup-poly", warmup=-1), "--warmup must be >= 0"),
])
def test_schedule_flags_that_would_do_nothing_are_refused(given, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**given)


def test_a_warmup_that_outlasts_the_run_is_refused_before_training(tmp_path):
    with pytest.raises(ValueError, match="--warmup 10 leaves no update of this run's 10"):
        RunConfig(lr_schedule="warmup-poly", warmup=10).lr_scheduler(10)
    with pytest.raises(SystemExit, match="--warmup 40 leaves no update of this run's 4 to decay over"):
        run_example("vgg", ["--optimizer", "lars", "--lr-schedule", "warmup-poly", "--warmup", "40", "--train-samples",
                            "64", "--batch-size", "16", "--epochs", "1", "--checkpoint-dir", str(tmp_path)])


def test_the_recipe_resumes_where_its_schedule_stopped(tmp_path):
    # LARS at a rate warming up then decaying over 8 updates: 4, a save, a load into a new pipeline and 4 more end
    # where 8 in a row do, which they would not if the schedule restarted its warm-up.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(8, 8, 6), torch.randint(0, 3, (8, 8))
    options = RunConfig(optimizer="lars", lr=2.0, lr_schedule="warmup-poly", warmup=2, stages=2, micro_batches=2,
                        partitioner="uniform", engine="local").resolved().wrap_options(updates=8)

    def trained(steps: range, load: bool = False) -> pipetrain.Pipeline:
        pipe = pipetrain.wrap(copy.deepcopy(model), x[0][:4], **options)
        if load:
            pipe.load(tmp_path)
        for i in steps:
            pipe.step(x[i], y[i])
        return pipe

    whole = trained(range(8)).state_dict()
    trained(range(4)).save(tmp_path)
    resumed = trained(range(4, 8), load=True)
    assert all(torch.equal(value, resumed.state_dict()[key]) for key, value in whole.items())
    assert [rt.optimizer.param_groups[0]["lr"] for rt in resumed.held_stages.values()] == [0.0, 0.0]  # decayed


def test_compare_scales_the_rate_by_each_optimizers_rule_and_the_warmup_by_the_samples():
    for optimizer, factor in (("sgd", 64.0), ("lars", 64.0), ("lamb", 8.0)):  # linear, linear, square root
        base = RunConfig(optimizer=optimizer, batch_size=64, lr_schedule="warmup-poly", warmup=128)
        large = method_config(base, "data-parallel+bs=4096")
        assert lr_scale(base, large) == pytest.approx(factor)
        assert warmup_updates(base, large) == 2  # 128 updates of 64 samples: 2 of 4096
    assert math.isclose(lr_scale(RunConfig(optimizer="lamb", batch_size=64),
                                 method_config(RunConfig(optimizer="lamb", batch_size=64), "1f1b+bs=16")), 0.5)

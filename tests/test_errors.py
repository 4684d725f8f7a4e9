"""Bad input gets one clear error that names the cause and the fix; nothing is changed silently."""
import re

import pytest
import torch
from torch import nn

import partitioners
import pipetrain
from dist_harness import run_world
from runtime_models import data, make, sgd
from helpers import wrap_unprofiled


def wrap(model=None, example=None, **kw):
    kw.setdefault("profile", False)
    kw.setdefault("engine", "local")
    kw.setdefault("stages", 2)
    kw.setdefault("micro_batches", 2)
    return pipetrain.wrap(model or make("mlp"), data("mlp", 2)[0] if example is None else example, **kw)


class DataDependent(nn.Module):
    """Python control flow on a tensor value: fx cannot trace it, and its children are no chain."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h) + x[:, :4]


def test_untraceable_model_names_the_code_and_suggests_split_points():
    with pytest.raises(partitioners.TraceError) as info:
        wrap(DataDependent())
    message = str(info.value)
    assert "if h.sum() > 0" in message and "partitioner=[" in message


def test_untraceable_sequential_like_model_falls_back_to_its_children():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            for layer in (self.a, self.b, self.c):
                x = layer(x)
                if x.sum() > 1e9:  # data-dependent, but the children still run in order
                    x = x / 2
            return x

    torch.manual_seed(0)
    model = Chain()
    x = data("mlp", 4)[0]
    expected = model(x)
    pipe = wrap(model, partitioner=["c"])
    assert pipe.plan.num_stages == 2
    torch.testing.assert_close(pipe.predict(x), expected, atol=1e-6, rtol=0)


def test_more_stages_than_nodes():
    with pytest.raises(partitioners.PartitionError, match="use at most"):
        wrap(nn.Sequential(nn.Linear(8, 4)), stages=6)


def test_micro_batches_larger_than_the_batch():
    pipe = wrap(micro_batches=4)
    x, y = data("mlp", 3)
    with pytest.raises(ValueError, match="micro_batches=4"):
        pipe.step(x, y)


def test_example_inputs_of_the_wrong_shape():
    with pytest.raises(ValueError, match="example_inputs do not fit"):
        wrap(example=torch.randn(2, 5))


@pytest.mark.parametrize("option,value,valid", [
    ("schedule", "pipedream", "gpipe, 1f1b, interleaved-1f1b, zb-h1, async-1f1b"),
    ("staleness", "predict", "none, vanilla, stash, 2bw, spectrain, nesterov"),
    ("partitioner", "balanced", "graph, time, params, uniform"),
    ("precision", "fp8", "fp32, bf16, fp16"),
    ("engine", "mpi", "auto, local, distributed"),
])
def test_unknown_names_list_the_valid_ones(option, value, valid):
    with pytest.raises(ValueError, match=f"unknown {option}.*{valid}"):
        wrap(**{option: value})


class NeverCaptured(nn.Module):
    """A model that fails if anything runs it: a bad option must be refused before the capture."""

    def forward(self, x):
        raise AssertionError("the model ran although an option was bad")


@pytest.mark.parametrize("options", [dict(stages=0), dict(schedule="nope"), dict(micro_batches=-1)])
def test_a_bad_option_fails_where_it_is_written_before_any_capture(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        pipetrain.PipelineOptions(**options)
    with pytest.raises(ValueError, match=next(iter(options))):
        pipetrain.wrap(NeverCaptured(), torch.randn(2, 3), **options)


def test_wraps_signature_is_pipeline_options_fields_each_documented():
    # One source of truth: wrap's keyword options are PipelineOptions' fields (names, order, defaults), each
    # named in wrap's docstring, and each Literal vocabulary is the one the validation accepts.
    import dataclasses
    import inspect
    import typing

    from pipetrain import options as vocabularies

    params = [p for p in inspect.signature(pipetrain.wrap).parameters.values() if p.kind is p.KEYWORD_ONLY]
    fields = dataclasses.fields(pipetrain.PipelineOptions)
    assert [p.name for p in params] == [f.name for f in fields]
    assert all(p.default == f.default for p, f in zip(params, fields)), [
        p.name for p, f in zip(params, fields) if p.default != f.default]
    documented = [p.name for p in params if f"{p.name}:" not in pipetrain.wrap.__doc__ and
                  f" {p.name}: " not in pipetrain.wrap.__doc__]
    assert not documented, documented
    hints = typing.get_type_hints(pipetrain.wrap)
    literal = lambda name: next(typing.get_args(a) for a in (hints[name], *typing.get_args(hints[name]))  # noqa: E731
                                if typing.get_origin(a) is typing.Literal)
    assert literal("schedule") == vocabularies.SCHEDULES
    assert literal("staleness") == vocabularies.STALENESS
    assert literal("precision") == vocabularies.PRECISIONS
    assert literal("engine") == vocabularies.ENGINES
    assert literal("nonfinite") == vocabularies.NONFINITE
    assert literal("recompute") == vocabularies.RECOMPUTE
    assert literal("partitioner") == vocabularies.PARTITIONERS
    assert literal("allreduce") == vocabularies.ALLREDUCE
    assert literal("spectrain_variant") == tuple(vocabularies.SPECTRAIN_VARIANTS)
    assert literal("zero") == vocabularies.ZERO


def test_unknown_option_is_an_error_not_ignored():
    with pytest.raises(TypeError, match="unknown option.*micro_batch"):
        wrap(micro_batch=4)


def test_staleness_with_a_synchronous_schedule():
    with pytest.raises(ValueError, match="only applies to schedule='async-1f1b'"):
        wrap(schedule="1f1b", staleness="stash")


def test_async_without_a_staleness_policy():
    with pytest.raises(ValueError, match="needs a staleness policy"):
        wrap(schedule="async-1f1b")


def test_spectrain_with_an_optimizer_without_momentum():
    with pytest.raises(TypeError, match="momentum"):
        wrap(schedule="async-1f1b", staleness="spectrain", micro_batches=1,
             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_interleaved_micro_batches_not_divisible_by_stages():
    with pytest.raises(ValueError, match="divisible"):
        wrap(schedule="interleaved-1f1b", stages=2, micro_batches=3)


def test_receive_ahead_must_be_a_bool():
    with pytest.raises(TypeError, match="receive_ahead must be True .* or False"):
        wrap(receive_ahead="yes")


def test_optimizer_that_is_not_a_factory():
    with pytest.raises(TypeError, match="factory"):
        wrap(optimizer=lambda p: "sgd")


def wrong_world(rank, world):
    try:
        wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=3, micro_batches=2,
                        engine="distributed", optimizer=sgd)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_world_size_must_equal_stages_times_data_parallel(tmp_path):
    messages = run_world(2, "test_errors", "wrong_world", tmp_path)
    assert all("2 processes but stages x data_parallel = 3 x 1" in m for m in messages)


def test_an_optimizer_instance_is_refused_at_wrap_naming_the_factory_to_give():
    model = make("mlp")
    with pytest.raises(TypeError, match=r"optimizer is a SGD instance.*fix: optimizer=lambda params: torch.optim.SGD"):
        wrap(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _unchanged_by_a_refused_step(pipe, x, y) -> str:
    """The error of ``pipe.step(x, y)``, checked to leave the parameters and the update count as they were."""
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises((TypeError, ValueError)) as info:
        pipe.step(x, y)
    assert pipe.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    return str(info.value)


@pytest.mark.parametrize("loss_fn,cause", [
    (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"),
     r"loss_fn returned a tensor of shape \(2,\), not a scalar"),
    (lambda out, y: nn.functional.cross_entropy(out, y).item(), "loss_fn returned a float, not a tensor"),
])
def test_a_loss_fn_that_is_not_a_scalar_tensor_is_refused_before_any_backward(loss_fn, cause):
    pipe = wrap(loss_fn=loss_fn)
    message = _unchanged_by_a_refused_step(pipe, *data("mlp", 4))
    assert re.search(cause, message) and "fix: " in message


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h), h


def test_the_default_loss_on_a_model_returning_a_tuple_is_refused_at_wrap():
    with pytest.raises(TypeError, match=r"loss_fn is cross_entropy\(output, target\) \(the default\), but "
                                        r"TwoOutputs returns a tuple.*fix: .*out\[0\]"):
        wrap(TwoOutputs())


def test_a_loss_fn_given_the_tuple_it_does_not_expect_names_the_output_structure():
    pipe = wrap(TwoOutputs(), loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
    message = _unchanged_by_a_refused_step(pipe, *data("mlp", 4))
    assert "the model's output in the model's own structure, here a tuple" in message and "out[0]" in message

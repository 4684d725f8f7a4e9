"""Every input the model's forward takes reaches it, or is refused before any compute; predict returns
what the unsplit model returns for the whole batch.

The capture bakes an argument the example inputs did not give into the graph as its default, so an
input the pipeline was not wrapped with can only be refused (with its name and the fix), never dropped.
"""
from __future__ import annotations

import pytest
import torch
import transformers as hf
from torch import nn

import pipetrain
from dist_harness import run_world
from pipetrain.runtime.batching import merge_micro_batches, split_micro_batches
from pipetrain.runtime.model_io import splits_by_sample
from third_party_models import TRANSFORMERS, build
from helpers import wrap_unprofiled

hf.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def wrap_bert(example_keys: tuple[str, ...], engine: str = "local",
              **options) -> tuple[pipetrain.Pipeline, dict, torch.Tensor]:
    """BERT wrapped with the example keys ``example_keys``, and an 8-sample batch with padding (the mask matters)."""
    case = TRANSFORMERS["bert"]
    example = {k: v for k, v in case.batch(2, 0)[0].items() if k in example_keys}
    pipe = wrap_unprofiled(build("bert"), example, stages=2, micro_batches=2, loss_fn=case.loss_fn, optimizer=sgd,
                           engine=engine, **options)
    inputs, y = case.batch(8, 1)
    return pipe, inputs, y


def refused_before_any_compute(pipe: pipetrain.Pipeline, run) -> str:
    """The error ``run()`` raises, checked to leave the parameters and the update count as they were."""
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises((TypeError, ValueError)) as info:
        run()
    assert pipe.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    return str(info.value)


def test_an_input_forward_takes_but_the_example_lacked_is_refused_not_dropped() -> None:
    pipe, inputs, y = wrap_bert(("input_ids",))
    tuple_form = (inputs["input_ids"], inputs["attention_mask"])  # bound to forward's parameters by position
    for run in (lambda: pipe.step(inputs, y), lambda: pipe.predict(inputs), lambda: next(pipe.train([(inputs, y)])),
                lambda: pipe.step(tuple_form, y)):
        message = refused_before_any_compute(pipe, run)
        assert "'attention_mask', which BertForSequenceClassification.forward takes" in message
        assert "fix: wrap with example_inputs that include 'attention_mask'" in message


def test_an_async_stream_checks_each_mini_batch_before_it_enters_the_pipeline() -> None:
    pipe, inputs, y = wrap_bert(("input_ids",), schedule="async-1f1b", staleness="stash")
    message = refused_before_any_compute(pipe, lambda: list(pipe.train([(inputs, y)])))
    assert "fix: wrap with example_inputs that include 'attention_mask'" in message


def test_a_key_forward_does_not_take_is_refused_listing_its_named_parameters() -> None:
    pipe, inputs, y = wrap_bert(("input_ids", "attention_mask"))
    typo = {"input_ids": inputs["input_ids"], "atention_mask": inputs["attention_mask"]}
    for run in (lambda: pipe.step(typo, y), lambda: pipe.predict(typo)):
        message = refused_before_any_compute(pipe, run)
        assert "BertForSequenceClassification.forward has no parameter 'atention_mask'" in message
        assert "its named parameters are input_ids, attention_mask, token_type_ids" in message
        assert "it also takes **kwargs, but the pipeline passes only the inputs the example gave" in message


def test_an_input_the_pipeline_was_wrapped_with_cannot_be_left_out() -> None:
    pipe, inputs, y = wrap_bert(("input_ids", "attention_mask"))
    message = refused_before_any_compute(pipe, lambda: pipe.step({"input_ids": inputs["input_ids"]}, y))
    assert "the inputs lack 'attention_mask'" in message


class Scaled(nn.Module):
    """Two inputs of the same shape: swapping them gives another result of the same shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # `input`: fx renames it input_1
        return self.b(self.a(input) * scale)


def test_positional_inputs_bind_to_forward_s_parameters_whatever_the_example_s_order() -> None:
    torch.manual_seed(0)
    model = Scaled()
    x, s = torch.randn(6, 4), torch.rand(6, 4)
    pipe = wrap_unprofiled(model, {"scale": s[:2], "input": x[:2]}, stages=2, micro_batches=2,
                           engine="local")
    # fx runs the very same calls on the same micro-batches as the unsplit model: bit for bit
    expected = torch.cat([model(*piece) for piece in split_micro_batches((x, s), 2)]).detach()
    assert torch.equal(pipe.predict((x, s)), expected)
    assert torch.equal(pipe.predict({"input": x, "scale": s}), expected)
    message = refused_before_any_compute(pipe, lambda: pipe.predict((x, s, s)))
    assert "the inputs are 3 positional arguments, but Scaled.forward takes at most 2 by position (input, scale)" \
        in message


def missing_mask_ranks(rank: int, world: int) -> tuple[str, str, float]:
    """On every rank: the errors of a step and a predict with a mask the pipeline was not wrapped with,
    then a step with the inputs it was wrapped with (the refusals left every rank where it was)."""
    hf.logging.set_verbosity_error()
    pipe, inputs, y = wrap_bert(("input_ids",), engine="distributed")
    messages = []
    for run in (lambda: pipe.step(inputs, y), lambda: pipe.predict(inputs)):
        try:
            run()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages[0], messages[1], pipe.step({"input_ids": inputs["input_ids"]}, y)


@pytest.mark.slow
def test_every_rank_refuses_the_mask_before_any_communication(tmp_path, one_thread) -> None:
    per_rank = run_world(2, "test_inputs", "missing_mask_ranks", tmp_path)
    pipe, inputs, y = wrap_bert(("input_ids",))
    expected = pipe.step({"input_ids": inputs["input_ids"]}, y)
    for step_error, predict_error, loss in per_rank:
        assert step_error == predict_error == per_rank[0][0]
        assert "fix: wrap with example_inputs that include 'attention_mask'" in step_error
        assert loss == expected  # the same bits as the local engine: nothing was left half sent


def _padded_labels(samples: int) -> dict:
    """GPT-2 inputs whose labels ignore (-100) a different number of tokens in different samples: a mean over
    tokens, which no weighting of micro-batch means by their samples reproduces."""
    inputs, _ = TRANSFORMERS["gpt2-labels"].batch(samples, 3)
    labels = inputs["labels"].clone()
    for i in range(samples):
        labels[i, 8 - i % 4 - 1:] = -100
    return {"input_ids": inputs["input_ids"], "labels": labels}


@pytest.mark.parametrize("samples", [7, 8])
def test_predict_returns_the_whole_batch_loss_of_a_model_that_computes_its_own(samples: int) -> None:
    case = TRANSFORMERS["gpt2-labels"]
    model = build("gpt2-labels")
    pipe = wrap_unprofiled(model, case.batch(2, 0)[0], stages=2, micro_batches=3, loss_fn=case.loss_fn,
                           engine="local")
    inputs = _padded_labels(samples)
    with torch.no_grad():
        expected = model.eval()(**inputs)
        pieces = split_micro_batches(inputs, 3)
        by_samples = sum(model(**p).loss * p["input_ids"].shape[0] for p in pieces) / samples
    out = pipe.predict(inputs)
    # One forward of the whole batch through the export-captured stages: the ATen calls the model's Python
    # code dispatches to, with the same shapes, so the same bits up to float32 rounding of regrouped sums.
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-6)
    # Why micro-batch losses cannot be combined: weighting them by samples is off by far more than rounding.
    assert abs(float(by_samples) - float(expected.loss)) > 10 * 1e-6 * float(expected.loss)


def test_outputs_split_by_sample_only_when_every_tensor_has_the_batch_as_dim_0() -> None:
    meta = lambda *shape: torch.empty(shape, device="meta")  # noqa: E731
    assert splits_by_sample({"logits": meta(4, 8, 5), "hidden": (meta(4, 3),), "note": "text"}, 4)
    assert not splits_by_sample({"loss": meta(), "logits": meta(4, 5)}, 4)  # a value reduced over the batch
    assert not splits_by_sample(meta(5, 4), 4)  # dim 0 is not the batch


def test_micro_batch_outputs_with_a_reduced_value_are_not_merged() -> None:
    parts = [{"loss": torch.tensor(1.0), "logits": torch.ones(2, 3)},
             {"loss": torch.tensor(2.0), "logits": torch.ones(1, 3)}]
    with pytest.raises(ValueError, match="0-dim output"):
        merge_micro_batches(parts)
    assert torch.equal(merge_micro_batches([{"logits": torch.ones(2, 3)}, {"logits": torch.zeros(1, 3)}])["logits"],
                       torch.cat([torch.ones(2, 3), torch.zeros(1, 3)]))
    assert merge_micro_batches(parts[:1]) is parts[0]

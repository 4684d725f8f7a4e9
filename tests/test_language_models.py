"""Decoder language models of many Hugging Face families trained in fp32, bf16 and fp16 on 2 and 4 stages.

Each cell of the table (family x precision x stages) trains the pipeline and the unsplit model with
gradient accumulation over the same micro-batches, the unsplit model under the very same
``torch.autocast`` (in fp16 also with torch.amp.GradScaler at the pipeline's initial scale), and
compares what the pipeline predicts on the initial weights with the unsplit model's eval output.

Tolerances:
- fp32: parameters within 1e-5 relative (absolute floor 1e-7) and predictions within 1e-5, as in
  test_third_party_models: the stages run the ATen calls the Python code dispatches to, a few of
  which group a sum differently.
- bf16 and fp16: both runs execute the same calls in the same dtypes (the capture records the model's
  own dtype code under the stages' autocast, and boundary values keep their dtype), so they differ
  only where a sum is grouped or rounded at another point: an ATen decomposition, or a gradient summed
  on two stages (attention runs as eager runs it: partitioners.capture._attention_masks_as_eager).
  Each such difference changes an element by about one rounding to the low precision, a relative
  u = 2^-8 in bf16 (8 significant bits) and 2^-11 in fp16 (11). The loss averages over every
  position, so its relative difference stays far below u after a few steps: we allow u. Predictions
  on equal weights: u times the largest logit. Measured after 3 steps, over every family and both
  stage counts: losses within 4e-5 (bf16) and 3e-6 (fp16) relative, predictions bit for bit.

Time: torch.export dominates a cell and does not depend on the stage count, so each (family,
precision) is captured once and both stage counts partition a copy of that capture
(``_capture_once``); the unsplit reference is computed once per (family, precision) too.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import transformers as hf

import partitioners
from dist_harness import run_world
from language_models import LANGUAGE_MODELS, build_language_model, lm_loss, token_batch
from pipetrain.comm import transport
from pipetrain.runtime.batching import split_micro_batches
from test_third_party_models import assert_same_state
from helpers import wrap_unprofiled

MICRO, STEPS = 2, 3
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ROUNDING = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}  # relative error of one rounding to the format
INITIAL_SCALE = 2.0 ** 16  # pipetrain's DynamicLossScaler starts there, as torch.amp.GradScaler does
hf.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches() -> list:
    return [token_batch(8, seed) for seed in range(1, STEPS + 1)]


def _predict_inputs() -> dict:
    return token_batch(5, 7)[0]  # 5 samples in 2 micro-batches: uneven, a batch size never trained on


def _precision(name: str):
    dtype = AUTOCAST[name]
    return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)


@functools.cache
def _reference(family: str, precision: str) -> tuple[torch.Tensor, list[float], dict, float | None]:
    """The unsplit model: its eval logits on the initial weights, then the mean loss of each training step,
    the final state and (fp16) the final loss scale, trained with gradient accumulation under autocast."""
    model = build_language_model(family)
    with torch.no_grad(), _precision(precision):
        predicted = model.eval()(**_predict_inputs()).logits
    model.train()
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE) if precision == "fp16" else None
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        total = 0.0
        for xi, yi in zip(split_micro_batches(x, MICRO), split_micro_batches(y, MICRO)):
            with _precision(precision):
                loss = lm_loss(model(**xi), yi) * len(yi) / len(y)
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(total)
    return predicted, losses, model.state_dict(), scaler.get_scale() if scaler else None


_CAPTURES: dict[tuple[str, str], partitioners.CostGraph] = {}


def _capture_once(monkeypatch, family: str, precision: str) -> None:
    """Make wrap() capture (family, precision) only the first time and partition a copy of that capture
    afterwards: a copy, so every pipeline trains its own tensors from the initial weights."""
    capture = partitioners.trace_for_training

    def once(model, example_inputs, profile, autocast=None):
        key = (family, precision)
        if key not in _CAPTURES:
            _CAPTURES[key] = copy.deepcopy(capture(model, example_inputs, profile, autocast))
        return copy.deepcopy(_CAPTURES[key])

    monkeypatch.setattr(partitioners, "trace_for_training", once)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("precision", list(AUTOCAST))
@pytest.mark.parametrize("family", list(LANGUAGE_MODELS))
def test_trains_and_predicts_like_the_unsplit_model(family: str, precision: str, stages: int, monkeypatch) -> None:
    _capture_once(monkeypatch, family, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.export's notes on the models' Python code
        pipe = wrap_unprofiled(build_language_model(family), token_batch(2, 0)[0], stages=stages,
                               micro_batches=MICRO, loss_fn=lm_loss, optimizer=sgd, precision=precision,
                               engine="local")
    assert pipe.plan.num_stages == stages
    predicted = pipe.predict(_predict_inputs()).logits
    losses = [pipe.step(x, y) for x, y in _batches()]
    expected, ref_losses, ref_state, ref_scale = _reference(family, precision)

    assert predicted.dtype == expected.dtype
    if precision == "fp32":
        torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)
        assert_same_state(pipe.state_dict(), ref_state, exact=False)
        return
    u = ROUNDING[precision]
    torch.testing.assert_close(predicted, expected, rtol=u, atol=u * expected.abs().max().item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=u, atol=0.0)
    assert pipe.loss_scale == ref_scale  # fp16: the same steps skipped (none here) and the same scale


def _record_sends(monkeypatch) -> dict[tuple[int, str, int], list[torch.dtype]]:
    """(link, "act" or "grad", micro-batch) -> the dtypes of the tensors sent, filled as the local engine sends."""
    sent: dict[tuple[int, str, int], list[torch.dtype]] = {}
    send = transport.LocalTransport.send

    def record(self, link, kind, micro_batch, values, shape_key=None):
        sent[(link.index, kind, micro_batch)] = [v.dtype for v in values if isinstance(v, torch.Tensor)]
        return send(self, link, kind, micro_batch, values, shape_key)

    monkeypatch.setattr(transport.LocalTransport, "send", record)
    return sent


def _sent_dtypes(sent: dict) -> set[torch.dtype]:
    return {d for (_, kind, _), dtypes in sent.items() if kind == "act" for d in dtypes}


def test_boundary_values_keep_their_dtype_and_the_plan_counts_their_bytes(monkeypatch) -> None:
    # Llama in bf16 on 4 stages: boundaries carry bf16 projections next to the fp32 residual stream and
    # fp32 rotary tables, as the unsplit model holds them; each gradient has its tensor's dtype.
    sent = _record_sends(monkeypatch)
    _capture_once(monkeypatch, "llama", "bf16")
    pipe = wrap_unprofiled(build_language_model("llama"), token_batch(2, 0)[0], stages=4, micro_batches=MICRO,
                           loss_fn=lm_loss, optimizer=sgd, precision="bf16", engine="local")
    pipe.step(*token_batch(2 * MICRO, 1))  # micro-batches of the example's size: the plan's bytes apply
    assert {torch.bfloat16, torch.float32} <= _sent_dtypes(sent)
    for (link, kind, g), dtypes in sent.items():
        if kind == "act":
            assert sent[(link, "grad", g)] == [d for d in dtypes if d.is_floating_point], (link, g)
    plan, measured = pipe.plan, pipe.last_result.comm_bytes["activations"]
    for k in range(3):  # each stage sends its outputs to later stages once per micro-batch
        predicted = sum(plan.graph.graph.nodes[n]["act_bytes"] * len(plan.consumers(n)) for n in plan.stage_outputs(k))
        assert measured[k] == MICRO * predicted, k


def _interleaved_llama_bf16(engine: str) -> tuple[list[float], dict]:
    """Llama in bf16 as 4 virtual stages on 2 devices: every boundary crosses between the devices."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = wrap_unprofiled(build_language_model("llama"), token_batch(2, 0)[0], stages=2, micro_batches=2,
                               schedule="interleaved-1f1b", chunks=2, loss_fn=lm_loss, optimizer=sgd,
                               precision="bf16", partitioner="uniform", engine=engine)
    losses = [pipe.step(x, y) for x, y in _batches()]
    return losses, pipe.state_dict()


def interleaved_ranks(rank: int, world: int) -> tuple[list[float], dict]:
    hf.logging.set_verbosity_error()
    return _interleaved_llama_bf16("distributed")


@pytest.mark.slow
def test_mixed_dtype_boundaries_under_gloo_train_like_the_local_engine(tmp_path, one_thread, monkeypatch) -> None:
    # The transport describes every tensor's dtype in its header: bf16 and fp32 values (and their
    # gradients) cross processes as they are, so both engines give the same bits.
    per_rank = run_world(2, "test_language_models", "interleaved_ranks", tmp_path)
    sent = _record_sends(monkeypatch)
    _capture_once(monkeypatch, "llama", "bf16")  # the (llama, bf16) cells' capture; the ranks capture their own
    losses, expected = _interleaved_llama_bf16("local")
    assert {torch.bfloat16, torch.float32} <= _sent_dtypes(sent)
    merged = {}
    for rank_losses, state in per_rank:
        assert rank_losses == losses
        merged.update(state)
    assert_same_state(merged, expected, exact=True)

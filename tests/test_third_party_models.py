"""Hugging Face, timm and torchvision models passed to pipetrain.wrap as they are.

Each trains like the unsplit model with gradient accumulation over the same micro-batches,
predicts its eval-mode output and gives a state dict that loads into the original with strict=True.
Tolerance: fp32, and where torch.fx captures the model (timm, torchvision) the stages run the very
same calls, so the result is bit for bit. Where torch.export captures it (Hugging Face), the stages
run the ATen calls the Python code dispatches to, and a few differ in how they group a sum (e.g. a
weight gradient summed over the batch in one addmm rather than per call), so parameters may differ
in the last bits: we allow 1e-5 relative, with an absolute floor of 1e-7 for values that are
rounding noise around zero (OPT's key bias has an exact gradient of 0 and sits at ~1e-13).
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import timm
import torch
import torch.nn as nn
import transformers as hf

import partitioners
import pipetrain
from dist_harness import run_world
from pipetrain.runtime.batching import batch_size, split_micro_batches
from third_party_models import CASES, TRANSFORMERS, VISION, build, causal_lm_batch, image_batch, lm_loss
from helpers import capture_once, wrap_unprofiled

MICRO = 2
hf.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _call(model: nn.Module, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _tensor(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def reference_training(name: str, batches: list, autocast: torch.dtype | None = None) -> nn.Module:
    """The unsplit model trained with gradient accumulation over the same micro-batches, under
    ``torch.autocast(dtype=autocast)`` when given (fp16: with torch.amp.GradScaler at pipetrain's initial scale)."""
    model, case = build(name), CASES[name]
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if autocast == torch.float16 else None
    for x, y in batches:
        opt.zero_grad()
        xs = split_micro_batches(x, MICRO)
        ys = split_micro_batches(y, MICRO) if y is not None else [None] * MICRO
        for xi, yi in zip(xs, ys):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = case.loss_fn(_call(model, xi), yi) * batch_size(xi) / batch_size(x)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return model


def assert_same_state(ours: dict, theirs: dict, exact: bool) -> None:
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if exact or not value.is_floating_point():
            assert torch.equal(ours[key], value), key
        else:
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7, msg=key)


# The convolutional networks take 10-20 s a case on 2 cores: they run at 4 stages only, whose three
# boundaries include what a 2-stage split crosses; the others at both counts.
CONVOLUTIONAL = {"torchvision-resnet18", "torchvision-mobilenet_v3_small", "timm-efficientnet_b0",
                 "timm-regnetx_002", "timm-resnet10t"}


_CAPTURES: dict = {}  # for capture_once: this module's captures of build(name) on case.batch(2, 0)[0]


@functools.cache
def _reference_of_two_batches(name: str) -> nn.Module:
    """The unsplit model trained on the two batches every stage count of test_trains_predicts... trains on
    (computed once per model; the tests only read it)."""
    case = CASES[name]
    return reference_training(name, [case.batch(8, seed) for seed in (1, 2)])


@pytest.mark.slow
@pytest.mark.parametrize("name, stages", [(n, s) for n in CASES for s in ((4,) if n in CONVOLUTIONAL else (2, 4))])
def test_trains_predicts_and_loads_like_the_unsplit_model(name: str, stages: int, monkeypatch) -> None:
    case = CASES[name]
    batches = [case.batch(8, seed) for seed in (1, 2)]
    with capture_once(monkeypatch, _CAPTURES, name):  # both stage counts cut the same capture of build(name)
        pipe = wrap_unprofiled(build(name), case.batch(2, 0)[0], stages=stages, micro_batches=MICRO,
                               loss_fn=case.loss_fn, optimizer=sgd, engine="local")
    assert pipe.plan.num_stages == stages
    losses = [pipe.step(x, y) for x, y in batches]
    reference = _reference_of_two_batches(name)
    assert_same_state(pipe.state_dict(), reference.state_dict(), exact=name in VISION)
    assert all(loss > 0 for loss in losses)

    x, _ = case.batch(5, 7)  # 5 samples in 2 micro-batches: uneven, and a batch size never seen
    got, expected = pipe.predict(x), _call(reference.eval(), x)
    assert type(got) is type(expected)
    torch.testing.assert_close(_tensor(got), _tensor(expected), rtol=1e-5, atol=1e-6)

    fresh = build(name, seed=1)
    fresh.load_state_dict(pipe.state_dict(), strict=True)



@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["torchvision-resnet18", "timm-vit"])
def test_fx_captured_models_train_bit_for_bit_under_autocast(name: str, precision: str) -> None:
    # torch.fx keeps the model's own calls, which run under the stages' autocast as they do in the unsplit
    # model, and boundary values keep their dtype (ViT's fp32 residual stream included): the same bits.
    # ResNet-18 trains on batches of 4 (micro-batches of 2): CPU convolutions in bf16 and fp16 take their slow
    # path, whose backward costs ~0.4 s a sample whatever the image size (16 s a case with batches of 8).
    case = CASES[name]
    samples = 4 if name == "torchvision-resnet18" else 8
    batches = [case.batch(samples, seed) for seed in (1, 2)]
    pipe = wrap_unprofiled(build(name), case.batch(2, 0)[0], stages=4, micro_batches=MICRO, loss_fn=case.loss_fn,
                           optimizer=sgd, precision=precision, engine="local")
    for x, y in batches:
        pipe.step(x, y)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert_same_state(pipe.state_dict(), reference_training(name, batches, dtype).state_dict(), exact=True)

@pytest.mark.slow
def test_every_alias_of_a_tied_embedding_survives_save_load_and_export(tmp_path, monkeypatch) -> None:
    case = TRANSFORMERS["t5"]
    with capture_once(monkeypatch, _CAPTURES, "t5"):  # the capture test_trains_predicts... made of build("t5")
        pipe = wrap_unprofiled(build("t5"), case.batch(2, 0)[0], stages=4, micro_batches=MICRO,
                               loss_fn=case.loss_fn, optimizer=sgd, engine="local")
    pipe.step(*case.batch(8, 1))
    state = pipe.state_dict()
    aliases = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    assert all(torch.equal(state[a], state["shared.weight"]) for a in aliases)
    assert not torch.equal(state["shared.weight"], build("t5").state_dict()["shared.weight"])  # it trained

    pipe.save(tmp_path)
    exported = pipetrain.export_state_dict(tmp_path)
    assert set(aliases) <= set(exported)
    original = build("t5", seed=1)
    original.load_state_dict(exported, strict=True)
    again = wrap_unprofiled(build("t5", seed=2), case.batch(2, 0)[0], stages=2, micro_batches=MICRO,
                            loss_fn=case.loss_fn, optimizer=sgd, engine="local")
    again.load(tmp_path)  # another stage count: re-partitioned
    assert_same_state(again.state_dict(), state, exact=True)


@pytest.mark.slow
def test_hand_written_batch_norm_profiles_without_making_buffers_require_grad() -> None:
    # timm's BatchNormAct2d calls F.batch_norm(x, self.running_mean, ...) itself.
    model = build("timm-efficientnet_b0")
    x, y = image_batch(4, 0)
    pipe = pipetrain.wrap(model, x[:2], stages=2, micro_batches=MICRO, optimizer=sgd, profile=True, engine="local")
    assert not any(b.requires_grad for b in model.buffers())
    assert pipe.step(x, y) > 0
    assert not any(b.requires_grad for rt in pipe.held_stages.values() for b in rt.module.buffers())
    assert pipe.plan.graph.total_time() > 0


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_inputs_as_a_tuple_or_a_dict_of_keyword_arguments(form: str, monkeypatch) -> None:
    case = TRANSFORMERS["bert"]
    inputs, y = case.batch(8, 1)
    as_form = (lambda d: (d["input_ids"], d["attention_mask"])) if form == "tuple" else (lambda d: d)
    # The dict is the example test_trains_predicts... captures build("bert") on; the tuple is captured here.
    with capture_once(monkeypatch, _CAPTURES, "bert") if form == "dict" else contextlib.nullcontext():
        pipe = wrap_unprofiled(build("bert"), as_form(case.batch(2, 0)[0]), stages=2, micro_batches=MICRO,
                               loss_fn=case.loss_fn, optimizer=sgd, engine="local")
    pipe.step(as_form(inputs), y)
    assert_same_state(pipe.state_dict(), reference_training("bert", [(inputs, y)]).state_dict(), exact=True)
    out = pipe.predict(as_form(inputs))
    assert isinstance(out, hf.modeling_outputs.SequenceClassifierOutput) and out.logits.shape == (8, 5)


def test_predict_runs_dropout_and_stochastic_depth_in_eval_mode() -> None:
    gpt2 = hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                            resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3))
    swin = timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                             embed_dim=16, depths=(1, 1), num_heads=(1, 2), drop_path_rate=0.3, num_classes=5)
    for model, (x, y), loss_fn in [(gpt2, causal_lm_batch(4, 0), lm_loss), (swin, image_batch(4, 0), None)]:
        options = {"loss_fn": loss_fn} if loss_fn else {}
        pipe = wrap_unprofiled(model, x, stages=2, micro_batches=MICRO, engine="local", **options)
        expected = _tensor(_call(model.eval(), x))
        torch.testing.assert_close(_tensor(pipe.predict(x)), expected, rtol=1e-5, atol=1e-6)
        assert pipe.step(x, y) > 0  # training mode draws dropout masks again
        assert all(rt.module.training for rt in pipe.held_stages.values())


class _NoCapture(nn.Module):
    """forward(**kwargs) (no torch.fx) with a branch on a tensor's value (no torch.export), whose
    children do not run as a chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x) * 2


def test_a_model_no_capture_follows_gets_one_clear_error() -> None:
    with pytest.raises(partitioners.TraceError) as info:
        wrap_unprofiled(_NoCapture(), -torch.ones(2, 4), stages=2, engine="local")
    message = str(info.value)
    assert message.startswith("pipetrain cannot capture _NoCapture")
    assert "fx:" in message and "export:" in message and "chain:" in message
    assert "test_third_party_models.py" in message and "if x.sum() > 0:" in message  # the construct and its line
    assert "partitioner=[" in message and "['a', 'b']" in message  # the fix: split points on top-level children


def test_a_branch_on_self_training_the_capture_cannot_follow_is_refused() -> None:
    class TrainOnlyNoise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            if self.training:  # baked into any capture made in training mode
                h = h + 1
            return self.b(h)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(partitioners.TraceError, match="self.training"):
            partitioners.trace(TrainOnlyNoise(), torch.randn(2, 4), profile=False)


def _async_spectrain(engine: str) -> tuple[list[float], dict, torch.Tensor]:
    """GPT-2 (captured by torch.export) trained by async-1f1b with SpecTrain weight prediction."""
    torch.manual_seed(0)
    case = TRANSFORMERS["gpt2"]
    batches = [case.batch(8, seed % 2) for seed in range(6)]
    pipe = wrap_unprofiled(build("gpt2"), case.batch(2, 0)[0], stages=2, micro_batches=MICRO,
                           schedule="async-1f1b", staleness="spectrain", loss_fn=case.loss_fn,
                           optimizer=sgd, partitioner="uniform", engine=engine)
    losses = [r.loss for r in pipe.train(batches)]
    return losses, pipe.state_dict(), _tensor(pipe.predict(case.batch(4, 9)[0]))


def async_ranks(rank: int, world: int) -> tuple[list[float], dict, torch.Tensor]:
    hf.logging.set_verbosity_error()
    return _async_spectrain("distributed")


@pytest.mark.slow
def test_async_spectrain_under_gloo_trains_like_the_local_engine(tmp_path, one_thread, monkeypatch) -> None:
    # one_thread: the ranks' thread count, for bitwise equality
    per_rank = run_world(2, "test_third_party_models", "async_ranks", tmp_path)
    with capture_once(monkeypatch, _CAPTURES, "gpt2"):  # build("gpt2") on its example; the ranks capture their own
        losses, expected, prediction = _async_spectrain("local")
    assert sum(losses[-2:]) < sum(losses[:2])  # it trains: two batches seen three times each
    merged = {}
    for rank_losses, state, rank_prediction in per_rank:
        assert rank_losses == losses
        assert torch.equal(rank_prediction, prediction)
        merged.update(state)
    assert_same_state(merged, expected, exact=True)
    build("gpt2", seed=1).load_state_dict(merged, strict=True)


@pytest.mark.slow
def test_a_capture_refused_for_training_only_randomness_names_the_config_values_to_turn_off() -> None:
    # Wav2Vec2's fine-tuning defaults: LayerDrop (a torch.rand draw in a Python branch) and SpecAugment
    # masking (numpy draws baked into any capture) under self.training.
    config = hf.Wav2Vec2Config(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=32, conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3),
                               num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2)
    assert config.layerdrop > 0 and config.mask_time_prob > 0
    torch.manual_seed(0)
    model, x = hf.Wav2Vec2ForCTC(config), {"input_values": torch.randn(2, 800)}
    options = dict(stages=2, micro_batches=MICRO, engine="local", loss_fn=lambda out, y: out.logits.sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(partitioners.TraceError) as info:
            wrap_unprofiled(model, x, **options)
    message = str(info.value)
    assert "config.layerdrop = 0.1 (Wav2Vec2Encoder.forward)" in message
    assert "config.mask_time_prob = 0.05 (Wav2Vec2Model._mask_hidden_states)" in message
    assert "fix: set each to 0 for pipeline training" in message
    model.config.layerdrop = model.config.mask_time_prob = 0.0  # the fix the message names
    pipe = wrap_unprofiled(model, x, **options)
    torch.testing.assert_close(pipe.predict(x).logits, model.eval()(**x).logits, rtol=1e-5, atol=1e-6)

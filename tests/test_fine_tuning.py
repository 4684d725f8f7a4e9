"""Fine-tuning a Hugging Face language model: its own activation checkpointing becomes recomputation, and a
PEFT (LoRA) model wraps with its default config and trains only its adapters. Each against the unsplit
model trained with gradient accumulation over the same micro-batches (fp32, 1e-5 relative as in
test_language_models)."""
from __future__ import annotations

import warnings

import pytest
import torch

import partitioners
from dist_harness import run_world
from language_models import build_language_model, lm_loss, token_batch
from helpers import wrap_unprofiled

MICRO, STEPS = 2, 3


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def batches():
    return [token_batch(8, seed) for seed in range(1, STEPS + 1)]


def unsplit(model, optimizer=sgd):
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    for x, y in batches():
        opt.zero_grad()
        for i in range(MICRO):
            part = slice(i * 4, (i + 1) * 4)
            (lm_loss(model(**{k: v[part] for k, v in x.items()}), y[part]) / MICRO).backward()
        opt.step()
    return model.state_dict()


def piped(model, stages, **options):
    options = dict(dict(optimizer=sgd), **options)
    pipe = wrap_unprofiled(model, token_batch(2, 0)[0], stages=stages, micro_batches=MICRO, partitioner="uniform",
                           engine="local", loss_fn=lm_loss, **options)
    for x, y in batches():
        pipe.step(x, y)
    return pipe


def assert_close(state, expected):
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hugging_face_gradient_checkpointing_becomes_recomputation(reentrant):
    expected = unsplit(build_language_model("llama"))
    model = build_language_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with pytest.warns(UserWarning, match="recompute='always'"):
        pipe = piped(model, 2)
    assert pipe.options.recompute == "always"
    assert model.is_activation_checkpointing  # the user's model is as it was given
    assert_close(pipe.state_dict(), expected)
    plain = piped(build_language_model("llama"), 2)
    kept, all_kept = pipe.last_result.activation_bytes, plain.last_result.activation_bytes
    # Activations held between a micro-batch's forward and backward: the stages with micro-batches in flight keep
    # only their inputs; the last one runs each backward right after its forward, so recomputing saves nothing there.
    assert kept[0] < all_kept[0] / 1.5 and kept[-1] <= all_kept[-1], (kept, all_kept)


def test_an_explicit_recompute_setting_is_kept():
    model = build_language_model("llama")
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = piped(model, 2, recompute="except-last")
    assert pipe.options.recompute == "except-last"


# ----- PEFT (LoRA) -------------------------------------------------------------------------------------

def lora(seed=0):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    model = get_peft_model(build_language_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # LoRA starts with B = 0: give B values so the adapters change the logits from step 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model


@pytest.fixture(scope="module", params=[2, 4])
def lora_pipe(request):
    """A LoRA pipeline (the model's default config: use_cache on) trained 3 steps on 2 and 4 stages, and the
    unsplit one."""
    expected = unsplit(lora())
    return piped(lora(), request.param), expected


def test_a_peft_model_wraps_with_its_default_config_and_trains_only_its_adapters(lora_pipe):
    pipe, expected = lora_pipe
    assert_close(pipe.state_dict(), expected)
    stepped = []
    for stage in pipe.held_stages.values():
        names = {id(p): n for n, p in stage.module.named_parameters()}
        if stage.optimizer is None:  # a stage without adapters (4 stages: the embedding's) has no optimizer at all
            assert not any(p.requires_grad for p in stage.module.parameters())
            continue
        stepped += [names[id(p)] for g in stage.optimizer.param_groups for p in g["params"]]
    assert len(stepped) == 8 and all(".lora_" in n for n in stepped), stepped  # 2 layers x (q, v) x (A, B)


def test_save_pretrained_of_a_peft_pipeline_writes_what_peft_loads(lora_pipe, tmp_path):
    from peft import PeftModel
    pipe, _ = lora_pipe
    pipe.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(build_language_model("llama"), tmp_path).eval()
    x = token_batch(3, 9)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(**x).logits, pipe.predict(x).logits, rtol=1e-5, atol=1e-6)


def test_merged_adapters_load_into_the_base_class_with_the_logits_of_predict(lora_pipe, tmp_path):
    from transformers import LlamaForCausalLM
    pipe, _ = lora_pipe
    pipe.save_pretrained(tmp_path, merge_adapters=True)
    loaded, info = LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = token_batch(3, 9)[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(**x).logits, pipe.predict(x).logits, rtol=1e-5, atol=1e-5)


def distributed_lora(rank, world, out):
    """2 gloo ranks: the LoRA pipeline trained, its adapter and its merged model written, every rank its share."""
    pipe = wrap_unprofiled(lora(), token_batch(2, 0)[0], stages=2, micro_batches=MICRO, partitioner="uniform",
                           engine="distributed", loss_fn=lm_loss, optimizer=sgd)
    for x, y in batches():
        pipe.step(x, y)
    pipe.save_pretrained(f"{out}/adapter")
    pipe.save_pretrained(f"{out}/merged", merge_adapters=True)
    return pipe.predict(token_batch(3, 9)[0]).logits


@pytest.mark.slow
def test_two_ranks_write_the_adapter_and_the_merged_model_that_load_with_the_logits_of_predict(tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    logits = run_world(2, "test_fine_tuning", "distributed_lora", tmp_path / "ranks", str(tmp_path))
    assert torch.equal(logits[0], logits[1])
    x = token_batch(3, 9)[0]
    with torch.no_grad():
        adapter = PeftModel.from_pretrained(build_language_model("llama"), tmp_path / "adapter").eval()(**x).logits
        merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()(**x).logits
    torch.testing.assert_close(adapter, logits[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged, logits[0], rtol=1e-5, atol=1e-5)


def test_save_pretrained_refuses_names_its_class_would_not_load(tmp_path):
    model = build_language_model("llama")
    model.extra = torch.nn.Linear(2, 2)  # a parameter LlamaForCausalLM does not have: it would be dropped
    pipe = wrap_unprofiled(model, token_batch(2, 0)[0], stages=2, micro_batches=MICRO, partitioner="uniform",
                           engine="local", loss_fn=lm_loss, optimizer=sgd)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.from_pretrained loads with 0 missing weight\(s\) \(\) "
                                         r"and 2 unexpected one\(s\) \(extra.bias, extra.weight\)"):
        pipe.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stages", [2, 4])
def test_a_peft_model_on_meta_reads_its_base_checkpoint_and_starts_as_the_base_model(tmp_path, stages):
    # The recipe for a model too large for one process: the base model's config on the meta device, LoRA on
    # it, weights= the base model's Hugging Face directory. Every base tensor is read under its base name, the
    # factors are initialised as peft initialises them (B = 0), so the pipeline starts as the base model and
    # then trains as the unsplit PEFT model built from the loaded base with the same factors.
    from peft import LoraConfig, get_peft_model

    base = build_language_model("llama")
    base.save_pretrained(tmp_path / "base")
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    pipe = piped(get_peft_model(_meta_copy(base), config), stages, weights=str(tmp_path / "base"))
    state = pipe.state_dict()  # after 3 steps; the factors' start is checked on a fresh pipeline below
    fresh = wrap_unprofiled(get_peft_model(_meta_copy(base), config), token_batch(2, 0)[0], stages=stages,
                            micro_batches=MICRO, partitioner="uniform", engine="local",
                            loss_fn=lm_loss, optimizer=sgd, weights=str(tmp_path / "base"))
    start = fresh.state_dict()
    factors = {k: v for k, v in start.items() if ".lora_" in k}
    assert factors and all(torch.count_nonzero(v) == 0 for k, v in factors.items() if ".lora_B." in k)
    assert all(torch.count_nonzero(v) == v.numel() for k, v in factors.items() if ".lora_A." in k)
    x = token_batch(3, 7)[0]
    torch.testing.assert_close(fresh.predict(x).logits, base.eval()(**x).logits, rtol=1e-5, atol=1e-6)
    reference = get_peft_model(type(base).from_pretrained(tmp_path / "base"), config)
    reference.load_state_dict(start)  # the same factors: the base tensors are the checkpoint's already
    assert_close(state, unsplit(reference))


def _meta_copy(model):
    with torch.device("meta"):
        return type(model)(model.config)


@pytest.mark.slow
def test_grouped_query_attention_runs_as_eager_runs_it():
    # Given no padding mask, eager Llama hands SDPA its key/value heads as they are (enable_gqa) and
    # is_causal; the capture does the same, instead of repeating k/v per query head against a built mask.
    # AdamW magnifies how small gradients round, so it shows any other grouping: bit for bit here.
    model = build_language_model("llama")
    heads = model.config.num_attention_heads // model.config.num_key_value_heads
    assert heads > 1
    graph = partitioners.trace_for_training(model, token_batch(2, 0)[0], False)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    calls = [dict(zip(names, n.args), **n.kwargs) for n in graph.module.graph.nodes
             if "scaled_dot_product" in str(n.target)]
    assert len(calls) == model.config.num_hidden_layers
    assert all(c.get("enable_gqa") and c.get("is_causal") and c.get("attn_mask") is None for c in calls), calls

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3)
    expected = unsplit(build_language_model("llama"), adamw)
    for stages in (2, 4):
        assert_close(piped(build_language_model("llama"), stages, optimizer=adamw).state_dict(), expected)

"""initial_tensors: each tensor of a model built on the meta device gets the value the model's initialisers give
it, from a random stream of its own, so any split of the names into stages gives the same bits."""
from __future__ import annotations

import math
from itertools import chain
from typing import Callable

import pytest
import torch
import torchvision
import transformers as hf
from torch import nn

from language_models import LANGUAGE_MODELS
from pipetrain.weights.initialise import InitialisationError, initial_tensors
from third_party_models import CASES

hf.logging.set_verbosity_error()

ON_META: dict[str, Callable[[], nn.Module]] = {
    "llama": LANGUAGE_MODELS["llama"],  # rotary inv_freq buffers, not persistent
    "gpt2": LANGUAGE_MODELS["gpt2"],  # lm_head tied to wte; attention and MLP rescale their child c_proj
    "t5": CASES["t5"].build,  # one embedding under four names
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),  # BatchNorm running statistics
}


def _on_meta(family: str) -> nn.Module:
    with torch.device("meta"):
        return ON_META[family]()


def _state_names(model: nn.Module) -> list[str]:
    """Every parameter and buffer name, aliases and non-persistent buffers included, in the model's order."""
    return [name for name, _ in chain(model.named_parameters(remove_duplicate=False),
                                      model.named_buffers(remove_duplicate=False))]


def _splits(names: list[str]) -> dict[str, list[list[str]]]:
    """Names split as stages would hold them: contiguous chunks, and every k-th name (tied names apart)."""
    def chunks(k: int) -> list[list[str]]:
        return [names[i * len(names) // k:(i + 1) * len(names) // k] for i in range(k)]
    return {"2 contiguous": chunks(2), "4 contiguous": chunks(4),
            "2 interleaved": [names[i::2] for i in range(2)], "4 interleaved": [names[i::4] for i in range(4)]}


def _differing(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    assert expected.keys() == got.keys()
    return [name for name in expected if not torch.equal(expected[name], got[name])]


@pytest.mark.parametrize("family", list(ON_META))
def test_any_split_of_the_names_gives_the_same_bits(family: str) -> None:
    model = _on_meta(family)
    names = _state_names(model)
    whole = initial_tensors(model, names, seed=5)
    for split, parts in _splits(names).items():
        assert sorted(chain(*parts)) == sorted(names)
        union = {}
        for part in parts:
            union.update(initial_tensors(model, part, seed=5))
        assert not _differing(whole, union), split


def test_the_seed_alone_decides_the_values() -> None:
    model = _on_meta("llama")
    names = _state_names(model)
    before = torch.get_rng_state()
    first = initial_tensors(model, names, seed=1)
    assert torch.equal(torch.get_rng_state(), before)  # the user's random stream goes on as if never called
    assert not _differing(first, initial_tensors(model, names, seed=1))
    drawn = {f"{prefix}.weight" for prefix, module in model.named_modules()
             if isinstance(module, (nn.Linear, nn.Embedding))}
    assert set(_differing(first, initial_tensors(model, names, seed=2))) == drawn  # norms and rotary are constants


def _pooled_std(tensors: list[torch.Tensor]) -> tuple[float, int]:
    values = torch.cat([t.detach().flatten() for t in tensors])
    return values.std().item(), values.numel()


def test_llama_follows_its_init() -> None:
    model = _on_meta("llama")
    made = initial_tensors(model, _state_names(model), seed=0)
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        assert (made[name].shape, made[name].dtype, made[name].device) == (tensor.shape, tensor.dtype,
                                                                           torch.device("cpu"))
        assert isinstance(made[name], nn.Parameter) == isinstance(tensor, nn.Parameter)
    materialised = LANGUAGE_MODELS["llama"]()
    for name in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
        assert torch.equal(made[name], materialised.get_buffer(name))
    norms = [name for name in made if name.endswith(("norm.weight", "layernorm.weight"))]
    assert len(norms) == 5 and all(torch.equal(made[n], torch.ones_like(made[n])) for n in norms)
    # Linear and Embedding weights are N(0, initializer_range): pooled over n values the sample std is off by
    # about 1/sqrt(2n) relative (under 1% here), so 10% is far outside chance; a wrong init (kaiming, std ~0.14)
    # is far outside 10%.
    std, n = _pooled_std([made[f"{prefix}.weight"] for prefix, module in model.named_modules()
                          if isinstance(module, (nn.Linear, nn.Embedding))])
    assert n > 5000 and std == pytest.approx(model.config.initializer_range, rel=0.1)


def test_gpt2_follows_its_init_parent_rescale_included() -> None:
    model = _on_meta("gpt2")
    made = initial_tensors(model, _state_names(model), seed=0)
    config = model.config
    for name, tensor in made.items():
        if name.endswith("bias"):  # Conv1D and LayerNorm biases
            assert torch.equal(tensor, torch.zeros_like(tensor)), name
        elif ".ln_" in name:
            assert torch.equal(tensor, torch.ones_like(tensor)), name
    # Sample stds as in the Llama test: over 2560 and 5120 values, 10% is over 7 standard errors.
    rescaled = [t for name, t in made.items() if name.endswith("c_proj.weight")]
    std, n = _pooled_std(rescaled)
    assert n == 2560 and std == pytest.approx(config.initializer_range / math.sqrt(2 * config.n_layer), rel=0.1)
    plain = [made[name] for name in ("transformer.wte.weight", "transformer.wpe.weight")]
    plain += [t for name, t in made.items() if name.endswith(("c_attn.weight", "c_fc.weight"))]
    std, n = _pooled_std(plain)
    assert n == 5120 and std == pytest.approx(config.initializer_range, rel=0.1)


def test_resnet18_follows_reset_parameters() -> None:
    model = _on_meta("resnet18")
    made = initial_tensors(model, _state_names(model), seed=0)
    for prefix, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            for leaf, value in (("weight", 1), ("bias", 0), ("running_mean", 0), ("running_var", 1),
                                ("num_batches_tracked", 0)):
                tensor = made[f"{prefix}.{leaf}"]
                assert torch.equal(tensor, torch.full_like(tensor, value)), f"{prefix}.{leaf}"
        elif isinstance(module, (nn.Conv2d, nn.Linear)):
            # kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); with n >= 4096 values the
            # largest magnitude falls below 0.95 of the bound with probability 0.95^n < 1e-90.
            weight = made[f"{prefix}.weight"]
            bound = 1 / math.sqrt(weight[0].numel())
            assert weight.numel() >= 4096 and 0.95 * bound <= weight.abs().max().item() <= bound, prefix
    assert made["fc.bias"].abs().max().item() <= 1 / math.sqrt(512)


def test_torch_modules_run_children_before_parents() -> None:
    with torch.device("meta"):
        attention = nn.MultiheadAttention(16, 2)
    made = initial_tensors(attention, _state_names(attention), seed=0)
    # MultiheadAttention._reset_parameters zeroes out_proj's bias after the Linear drew it uniformly.
    for name in ("in_proj_bias", "out_proj.bias"):
        assert torch.equal(made[name], torch.zeros(16 * (3 if name == "in_proj_bias" else 1))), name
    xavier_bound = math.sqrt(6 / (16 + 48))
    assert 0.95 * xavier_bound <= made["in_proj_weight"].abs().max().item() <= xavier_bound
    assert 0 < made["out_proj.weight"].abs().max().item() <= 1 / math.sqrt(16)


class Rotations(nn.Module):
    """Two orthogonal matrices: nn.init.orthogonal_ draws into a temporary and skips meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.empty(8, 8))
        self.second = nn.Parameter(torch.empty(8, 8))

    def reset_parameters(self) -> None:
        nn.init.orthogonal_(self.first)
        nn.init.orthogonal_(self.second)


def test_draws_into_temporaries_belong_to_the_tensor_they_make() -> None:
    with torch.device("meta"):
        model = Rotations()
    both = initial_tensors(model, ["first", "second"], seed=0)
    assert torch.equal(initial_tensors(model, ["second"], seed=0)["second"], both["second"])
    assert not torch.equal(both["first"], both["second"])
    for matrix in both.values():  # float32 QR: orthogonal to a few ulps
        assert torch.allclose(matrix @ matrix.T, torch.eye(8), atol=1e-5)


def test_tied_names_are_one_tensor() -> None:
    gpt2 = _on_meta("gpt2")
    made = initial_tensors(gpt2, _state_names(gpt2), seed=3)
    head = made["lm_head.weight"]
    assert head is made["transformer.wte.weight"] and isinstance(head, nn.Parameter) and head.requires_grad
    # one alias asked alone: the same stream (keyed by the first name), so the same values
    assert torch.equal(initial_tensors(gpt2, ["lm_head.weight"], seed=3)["lm_head.weight"], head)
    t5 = _on_meta("t5")
    names = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"]
    made = initial_tensors(t5, names, seed=3)
    assert len({id(made[name]) for name in names}) == 1


def test_the_model_is_left_as_it_was() -> None:
    model = _on_meta("llama")
    names = _state_names(model)
    before = dict(chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    from_meta = initial_tensors(model, names, seed=4)
    after = dict(chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)))
    assert before.keys() == after.keys() and all(after[n] is before[n] and after[n].is_meta for n in names)
    # Partly real: real tensors are treated like meta ones, neither read nor written.
    model.model.embed_tokens.to_empty(device="cpu")
    embedding = model.model.embed_tokens.weight
    with torch.no_grad():
        embedding.fill_(7.0)
    assert not _differing(from_meta, initial_tensors(model, names, seed=4))
    assert model.model.embed_tokens.weight is embedding and torch.equal(embedding, torch.full_like(embedding, 7.0))


class Scaled(nn.Module):
    """A projection and a gain that nothing initialises (no reset_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))


class ForgetfulScaled(Scaled):
    """Its reset_parameters runs but forgets the gain."""

    def reset_parameters(self) -> None:
        self.proj.reset_parameters()


def test_a_tensor_nothing_initialises_is_named_with_the_fix() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled(), ForgetfulScaled())
    with pytest.raises(InitialisationError) as raised:
        initial_tensors(model, _state_names(model), seed=0)
    lines = str(raised.value).splitlines()[1:]
    assert lines == [
        "  '1.gain' of module '1' (Scaled): pass weights=<checkpoint> to wrap, or give Scaled a reset_parameters() "
        "method",
        "  '2.gain' of module '2' (ForgetfulScaled): pass weights=<checkpoint> to wrap, or make "
        "ForgetfulScaled.reset_parameters() initialise gain"]
    # only requested tensors count: the rest of the model initialises
    assert set(initial_tensors(model, ["1.proj.weight", "2.proj.bias"], seed=0)) == {"1.proj.weight", "2.proj.bias"}
    with pytest.raises(InitialisationError, match="no parameter or buffer named '1.scale'"):
        initial_tensors(model, ["1.scale"], seed=0)


def test_a_tensor_the_hugging_face_init_skips_is_named_with_the_fix() -> None:
    # LlamaModel is a Hugging Face model nested in LlamaForCausalLM: its _init_weights covers its subtree
    model = _on_meta("llama")
    model.model.layers[0].register_parameter("gate", nn.Parameter(torch.empty(3, device="meta")))
    with pytest.raises(InitialisationError, match=r"'model.layers.0.gate' of module 'model.layers.0' "
                                                  r"\(LlamaDecoderLayer\): pass weights=<checkpoint> to wrap, or make "
                                                  r"LlamaModel._init_weights initialise LlamaDecoderLayer.gate"):
        initial_tensors(model, ["model.layers.0.gate", "model.norm.weight"], seed=0)

"""Tiny Hugging Face, timm and torchvision models, built from configs (random weights, nothing downloaded),
with a batch and the loss each is trained with. Dropout is off in every config: the unsplit reference
cannot draw the random numbers the pipeline draws per stage (the runtime tests cover dropout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import timm
import torch
import torch.nn.functional as F
import torchvision
import transformers as hf

import pipetrain

VOCAB, SEQ, CLASSES, IMAGE = 64, 8, 5, 32
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Case:
    """A model to wrap as it is: how to build it, one batch (inputs, target) and its loss."""

    build: Callable[[], torch.nn.Module]
    batch: Callable[[int, int], tuple[Any, Any]]  # (samples, seed) -> (inputs, target)
    loss_fn: Callable = F.cross_entropy


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def classifier_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


def _ids(samples: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))


def causal_lm_batch(samples: int, seed: int) -> tuple[dict, torch.Tensor]:
    ids = _ids(samples, seed)
    return {"input_ids": ids}, ids


def own_loss_batch(samples: int, seed: int) -> tuple[dict, None]:
    """Labels among the inputs: the model computes its loss (loss_fn=pipetrain.model_loss)."""
    ids = _ids(samples, seed)
    return {"input_ids": ids, "labels": ids}, None


def classify_text_batch(samples: int, seed: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, SEQ - 3:] = 0  # padding in every other sample: the mask matters
    return {"input_ids": ids, "attention_mask": mask}, torch.randint(0, CLASSES, (samples,), generator=g)


def seq2seq_batch(samples: int, seed: int) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    decoder = torch.randint(0, VOCAB, (samples, SEQ // 2), generator=g)
    return {"input_ids": ids, "decoder_input_ids": decoder}, decoder


def image_batch(samples: int, seed: int, size: int = IMAGE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(samples, 3, size, size, generator=g),
            torch.randint(0, CLASSES, (samples,), generator=g))


def hf_image_batch(samples: int, seed: int) -> tuple[dict, torch.Tensor]:
    x, y = image_batch(samples, seed, 16)
    return {"pixel_values": x}, y


def _llama_like(config_cls, model_cls, **extra) -> torch.nn.Module:
    return model_cls(config_cls(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, **extra))


TRANSFORMERS = {
    # decoder-only, tied input embedding and head (GPT-2's wte.weight is lm_head.weight)
    "gpt2": Case(lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)), causal_lm_batch, lm_loss),
    # the same model computing its own loss from labels=
    "gpt2-labels": Case(lambda: hf.GPT2LMHeadModel(hf.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0)), own_loss_batch, pipetrain.model_loss),
    # decoder-only, untied head, rotary embeddings (non-persistent buffers), grouped-query attention
    "llama": Case(lambda: _llama_like(hf.LlamaConfig, hf.LlamaForCausalLM, tie_word_embeddings=False),
                  causal_lm_batch, lm_loss),
    "qwen2": Case(lambda: _llama_like(hf.Qwen2Config, hf.Qwen2ForCausalLM, tie_word_embeddings=True),
                  causal_lm_batch, lm_loss),
    "opt": Case(lambda: hf.OPTForCausalLM(hf.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=16, dropout=0.0, attention_dropout=0.0)),
        causal_lm_batch, lm_loss),
    # encoder-only classifiers with an attention mask
    "bert": Case(lambda: hf.BertForSequenceClassification(hf.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=CLASSES, **NO_DROPOUT)), classify_text_batch, classifier_loss),
    "roberta": Case(lambda: hf.RobertaForSequenceClassification(hf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=40, num_labels=CLASSES, pad_token_id=1, **NO_DROPOUT)),
        classify_text_batch, classifier_loss),
    # encoder-decoder: one embedding shared by encoder, decoder and head (four names)
    "t5": Case(lambda: hf.T5ForConditionalGeneration(hf.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0)), seq2seq_batch, lm_loss),
    # vision transformer
    "vit": Case(lambda: hf.ViTForImageClassification(hf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, num_labels=CLASSES, **NO_DROPOUT)), hf_image_batch, classifier_loss),
}

VISION = {
    # residual, nn.BatchNorm2d
    "torchvision-resnet18": Case(lambda: torchvision.models.resnet18(num_classes=CLASSES), image_batch),
    # depthwise convolutions, squeeze-excitation, hardswish
    "torchvision-mobilenet_v3_small": Case(lambda: torchvision.models.mobilenet_v3_small(
        num_classes=CLASSES, dropout=0.0),
                                           image_batch),
    # timm's BatchNormAct2d (F.batch_norm on its own buffers), depthwise, squeeze-excitation
    "timm-efficientnet_b0": Case(lambda: timm.create_model("efficientnet_b0", num_classes=CLASSES), image_batch),
    # BatchNormAct2d in a RegNet (grouped convolutions)
    "timm-regnetx_002": Case(lambda: timm.create_model("regnetx_002", num_classes=CLASSES), image_batch),
    # residual with timm's own layers
    "timm-resnet10t": Case(lambda: timm.create_model("resnet10t", num_classes=CLASSES), image_batch),
    # windowed attention with shifted windows and relative position bias
    "timm-swin": Case(lambda: timm.create_model(
        "swin_tiny_patch4_window7_224", img_size=IMAGE, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
        num_heads=(1, 2), drop_path_rate=0.0, num_classes=CLASSES), image_batch),
    # depthwise 7x7, LayerNorm2d, layer scale
    "timm-convnext": Case(lambda: timm.create_model(
        "convnext_atto", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_classes=CLASSES), image_batch),
    # timm's vision transformer: class token, position embedding
    "timm-vit": Case(lambda: timm.create_model(
        "vit_tiny_patch16_224", img_size=IMAGE, patch_size=8, embed_dim=16, depth=2, num_heads=2,
        num_classes=CLASSES), image_batch),
}

CASES = {**TRANSFORMERS, **VISION}


def build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return CASES[name].build()

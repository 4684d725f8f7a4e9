"""Tiny Hugging Face decoder language models, one builder per family (random weights, nothing downloaded).

Every config is as small as the family allows (hidden 16, 2 layers, 2 heads, vocabulary 64) with dropout
off: the unsplit reference cannot draw the random numbers the pipeline draws per stage. Two layers are
enough for 4 stages: torch.export gives one node per ATen call, so stage boundaries fall inside layers
too (rotary cos/sin, masks and residuals cross them). ``LANGUAGE_MODELS`` maps a family name to its
builder, for any test that wants a table of decoder families.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import transformers as hf

VOCAB, SEQ = 64, 8
_SIZE = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             max_position_embeddings=32)
_GQA = dict(_SIZE, num_key_value_heads=1)  # grouped-query attention where the family has it


def _gpt2() -> torch.nn.Module:
    return hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _opt() -> torch.nn.Module:
    return hf.OPTForCausalLM(hf.OPTConfig(vocab_size=VOCAB, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                          num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                          dropout=0.0, attention_dropout=0.0))


def _gpt_neox() -> torch.nn.Module:
    return hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**_SIZE, rotary_pct=0.5, hidden_dropout=0.0,
                                                  attention_dropout=0.0))


def _falcon() -> torch.nn.Module:
    return hf.FalconForCausalLM(hf.FalconConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                                num_attention_heads=2, num_kv_heads=1, new_decoder_architecture=True,
                                                hidden_dropout=0.0, attention_dropout=0.0))


def _gemma(config_cls, model_cls, **extra) -> Callable[[], torch.nn.Module]:
    # Gemma's default head_dim is 256 whatever the hidden size: set it to hidden / heads.
    return lambda: model_cls(config_cls(**_GQA, head_dim=8, **extra))


LANGUAGE_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    # Llama and its kin: rotary embeddings, RMSNorm computed in fp32, grouped-query attention
    "llama": lambda: hf.LlamaForCausalLM(hf.LlamaConfig(**_GQA, tie_word_embeddings=False)),
    "qwen2": lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**_GQA, tie_word_embeddings=True)),
    "qwen3": lambda: hf.Qwen3ForCausalLM(hf.Qwen3Config(**_GQA, head_dim=8)),  # q/k RMSNorm
    "mistral": lambda: hf.MistralForCausalLM(hf.MistralConfig(**_GQA, head_dim=8)),
    "gemma": _gemma(hf.GemmaConfig, hf.GemmaForCausalLM),  # embeddings scaled by sqrt(hidden), (1 + w) norm
    "phi3": lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**_GQA, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                                     attention_dropout=0.0)),  # fused qkv and gate_up
    "gpt-neox": _gpt_neox,  # partial rotary, parallel residual
    "falcon": _falcon,  # LayerNorm, multi-query attention
    "gpt2": _gpt2,  # learned positions, tied head
    "opt": _opt,
    # more decoder families; gemma2: soft-capped attention and logits, sliding window, four norms per layer
    "gemma2": _gemma(hf.Gemma2Config, hf.Gemma2ForCausalLM, sliding_window=4, query_pre_attn_scalar=8),
    "olmo2": lambda: hf.Olmo2ForCausalLM(hf.Olmo2Config(**_GQA)),  # RMSNorm of the bf16 q/k projections
    "cohere": lambda: hf.CohereForCausalLM(hf.CohereConfig(**_GQA)),  # interleaved rotary, parallel block
}


def build_language_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Family ``name`` with the weights seed ``seed`` draws."""
    torch.manual_seed(seed)
    return LANGUAGE_MODELS[name]()


def token_batch(samples: int, seed: int) -> tuple[dict, torch.Tensor]:
    """Random token ids as keyword inputs, and the same ids as next-token targets."""
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}, ids


def lm_loss(out, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits against the targets, every position weighted alike."""
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())  # fp32 whatever the autocast

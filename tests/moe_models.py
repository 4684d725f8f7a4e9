"""Tiny mixture-of-experts language models from transformers configs (random weights, nothing downloaded).

``MOE`` maps a name to a builder ``(layers, **config overrides) -> model``: Mixtral (top-2 of 4 experts),
Qwen2-MoE (a gated shared expert beside the routed ones, a dense MLP layer among the sparse ones) and
Qwen3-MoE (normalised top-k weights). Each routes a token by ``topk`` over a softmax, groups the tokens
per expert by sorting the integer expert indices and counting them (a float histogram turned into
int32 offsets), and with ``output_router_logits=True`` and ``labels`` returns the load-balancing loss
in ``out.loss``. Dropout is off (the unsplit reference cannot draw the pipeline's random numbers).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import transformers as hf

VOCAB, SEQ = 64, 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=32, num_experts_per_tok=2, attention_dropout=0.0)


def _mixtral(layers: int, **overrides: Any) -> torch.nn.Module:
    return hf.MixtralForCausalLM(hf.MixtralConfig(**{**_COMMON, "num_hidden_layers": layers, "intermediate_size": 32,
                                                     "num_local_experts": 4, **overrides}))


def _qwen2_moe(layers: int, **overrides: Any) -> torch.nn.Module:
    return hf.Qwen2MoeForCausalLM(hf.Qwen2MoeConfig(**{
        **_COMMON, "num_hidden_layers": layers, "intermediate_size": 32, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 32, "num_experts": 4, "mlp_only_layers": [1], **overrides}))


def _qwen3_moe(layers: int, **overrides: Any) -> torch.nn.Module:
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(**{
        **_COMMON, "num_hidden_layers": layers, "intermediate_size": 32, "moe_intermediate_size": 16,
        "num_experts": 4, "norm_topk_prob": True, "head_dim": 8, **overrides}))


MOE: dict[str, Callable[..., torch.nn.Module]] = {"mixtral": _mixtral, "qwen2-moe": _qwen2_moe,
                                                  "qwen3-moe": _qwen3_moe}


def build(name: str, layers: int = 4, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``MOE[name]`` with ``layers`` decoder layers, its weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return MOE[name](layers, **overrides)


def token_batch(samples: int, seed: int) -> torch.Tensor:
    """Random token ids, ``samples`` x SEQ."""
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))

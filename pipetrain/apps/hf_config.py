"""Hugging Face causal language models built from their config alone, on the meta device.

`pipetrain plan` sizes a 7 B or 70 B model this way: the model has shapes and dtypes and no data, so
nothing is allocated, and nothing is downloaded (the config is a local config.json or the default config
of a transformers model type).
"""
from __future__ import annotations

import os

import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_SEQ_LEN = 2048
EXAMPLE_SAMPLES = 2  # the example input's batch, as pipetrain plan's other models


def find_config(spec: str) -> transformers.PretrainedConfig | None:
    """The config ``spec`` names: a config.json, a directory holding one, or a transformers model type
    (``llama``, ``gpt2``: its default config); None when it names none of these."""
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"directory {spec!r} holds no config.json; fix: pass a directory a Hugging Face "
                                    "model or config was saved to (save_pretrained), or the config.json itself")
        return _read_config(path)
    if os.path.isfile(spec):
        return _read_config(spec)
    if spec in CONFIG_MAPPING:
        return transformers.AutoConfig.for_model(spec)
    return None


def _read_config(path: str) -> transformers.PretrainedConfig:
    try:
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # bad JSON, no model_type, a failed validation: transformers raises many types
        raise ValueError(f"{path} is not a config.json transformers can read: {type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0]}; fix: pass the config.json a Hugging Face model "
                         "was saved with (it names its model_type)") from None


def causal_lm_class(config: transformers.PretrainedConfig) -> type[nn.Module]:
    """The class that builds ``config``'s language model: the causal-LM auto class's, else the first of
    ``config.architectures`` (a model type the auto class does not list)."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    named = [getattr(transformers, name, None) for name in config.architectures or ()]
    found = [cls for cls in named if cls is not None]
    if not found:
        raise ValueError(f"transformers has no causal language model for model type {config.model_type!r} and its "
                         f"config names no architecture transformers has ({config.architectures}); fix: plan a "
                         "decoder language model (llama, gpt2, mistral, qwen2, ...) or set \"architectures\" in "
                         "its config.json")
    return found[0]


def build_on_meta(config: transformers.PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """``config``'s language model on the meta device, its parameters in ``dtype``: shapes, no data."""
    cls = causal_lm_class(config)
    with torch.device("meta"):
        # _from_config is the constructor the auto classes call: it builds under `dtype`.
        return cls._from_config(config, dtype=dtype)


def example_tokens(config: transformers.PretrainedConfig, seq_len: int | None) -> torch.Tensor:
    """Token ids of EXAMPLE_SAMPLES samples of ``seq_len`` tokens (default DEFAULT_SEQ_LEN, or the
    model's longest sequence when that is shorter)."""
    longest = getattr(config, "max_position_embeddings", None)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, longest) if isinstance(longest, int) else DEFAULT_SEQ_LEN
    elif seq_len < 1:
        raise ValueError(f"--seq-len must be at least 1 token, got {seq_len}")
    elif isinstance(longest, int) and seq_len > longest:
        raise ValueError(f"--seq-len {seq_len} is longer than the {longest} positions {config.model_type!r} "
                         f"has (max_position_embeddings); fix: --seq-len {longest} or less")
    return torch.zeros(EXAMPLE_SAMPLES, seq_len, dtype=torch.long)

"""A PEFT model's adapters (LoRA), read at ``wrap``: what ``save_pretrained`` writes of them, and the base
model's weights with them merged.

A PEFT model's state names are the base model's under a prefix (``base_model.model.``), with each adapted
layer's own weight under ``base_layer`` beside its ``lora_A``/``lora_B``. Written as they are, they load into
nothing: peft reads ``adapter_config.json`` and ``adapter_model.safetensors`` (its own names, which peft's
``get_peft_model_state_dict`` gives), and ``from_pretrained`` of the base class reads the base names.
Nothing here holds a tensor: the layout is names and scalings; the tensors come from the stages at save.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_BASE = ".base_layer"


@dataclass(frozen=True)
class AdapterLayout:
    """A PEFT model's active adapter: its config, its tensors' names in peft's files, and per LoRA layer
    (its module path) the scaling and whether its weight is stored transposed (fan_in_fan_out)."""

    config: Any                           # the adapter's PeftConfig: adapter_config.json
    adapter: str                          # the adapter's name ("default")
    saved_names: dict[str, str]           # state name -> name in adapter_model.safetensors
    lora: dict[str, tuple[float, bool]]   # LoRA layer path -> (scaling, fan_in_fan_out)
    prefix: str                           # what the base model's names are under
    base_class: type                      # the base model's class (what a merged directory loads into)

    @classmethod
    def of(cls, model: nn.Module) -> AdapterLayout | None:
        """The layout of ``model`` if it is a PEFT model (None otherwise). Adapters other than LoRA, and DoRA, are
        refused: their merge is not a sum of two factors."""
        if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
            return None
        from peft.tuners.lora import LoraLayer  # a PEFT model: peft is installed
        from peft.utils import get_peft_model_state_dict

        adapter = model.active_adapter
        config = model.peft_config[adapter]
        if type(config).__name__ != "LoraConfig" or getattr(config, "use_dora", False):
            raise ValueError(f"pipetrain trains PEFT models with LoRA adapters; this one has a "
                             f"{type(config).__name__}{' with DoRA' if getattr(config, 'use_dora', False) else ''}, "
                             "whose saved form pipetrain does not write: use LoraConfig (use_dora=False)")
        state = model.state_dict()
        by_id = {id(t): name for name, t in state.items()}
        saved = {by_id[id(t)]: name for name, t in get_peft_model_state_dict(model, state_dict=state,
                                                                              adapter_name=adapter).items()}
        lora = {path: (float(m.scaling[adapter]), bool(m.fan_in_fan_out)) for path, m in model.named_modules()
                if isinstance(m, LoraLayer) and adapter in m.scaling}
        return cls(config, adapter, saved, lora, "base_model.model.", type(model.get_base_model()))

    def adapter_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of ``tensors`` (state names), the adapter's, under their names in adapter_model.safetensors."""
        return {self.saved_names[k]: t for k, t in tensors.items() if k in self.saved_names}

    @staticmethod
    def is_factor(name: str) -> bool:
        """Whether the state name ``name`` is a LoRA factor (A or B), not a base model's tensor."""
        return ".lora_A." in name or ".lora_B." in name

    def factors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Of ``tensors`` (state names), the LoRA factors (every rank needs all of them to merge its weights)."""
        return {k: t for k, t in tensors.items() if self.is_factor(k)}

    def merged(self, tensors: dict[str, torch.Tensor], factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` as the base model's: the adapter factors dropped, each adapted weight W replaced by
        W + scaling * B @ A (what peft's merge_and_unload computes), every name without the PEFT prefix."""
        out = {}
        for name, t in tensors.items():
            if self.is_factor(name):
                continue
            path = name[:-len(f"{_BASE}.weight")] if name.endswith(f"{_BASE}.weight") else None
            if path in self.lora:
                scaling, transposed = self.lora[path]
                a = factors[f"{path}.lora_A.{self.adapter}.weight"].to(t.device, torch.float32)
                b = factors[f"{path}.lora_B.{self.adapter}.weight"].to(t.device, torch.float32)
                delta = (b @ a) * scaling
                t = (t.float() + (delta.T if transposed else delta)).to(t.dtype)
            out[self.base_name(name)] = t
        return out

    def base_name(self, name: str) -> str:
        """A state name as the base model names it."""
        return name.removeprefix(self.prefix).replace(f"{_BASE}.", ".")

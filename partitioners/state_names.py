"""A stage module's state under every name the original model gives it.

A stage holds the parameters and buffers its nodes read, under the name the capture used. The
original model may know the same tensor under more names (T5's ``shared.weight`` is also
``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and ``lm_head.weight``), and may
keep a buffer out of its state dict (``persistent=False``, e.g. rotary ``inv_freq``). Making the
stage say the same means every state dict built from stages (``Pipeline.state_dict``, checkpoints,
``export_state_dict``) loads into the original model with ``strict=True``.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn as nn


class StateNames:
    """The original model's alias groups and state-dict keys, read once."""

    def __init__(self, model: nn.Module):
        groups: dict[int, list[str]] = {}
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers(remove_duplicate=False))
        for name, t in itertools.chain(self.params.items(), self.buffers.items()):
            groups.setdefault(id(t), []).append(name)
        self.aliases = {name: names for names in groups.values() for name in names}
        self.persistent = set(model.state_dict(keep_vars=True))

    def hold_unread(self, stage: nn.Module, traced: nn.Module) -> None:
        """Give ``stage`` the model's state that no node of the capture ``traced`` reads (an unused
        head, a counter the forward never touches), so the stages together hold all of it."""
        read = {alias for name, _ in itertools.chain(traced.named_parameters(remove_duplicate=False),
                                                     traced.named_buffers(remove_duplicate=False))
                for alias in self.aliases.get(name, [name])}
        for name in self.persistent - read:
            if name in self.params:
                _register(stage, name, self.params[name], parameter=True)
            elif name in self.buffers:
                _register(stage, name, self.buffers[name], parameter=False)

    def apply(self, stage: nn.Module) -> None:
        """Register every alias of the stage's tensors and mark buffers the model keeps out of its
        state dict as non-persistent."""
        for name, t in list(stage.named_parameters(remove_duplicate=False)):
            for alias in self.aliases.get(name, ()):
                _register(stage, alias, t, parameter=True)
        for name, t in list(stage.named_buffers(remove_duplicate=False)):
            for alias in self.aliases.get(name, [name]):
                _register(stage, alias, t, parameter=False)
                owner, _, leaf = _owner(stage, alias)
                if alias not in self.persistent:
                    owner._non_persistent_buffers_set.add(leaf)


def _owner(root: nn.Module, name: str, create: bool = False) -> tuple[nn.Module, str, str]:
    """The submodule that holds attribute ``name``, its path and the attribute's own name."""
    path, _, leaf = name.rpartition(".")
    module = root
    for part in path.split(".") if path else ():
        child = getattr(module, part, None)
        if child is None and create:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, path, leaf


def _register(stage: nn.Module, name: str, t: torch.Tensor, parameter: bool) -> None:
    owner, _, leaf = _owner(stage, name, create=True)
    if getattr(owner, leaf, None) is t:
        return
    if parameter:
        owner.register_parameter(leaf, t)
    else:
        owner.register_buffer(leaf, t)

"""Several optimizers over disjoint parameters, stepped as one: Muon for a stage's matrices, AdamW for the rest.

`torch.optim.Muon` steps 2-D parameters only, so a model trained with it pairs it with another optimizer
(AdamW) for biases, normalisation scales and, as torch's documentation and Keller Jordan recommend, embeddings
and output heads. A pipeline stage has one optimizer; `CombinedOptimizer` is that one optimizer. Its
``param_groups`` are the inner optimizers' own group dicts (so a learning-rate scheduler, a delay correction or a
checkpoint load that changes a group changes the inner optimizer's rate) and its ``state`` routes each parameter
to its inner optimizer's state.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch import Tensor

from pipetrain.optim.closure import closure_loss


class _RoutedState(MutableMapping):
    """parameter -> its state in the inner optimizer that steps it (created there on first access, as a
    torch optimizer's ``defaultdict`` state is)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._owner = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self._optimizers = optimizers

    def owner(self, param: Tensor) -> torch.optim.Optimizer | None:
        """The inner optimizer that steps ``param`` (None: none does)."""
        return self._owner.get(id(param))

    def _state_of(self, param: Tensor) -> MutableMapping:
        owner = self.owner(param)
        if owner is None:
            raise KeyError("this parameter is stepped by none of the combined optimizers")
        return owner.state

    def __getitem__(self, param: Tensor) -> dict:
        return self._state_of(param)[param]

    def __setitem__(self, param: Tensor, value: dict) -> None:
        self._state_of(param)[param] = value

    def __delitem__(self, param: Tensor) -> None:
        del self._state_of(param)[param]

    def __contains__(self, param: object) -> bool:
        owner = self._owner.get(id(param))
        return owner is not None and param in owner.state

    def get(self, param: Tensor, default: Any = None) -> Any:
        # Without creating an entry, as defaultdict.get does not either.
        return self[param] if param in self else default

    def __iter__(self) -> Iterator[Tensor]:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class CombinedOptimizer(torch.optim.Optimizer):
    """Inner optimizers over disjoint parameters, acting as one ``torch.optim.Optimizer``.

    ``step`` steps each inner optimizer in turn; ``param_groups`` lists their groups (the same dicts) and
    ``state`` their per-parameter state; ``state_dict``/``load_state_dict`` hold one state dict per inner
    optimizer. Step hooks, ``zero_grad`` and learning-rate schedulers act on the combination. Pass it to
    ``pipetrain.wrap`` through a factory (``optimizer=lambda params: CombinedOptimizer([...])``); a factory
    returning a list or tuple of optimizers is combined by ``wrap`` the same way.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        optimizers = list(optimizers)
        if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
            raise TypeError("CombinedOptimizer takes a non-empty list of torch.optim.Optimizer instances, got "
                            f"{[type(o).__name__ for o in optimizers]}")
        seen: set[int] = set()
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    if id(p) in seen:
                        raise ValueError(f"CombinedOptimizer: a parameter of shape {tuple(p.shape)} is in two of the "
                                         "optimizers; give each parameter to exactly one")
                    seen.add(id(p))
        # Optimizer.__init__ sets up the step hooks and profiling; the groups it builds are then replaced by the
        # inner optimizers' own dicts, so whoever changes a group's lr changes the rate the inner step reads.
        super().__init__([{"params": [p for o in optimizers for g in o.param_groups for p in g["params"]]}], {})
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = _RoutedState(optimizers)  # type: ignore[assignment]

    def optimizer_of(self, param: Tensor) -> torch.optim.Optimizer:
        """The inner optimizer that steps ``param``."""
        owner = self.state.owner(param)
        if owner is None:
            raise ValueError("CombinedOptimizer: the parameter is stepped by none of the combined optimizers; pass a "
                             "parameter from optimizer.param_groups")
        return owner

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: a new group belongs to one of the inner optimizers."""
        if hasattr(self, "optimizers"):
            raise TypeError("CombinedOptimizer.add_param_group: add the group to the inner optimizer that should "
                            "step it (combined.optimizers[i].add_param_group) before combining them")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step every inner optimizer (the closure, if given, is evaluated once)."""
        loss = closure_loss(closure)
        for o in self.optimizers:
            o.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """One torch state dict per inner optimizer, in order."""
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load what `state_dict` returned (the same inner optimizers, in the same order)."""
        saved = state_dict.get("optimizers")
        if saved is None or len(saved) != len(self.optimizers):
            raise ValueError(f"CombinedOptimizer.load_state_dict: expected the state of {len(self.optimizers)} "
                             f"optimizers (CombinedOptimizer.state_dict()), got {0 if saved is None else len(saved)}")
        for o, s in zip(self.optimizers, saved):
            o.load_state_dict(s)
        # torch's load_state_dict makes new group dicts: point at them again.
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def combine(made: Any) -> Any:
    """An optimizer factory's result as one optimizer: a list or tuple of optimizers becomes a
    `CombinedOptimizer` (one optimizer is returned as it is; anything else is left to the caller to refuse)."""
    if isinstance(made, (list, tuple)) and made and all(isinstance(o, torch.optim.Optimizer) for o in made):
        return made[0] if len(made) == 1 else CombinedOptimizer(made)
    return made


def inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers that step: a combination's inner ones, or the optimizer itself."""
    return list(optimizer.optimizers) if isinstance(optimizer, CombinedOptimizer) else [optimizer]

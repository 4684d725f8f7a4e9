"""Optimizer state by parameter name instead of position, so a checkpoint loads into another stage count or
engine (re-partitioned); with ZeRO the replicas' shares are merged into one state by name: a tensor cut into
even slices (pipetrain.allreduce.slices) has its slices' state put together into the whole tensor's, and a
load cuts it again to the slice this replica steps."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from pipetrain.allreduce.local import local
from pipetrain.allreduce.slices import cut_state, source_of
from pipetrain.checkpoint.errors import CheckpointError
from pipetrain.optim.combined import CombinedOptimizer
from pipetrain.runtime.staleness.corrections import BASE_KEY


def param_names(module: torch.nn.Module) -> dict[int, str]:
    """The id of each parameter of ``module`` -> its name (the last alias of a tied one): the key it is saved under."""
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def optimizer_state_by_name(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> dict:
    """Optimizer state keyed by parameter name instead of position (survives re-partitioning). A ZeRO slice's
    state is this replica's share of its parameter's: ``slices`` says where it lies (name -> (start, shape))."""
    if optimizer is None:
        return {"state": {}, "groups": []}
    state, slices = {}, {}
    for g in optimizer.param_groups:
        for t in g["params"]:
            source = source_of(t)
            name = names[id(t if source is None else source[0])]
            if source is not None:  # the shape of what the slice was cut from: a tensor-parallel block, or whole
                slices[name] = (source[1], tuple(local(source[0]).shape))
            if t in optimizer.state:
                state[name] = optimizer.state[t]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "groups": groups, "class": optimizer_class(optimizer),
            **({"slices": slices} if slices else {})}


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class (a combination's with its inner optimizers' classes, in order)."""
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if isinstance(optimizer, CombinedOptimizer):
        name += f"[{', '.join(optimizer_class(o) for o in optimizer.optimizers)}]"
    return name


def merge_optimizer_shares(shares: list[dict]) -> dict:
    """One stage's optimizer state by name from the replicas' ZeRO shares (each holds the names it owns whole,
    or slices of them, put together here into the whole tensors' state)."""
    state = {name: value for share in shares for name, value in share["state"].items()
             if name not in share.get("slices", {})}
    cut: dict[str, list[tuple[int, tuple[int, ...], dict]]] = {}
    for share in shares:
        for name, (start, shape) in share.get("slices", {}).items():
            cut.setdefault(name, []).append((start, shape, share["state"].get(name, {})))
    state.update({name: _whole_state(name, parts) for name, parts in cut.items() if any(s for _, _, s in parts)})
    groups = next((share["groups"] for share in shares if share["groups"]), [])
    classes = [share["class"] for share in shares if "class" in share]  # a replica owning nothing has none
    return {"state": state, "groups": groups, **({"class": classes[0]} if classes else {})}


def _whole_state(name: str, parts: list[tuple[int, tuple[int, ...], dict]]) -> dict:
    """The state of parameter ``name`` from its slices' (start, the parameter's shape, the slice's state): per-element
    tensors laid side by side, step counts (equal in every slice: they step together) taken from the first."""
    parts = sorted(parts, key=lambda part: part[0])
    shape, states = parts[0][1], [s for _, _, s in parts]
    if any(s.keys() != states[0].keys() for s in states):
        raise RuntimeError(f"ZeRO save: the replicas' slices of {name!r} hold different optimizer state "
                           f"({[sorted(s) for s in states]}): the replicas stepped it differently; please report this")
    whole = {}
    for k, v in states[0].items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            whole[k] = torch.cat([s[k].reshape(-1) for s in states]).view(shape)
        else:
            whole[k] = v
    return whole


def load_optimizer_state(optimizer: torch.optim.Optimizer | None, by_name: dict[str, dict],
                         groups: list[dict], names: dict[int, str]) -> None:
    """Put each parameter's saved state back, by name (cut to the slice a ZeRO replica steps); hyper-parameters
    (every group key) from the saved groups."""
    if optimizer is None:
        return
    for g, saved in zip(optimizer.param_groups, groups):
        g.update(saved)  # every key, as Optimizer.load_state_dict (a scheduler's initial_lr among them)
    for g in optimizer.param_groups:
        for t in g["params"]:
            source = source_of(t)
            state = by_name.get(names[id(t if source is None else source[0])])
            if state is not None and source is not None:
                state = cut_state(state, source[1], source[1] + t.numel())
            if state is not None:
                optimizer.state[t] = {k: _owned(v, t.device) for k, v in state.items()}


def _owned(value: Any, device: torch.device) -> Any:
    """A saved optimizer value in memory of its own, not in the memory-mapped stage file (retention deletes
    it later): per-parameter tensors on the parameter's device, scalars (Adam's step) on the CPU."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, copy=True) if value.dim() > 0 else value.clone()


def check_optimizer(optimizer: torch.optim.Optimizer | None, saved_class: str | None, groups: list[dict],
                    source: Path) -> None:
    """Refuse a checkpoint whose optimizer state this optimizer cannot take. Hyper-parameters follow the
    checkpoint (an exact resume, as torch's Optimizer.load_state_dict): a factory's other value is named."""
    if optimizer is None or not groups:
        return
    mine = optimizer_class(optimizer)
    if saved_class is not None and saved_class != mine:
        raise CheckpointError(
            f"checkpoint {source} holds the state of a {saved_class} optimizer, but this pipeline's optimizer "
            f"factory makes a {mine}: its state cannot be resumed by another optimizer class. Fix: resume with "
            f"the optimizer the run used, or keep only the weights and start a fresh optimizer: "
            f"pipetrain.wrap(..., weights={str(source)!r})")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {source} has {len(groups)} optimizer parameter groups, this pipeline's optimizer has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups as the run that saved it, "
            f"or start from its weights only: pipetrain.wrap(..., weights={str(source)!r})")
    # A scheduler moves lr from initial_lr (the factory's): compare that, not the lr it has reached. Under
    # stage_momentum the momentum follows each stage's delay from the group's own values: compare those.
    start = lambda g: _as_built({**g, "lr": g.get("initial_lr", g.get("lr"))})  # noqa: E731
    changed = sorted({f"{k} {start(g)[k]!r} -> {start(saved)[k]!r}" for g, saved in zip(optimizer.param_groups, groups)
                      for k in saved if k in g and k not in ("params", "initial_lr")
                      and _differs(start(g)[k], start(saved)[k])})
    if changed:
        warnings.warn(f"resuming from {source}: the checkpoint's optimizer hyper-parameters replace the factory's "
                      f"({', '.join(changed)}), so the run goes on exactly as it was saved. To change one after "
                      "resuming, set it in held_stages[v].optimizer.param_groups after load()", stacklevel=4)


def _as_built(group: dict) -> dict:
    """A group with the values stage_momentum derived from replaced by those it was built with."""
    base = group.get(BASE_KEY)
    if base is None:
        return group
    if "beta1" in base:
        return {**group, "betas": (base["beta1"], group["betas"][1])}
    return {**group, **base}


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a != b

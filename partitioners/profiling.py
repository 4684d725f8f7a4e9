"""Per-node cost: measured forward/backward time, or a FLOP/byte estimate.

Both take the node as a callable plus the example values of its arguments, so
they work for modules, functions and methods alike. The values come from a forward with
autograd recording: an argument that requires grad there is differentiated here, no other.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

# Nominal device speeds for the estimate (profile=False). Only ratios between
# nodes matter for partitioning, so round numbers are enough.
PEAK_FLOPS = {"cpu": 1e11, "cuda": 1e13}
MEMORY_BANDWIDTH = {"cpu": 2e10, "cuda": 5e11}


def value_bytes(value: Any) -> int:
    """Bytes of every tensor inside value (0 for ints, None, ...)."""
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s storage, shared by its views; also on the meta device, whose tensors have no data
    pointer to tell them apart."""
    return t.untyped_storage()._cdata


def _is_view(out: Any, inputs: Any) -> bool:
    """True when every output tensor aliases an input (view, getitem, in-place): no data moved."""
    outs = _tensors(out)
    held = {storage_key(t) for t in _tensors(inputs)}
    return bool(outs) and all(storage_key(t) in held for t in outs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(args: Any, keep: set[int] = frozenset()) -> tuple[Any, list[torch.Tensor]]:
    """Copies of the argument tensors; those that require grad (in the traced training run) become
    grad leaves behind a clone (the clone keeps in-place ops from touching the leaf). The others stay
    out of autograd as in training: integer routing indices cannot require grad, and a floating
    value the model never differentiates (a histogram of expert counts) may feed an op that refuses
    a grad input (``cumsum(..., dtype=torch.int32)``). Tensors whose id is in ``keep`` (the model's
    parameters and buffers) are passed as they are: a buffer never requires grad."""
    leaves: list[torch.Tensor] = []

    def copy(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or id(v) in keep:
            return v
        if v.requires_grad:
            leaf = v.detach().requires_grad_(True)
            leaves.append(leaf)
            return leaf.clone()
        return v.detach().clone()

    return tree_map(copy, args), leaves


def measure(fn: Callable[..., Any], args: tuple, kwargs: dict, params: list[torch.Tensor],
            device: torch.device, repeats: int, keep: set[int] = frozenset()) -> tuple[float, float]:
    """Median forward and backward seconds of fn(*args, **kwargs) over `repeats` runs
    (arguments in ``keep``, the model's own tensors, are not copied)."""
    fwd: list[float] = []
    out: Any = None
    leaves: list[torch.Tensor] = []
    for rep in range(repeats + 1):  # the first run warms up and is not counted
        (a, k), leaves = _fresh((args, kwargs), keep)
        _sync(device)
        start = time.perf_counter()
        out = fn(*a, **k)
        _sync(device)
        if rep:
            fwd.append(time.perf_counter() - start)
    outs = [t for t in _tensors(out) if t.requires_grad]
    wrt = leaves + [p for p in params if p.requires_grad]
    if not outs or not wrt:
        return statistics.median(fwd), 0.0
    grads = [torch.ones_like(t) for t in outs]
    bwd: list[float] = []
    for rep in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        torch.autograd.grad(outs, wrt, grads, retain_graph=True, allow_unused=True)
        _sync(device)
        if rep:
            bwd.append(time.perf_counter() - start)
    return statistics.median(fwd), statistics.median(bwd)


def saved_activations(fn: Callable[..., Any], args: tuple, kwargs: dict, keep: set[int] = frozenset(),
                      weights: set[int] = frozenset()) -> tuple[int, list[int], bool]:
    """What autograd keeps of one call for its backward, by distinct storage (the arguments that require
    grad are grad leaves, as in ``measure``): the bytes of tensors the call creates and saves (neither an
    argument nor its output), the positions (``tree_flatten`` order of ``(args, kwargs)``) of the tensor
    arguments it saves, and whether it saves its output.
    The model's own tensors (ids in ``keep``, storages in ``weights``: parameters, buffers) are not counted."""
    flat, spec = tree_flatten((args, kwargs))
    copies: list[Any] = []
    position: dict[int, int] = {}
    for i, v in enumerate(flat):
        if isinstance(v, torch.Tensor) and id(v) not in keep:
            v = v.detach().requires_grad_(True).clone() if v.requires_grad else v.detach().clone()
            position[storage_key(v)] = i
        copies.append(v)
    own = set(weights)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[storage_key(t)] = max(saved.get(storage_key(t), 0), t.numel() * t.element_size())
        return t

    a, k = tree_unflatten(copies, spec)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*a, **k)
    outs = {storage_key(t) for t in _tensors(out)}
    internal = sum(b for key, b in saved.items() if key not in position and key not in outs and key not in own)
    return internal, sorted(position[key] for key in saved if key in position), bool(outs & set(saved) - set(position))


def _rnn_flops(module: torch.nn.Module, args: tuple) -> int:
    """FLOPs of an nn.RNN/LSTM/GRU: every weight matrix multiplies once per time step
    (FlopCounterMode does not see inside the fused CPU kernels)."""
    x = args[0]
    data = x.data if isinstance(x, torch.nn.utils.rnn.PackedSequence) else x
    tokens = data.shape[:-1].numel()
    weights = sum(p.numel() for n, p in module.named_parameters() if n.startswith("weight"))
    return 2 * weights * tokens


def estimate(fn: Callable[..., Any], args: tuple, kwargs: dict, module: torch.nn.Module | None,
             out: Any, param_bytes: int, device: torch.device, keep: set[int] = frozenset()
             ) -> tuple[float, float]:
    """Forward and backward seconds from counted FLOPs and bytes moved (no timing)."""
    if _is_view(out, (args, kwargs)) or not _tensors(out):
        return 0.0, 0.0
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        (a, k), _ = _fresh((args, kwargs), keep)
        fn(*a, **k)
    flops = counter.get_total_flops()
    if isinstance(module, torch.nn.RNNBase):
        flops = _rnn_flops(module, args)
    moved = value_bytes((args, kwargs)) + value_bytes(out) + param_bytes
    kind = "cuda" if device.type == "cuda" else "cpu"
    fwd = flops / PEAK_FLOPS[kind] + moved / MEMORY_BANDWIDTH[kind]
    # Backward computes input and weight gradients: about twice the forward work.
    needs_grad = any(t.requires_grad for t in _tensors(out))
    return fwd, (2.0 * fwd if needs_grad else 0.0)

"""Initial values for the tensors one pipeline stage holds, the same whatever the pipeline layout.

A model built on the meta device has shapes but no data, and each stage's process creates only its own
parameters and buffers. :func:`initial_tensors` gives each requested tensor the value the model's own
initialisers give it (a Hugging Face model's ``_init_weights``, otherwise each module's
``reset_parameters()``), drawn from a random stream of the tensor's own: its value depends on the seed
and its name only, so splitting the model into 1, 2, 4 or 8 stages gives every tensor the same bits.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from itertools import chain

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.weights.errors import InitialisationError

_META = torch.device("meta")


@dataclass
class _StateTensor:
    """One parameter or buffer under all its names, and the places the working copy holds it."""

    name: str  # its first name: keys its random stream, so aliases cannot change its value
    placeholder: torch.Tensor  # its meta stand-in in the working copy
    slots: list[tuple[dict, str]]  # (a module's _parameters or _buffers, key) for every alias


@dataclass
class _Initialiser:
    """The function that initialises one module of the working copy."""

    module: nn.Module
    run: Callable[[], object]
    hf_model: nn.Module | None  # the Hugging Face model whose _init_weights this is, if any


def initial_tensors(model: nn.Module, names: Iterable[str], seed: int) -> dict[str, torch.Tensor]:
    """New CPU tensors holding the initial values of the parameters and buffers ``names`` of ``model``.

    Each tensor is created with the shape, dtype and (for a Parameter) ``requires_grad`` of the model's,
    which may be on the meta device or real; the model is never modified. Aliases of one tensor (tied
    weights) map to one object. A module's initialiser is the nearest Hugging Face model's
    ``_init_weights(module)`` (a module with ``_init_weights`` and ``config``, the module itself or an
    ancestor), otherwise its ``reset_parameters()`` or ``_reset_parameters()``; initialisers run children
    before parents, as Hugging Face's ``initialize_weights`` does, so a parent may rescale a child's weight.

    Why one pass per tensor: in a deep copy of the module tree whose tensors are all meta, one pass makes
    only the requested tensor real and runs the initialisers of the modules whose subtree holds it, with
    every random draw that produces data seeded from (seed, the tensor's first name, how many such draws
    the pass made before). A shared pass with several real tensors could not attribute draws into
    temporaries to a tensor: ``nn.init.orthogonal_``, ``trunc_normal_`` and ``sparse_`` skip meta tensors
    and ``trunc_normal_`` redraws as often as its samples fall outside the bounds, so a count of temporaries
    per module would depend on which siblings are real, i.e. on the layout. A pass runs the few initialisers
    above the tensor (cheap on meta), so the time is the random draws plus milliseconds per hundred tensors;
    an initialiser that loops over a whole subtree (``nn.Transformer``'s) runs once per tensor of it.
    Everything runs on the CPU, so the values are the same whichever device the stage then moves them to;
    the global random state is restored afterwards.

    Raises InitialisationError naming the tensors no initialiser writes, and names the model lacks.
    """
    names = list(names)
    copy_root, by_name = _working_copy(model)
    wanted = _requested(by_name, names)
    chains = _initialiser_chains(copy_root, {id(entry.placeholder) for entry in wanted})
    created: dict[int, torch.Tensor] = {}
    unwritten: list[tuple[_StateTensor, list[_Initialiser]]] = []
    with torch.random.fork_rng(devices=[]), torch.no_grad(), _default_device_cpu():
        for entry in wanted:
            tensor = _blank_like(entry.placeholder, torch.device("cpu"))
            created[id(entry.placeholder)] = tensor
            initialisers = chains.get(id(entry.placeholder), [])
            if tensor.numel() and not _initialise(entry, tensor, initialisers, seed):
                unwritten.append((entry, initialisers))
    if unwritten:
        raise _unwritten_error(unwritten, copy_root)
    return {name: created[id(by_name[name].placeholder)] for name in names}


def _default_device_cpu() -> contextlib.AbstractContextManager:
    """Make tensors the initialisers create without a device (rotary frequencies) CPU tensors."""
    # The device context intercepts every tensor call; where the default already is the CPU it only costs.
    cpu = torch.device("cpu")
    return contextlib.nullcontext() if torch.get_default_device() == cpu else cpu


def _blank_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor like ``tensor`` on ``device``; a Parameter with its requires_grad for a Parameter."""
    blank = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return nn.Parameter(blank, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else blank


def _working_copy(model: nn.Module) -> tuple[nn.Module, dict[str, _StateTensor]]:
    """A deep copy of ``model`` whose parameters and buffers are meta stand-ins (allocating nothing), and
    every state name mapped to its tensor's entry."""
    stand_ins: dict[int, torch.Tensor] = {}
    first_names: dict[int, str] = {}
    for name, tensor in chain(model.named_parameters(remove_duplicate=False),
                              model.named_buffers(remove_duplicate=False)):
        first_names.setdefault(id(tensor), name)
        stand_ins[id(tensor)] = _blank_like(tensor, _META)
    # deepcopy takes a tensor found in the memo as already copied: the copy holds the stand-ins, tied
    # names share one, and the user's tensors are neither copied nor touched.
    copy_root = copy.deepcopy(model, memo=dict(stand_ins))
    entries = {id(stand_in): _StateTensor(first_names[key], stand_in, []) for key, stand_in in stand_ins.items()}
    by_name: dict[str, _StateTensor] = {}
    seen_slots: set[tuple[int, str]] = set()
    for prefix, module in copy_root.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is None:
                    continue
                entry = entries[id(tensor)]
                by_name[f"{prefix}.{key}" if prefix else key] = entry
                if (id(store), key) not in seen_slots:  # a module reached under two names has one slot
                    seen_slots.add((id(store), key))
                    entry.slots.append((store, key))
    return copy_root, by_name


def _requested(by_name: dict[str, _StateTensor], names: list[str]) -> list[_StateTensor]:
    """The distinct tensors behind ``names``, each once however many of its aliases are asked for."""
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise InitialisationError(
            f"the model has no parameter or buffer named {', '.join(map(repr, unknown))}: ask for names that "
            f"model.named_parameters(remove_duplicate=False) or model.named_buffers(remove_duplicate=False) list")
    return list({id(by_name[name].placeholder): by_name[name] for name in names}.values())


def _is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` initialises its submodules the Hugging Face way (``_init_weights`` and a config)."""
    return hasattr(module, "_init_weights") and hasattr(module, "config")


def _module_initialisers(root: nn.Module) -> list[_Initialiser]:
    """The initialiser of every module of ``root`` that has one, children before parents."""
    found: list[_Initialiser] = []
    visited: set[int] = set()

    def visit(module: nn.Module, name: str, hf_model: nn.Module | None) -> None:
        if id(module) in visited:
            return
        visited.add(id(module))
        if _is_hf_model(module):  # a nested Hugging Face model initialises its own subtree
            hf_model = module
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, hf_model)
        if hf_model is not None:
            run = partial(hf_model._init_weights, module)
        else:
            run = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if callable(run):
            found.append(_Initialiser(module, run, hf_model))
        lora = _lora_initialiser(module, root)
        if lora is not None:  # after the generic one: it overrides what that wrote in its factors
            found.append(_Initialiser(module, lora, None))

    visit(root, "", None)
    return found


# peft's LoRA initialisations that need no data: True (A as nn.Linear, B zeros: the adapted layer starts as
# the base one) and "gaussian". The others (PiSSA, OLoRA, LoftQ, EVA ...) compute the factors from the base
# weights or from data.
_LORA_INITS = (True, "gaussian")


def _lora_initialiser(module: nn.Module, root: nn.Module) -> Callable[[], object] | None:
    """A PEFT LoRA layer's own initialisation of its factors (``reset_lora_parameters``), as ``get_peft_model``
    ran it: the enclosing Hugging Face model's ``_init_weights`` would draw B at random, so that the adapted
    model would not start as the base model."""
    if not (hasattr(module, "reset_lora_parameters") and hasattr(module, "lora_A") and hasattr(root, "peft_config")):
        return None
    steps = []
    for adapter in module.lora_A:
        init = root.peft_config[adapter].init_lora_weights
        if init not in _LORA_INITS:
            raise InitialisationError(
                f"LoRA adapter {adapter!r} has init_lora_weights={init!r}, which computes its factors from the base "
                "weights or from data: pipetrain initialises a model built on the meta device from nothing but "
                "the seed; build the PEFT model from the loaded base model instead, or use init_lora_weights=True")
        steps.append(partial(module.reset_lora_parameters, adapter, init))
    return lambda: [step() for step in steps]


def _initialiser_chains(root: nn.Module, wanted: set[int]) -> dict[int, list[_Initialiser]]:
    """For each wanted tensor (by the id of its stand-in), the initialisers of the modules whose subtree
    holds it, children before parents."""
    chains: dict[int, list[_Initialiser]] = {}
    for initialiser in _module_initialisers(root):
        held = {id(t) for t in chain(initialiser.module.parameters(), initialiser.module.buffers())}
        for key in held & wanted:
            chains.setdefault(key, []).append(initialiser)
    return chains


def _initialise(entry: _StateTensor, tensor: torch.Tensor, initialisers: list[_Initialiser], seed: int) -> bool:
    """One pass: run ``initialisers`` with ``tensor`` in place of the entry's stand-in; whether any wrote it."""
    for store, key in entry.slots:
        store[key] = tensor
    stream = _TensorStream(seed, entry.name, tensor)
    try:
        with stream:
            for initialiser in initialisers:
                initialiser.run()
    except Exception as error:
        error.add_note(f"while initialising {entry.name!r}")
        raise
    finally:
        for store, key in entry.slots:
            store[key] = entry.placeholder
    return stream.wrote_target


class _TensorStream(TorchDispatchMode):
    """Seeds the CPU generator before every random draw that produces data from (seed, tensor name, draw
    count), and notes whether any operation writes into the target tensor's storage (through a view too)."""

    def __init__(self, seed: int, name: str, target: torch.Tensor) -> None:
        super().__init__()
        self._key = f"{seed}\0{name}\0"
        self._draws = 0
        self._target_storage = target.untyped_storage()._cdata
        self.wrote_target = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if torch.Tag.nondeterministic_seeded in func.tags:
            if not _on_meta(args, kwargs):
                # An explicit generator would share its stream across tensors, i.e. depend on the layout.
                kwargs.pop("generator", None)
                digest = hashlib.sha256(f"{self._key}{self._draws}".encode()).digest()
                torch.default_generator.manual_seed(int.from_bytes(digest[:8], "little"))
                self._draws += 1
            elif func._schema.name.endswith("_"):
                # A draw in place on meta does nothing: skip its slow Python decomposition, met once per pass
                # by an initialiser that loops over a whole subtree (nn.Transformer._reset_parameters).
                return args[0]
        if not self.wrote_target:
            self.wrote_target = any(t.untyped_storage()._cdata == self._target_storage
                                    for t in _written_tensors(func, args, kwargs))
        return func(*args, **kwargs)


def _on_meta(args: tuple, kwargs: dict) -> bool:
    """Whether an operation works on the meta device (so draws no random numbers)."""
    return kwargs.get("device") == _META or any(isinstance(a, torch.Tensor) and a.is_meta
                                                for a in chain(args, kwargs.values()))


_WRITTEN_ARGUMENTS: dict[torch._ops.OpOverload, tuple[tuple[int, str], ...]] = {}


def _written_tensors(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an ATen operation writes into: the arguments its schema marks as written (``Tensor(a!)``)."""
    if func not in _WRITTEN_ARGUMENTS:
        _WRITTEN_ARGUMENTS[func] = tuple((index, argument.name) for index, argument in enumerate(func._schema.arguments)
                                         if argument.alias_info is not None and argument.alias_info.is_write)
    written = []
    for index, name in _WRITTEN_ARGUMENTS[func]:
        value = args[index] if index < len(args) else kwargs.get(name)
        written.extend(t for t in (value if isinstance(value, (list, tuple)) else [value])
                       if isinstance(t, torch.Tensor))
    return written


def _unwritten_error(unwritten: list[tuple[_StateTensor, list[_Initialiser]]], root: nn.Module) -> InitialisationError:
    """The error naming the tensors no initialiser wrote, the modules holding them and how to fix it."""
    lines = []
    for entry, initialisers in unwritten:
        module_name, _, leaf = entry.name.rpartition(".")
        owner = root.get_submodule(module_name)
        owner_class = type(owner).__name__
        own = next((initialiser for initialiser in initialisers if initialiser.module is owner), None)
        if own is None:
            fix = f"give {owner_class} a reset_parameters() method"
        elif own.hf_model is not None:
            fix = f"make {type(own.hf_model).__name__}._init_weights initialise {owner_class}.{leaf}"
        else:
            fix = f"make {owner_class}.{own.run.__name__}() initialise {leaf}"
        lines.append(f"  {entry.name!r} of module {module_name or '<root>'!r} ({owner_class}): "
                     f"pass weights=<checkpoint> to wrap, or {fix}")
    return InitialisationError("no initialiser of the model writes these tensors, so they would hold "
                               "uninitialised memory:\n" + "\n".join(lines))

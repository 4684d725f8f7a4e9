"""The wire format of a boundary message: what a receiver must know to allocate its buffers (shape and dtype per
tensor, the value of anything else, the tree the values form) and the fixed-size header that carries it when
the two ends have not agreed on it yet (pipetrain.comm.agreed_shapes)."""
from __future__ import annotations

import functools
import pickle
from typing import Any

import torch
from torch.utils import _pytree as pytree

HEADER_BYTES = 1 << 16  # every header has this size: metadata that does not fit is refused


def describe(leaves: list) -> tuple:
    """What the receiver needs to allocate buffers: shape/dtype per tensor, the value otherwise."""
    return tuple(("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("v", v) for v in leaves)


@functools.cache
def list_spec(leaves: int) -> Any:
    """The spec of a list of ``leaves`` leaves, made once per length."""
    return pytree.tree_structure([0] * leaves)


def flatten(values: Any) -> tuple[list, Any]:
    """``pytree.tree_flatten``; a list of tensors (what a link usually carries) gets the spec of
    ``list_spec``, so agreeing on the same metadata again compares by identity."""
    if type(values) is list and all(isinstance(v, torch.Tensor) for v in values):
        return values, list_spec(len(values))
    return pytree.tree_flatten(values)


def encode_header(meta: tuple) -> torch.Tensor:
    """``meta`` (``describe``'s tuple and the tree spec) as a header: its pickled length, then the pickle."""
    described, spec = meta
    blob = pickle.dumps((described, pytree.treespec_dumps(spec)))
    if len(blob) + 8 > HEADER_BYTES:
        raise ValueError(f"boundary metadata of {len(blob)} bytes is too large; send fewer, larger tensors")
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor(list(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
    out[8:8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def decode_header(header: torch.Tensor) -> tuple:
    """The metadata ``encode_header`` wrote into ``header`` (a CPU tensor)."""
    n = int.from_bytes(bytes(header[:8].tolist()), "little")
    described, spec = pickle.loads(bytes(header[8:8 + n].numpy()))
    return described, pytree.treespec_loads(spec)

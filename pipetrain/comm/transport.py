"""Moving boundary values between stages: in one process, or over torch.distributed.

Both transports offer the same four calls, which the executor uses for every engine:
``send`` (non-blocking), ``post`` (announce a receive), ``ready`` (is it there? the
distributed transport waits until it is) and ``take``. A message is the list of values
on one link for one micro-batch: activations src -> dst, gradients dst -> src.
"""
from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.topology import ACT, GRAD, Link, Topology


class PeerFailure(RuntimeError):
    """Another rank of the pipeline died or stopped answering."""


COMM_KIND = {ACT: "activations", GRAD: "activation_grads"}
HEADER_BYTES = 1 << 16
SEND_WINDOW = 64  # sends kept before the oldest are waited on (DistributedTransport._prune)


class LocalTransport:
    """All stages in one process: a message is handed over as tensors moved to the receiver's device."""

    def __init__(self, devices: list[torch.device], counter: CommCounter):
        self.devices = devices  # per virtual stage
        self.messages: dict[tuple, list] = {}
        self.counter = counter

    def send(self, link: Link, kind: str, micro_batch: int, values: list, shape_key: Any = None) -> None:
        src, dst = (link.src, link.dst) if kind == ACT else (link.dst, link.src)
        self.counter.add(COMM_KIND[kind], src, payload_bytes(values))
        moved = pytree.tree_map(lambda v: v.detach().to(self.devices[dst]) if isinstance(v, torch.Tensor) else v, values)
        self.messages[(link.index, kind, micro_batch)] = moved

    def post(self, link: Link, kind: str, micro_batch: int, shape_key: Any = None) -> None:
        pass

    def ready(self, link: Link, kind: str, micro_batch: int) -> bool:
        return (link.index, kind, micro_batch) in self.messages

    def take(self, link: Link, kind: str, micro_batch: int) -> list:
        return self.messages.pop((link.index, kind, micro_batch))

    def flush(self) -> None:
        pass


def payload_bytes(values: Any) -> int:
    return sum(v.numel() * v.element_size() for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor))


def _describe(leaves: list) -> tuple:
    """What the receiver needs to allocate buffers: shape/dtype per tensor, the value otherwise."""
    return tuple(("t", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("v", v) for v in leaves)


class DistributedTransport:
    """Point-to-point over torch.distributed, one process group per link so that messages on
    different links never match each other's receives (NCCL ignores tags; FIFO holds per group).

    Shapes and dtypes are agreed once per (link, micro-batch size) with a header message and
    re-agreed when the size changes (a shorter last batch); ``dynamic_shapes`` sends a header
    with every message for models whose boundary shapes depend on the data.
    """

    def __init__(self, topology: Topology, rank_of: Callable[[int], int], groups: dict[int, Any],
                 device: torch.device, counter: CommCounter, dynamic_shapes: bool = False,
                 timeout: float = 30.0):
        self.topology = topology
        # Looked up for every message: evaluated once per stage here.
        self.rank_of = [rank_of(v) for v in range(topology.num_stages)].__getitem__
        self.groups = groups
        self.device = device
        self.dynamic_shapes = dynamic_shapes
        self.timeout = timedelta(seconds=timeout)
        self.rank = dist.get_rank()
        self.local = LocalTransport([device] * topology.num_stages, counter)
        self.counter = counter
        self.meta_sent: dict[tuple, tuple] = {}
        self.meta_received: dict[tuple, tuple] = {}
        self.pending_sends: list[tuple[Any, list]] = []
        self.posted: dict[tuple, tuple] = {}
        # Activation receives posted while a header on their link is still on its way: posted now,
        # they would match the payload that follows that header, so they wait until it is read.
        self.behind_header: dict[int, list[tuple[tuple, Any]]] = {}

    def _peer(self, link: Link, kind: str, sending: bool) -> int:
        src, dst = (link.src, link.dst) if kind == ACT else (link.dst, link.src)
        return self.rank_of(dst if sending else src)

    def _is_local(self, link: Link) -> bool:
        return self.rank_of(link.src) == self.rank_of(link.dst)

    def _shape_key(self, micro_batch: int, shape_key: Any) -> Any:
        return ("micro-batch", micro_batch) if self.dynamic_shapes else shape_key

    def send(self, link: Link, kind: str, micro_batch: int, values: list, shape_key: Any = None) -> None:
        if self._is_local(link):
            return self.local.send(link, kind, micro_batch, values)
        shape_key = self._shape_key(micro_batch, shape_key)
        src = link.src if kind == ACT else link.dst
        peer = self._peer(link, kind, sending=True)
        group = self.groups[link.index]
        ops = []
        if kind == ACT:
            leaves, spec = pytree.tree_flatten(values)
            meta = (_describe(leaves), spec)  # the spec is serialised only for a header
            key = (link.index, shape_key)
            if self.dynamic_shapes or key not in self.meta_sent:
                self.meta_sent[key] = meta
                ops.append(dist.P2POp(dist.isend, _encode_header(meta).to(self.device), peer, group))
            elif self.meta_sent[key] != meta:
                raise RuntimeError(
                    f"boundary values {link.names} from stage {link.src} to {link.dst} changed shape or "
                    f"value for the same micro-batch size ({self.meta_sent[key][0]} -> {meta[0]}); "
                    "models whose boundary shapes depend on the data need wrap(..., dynamic_shapes=True)")
            tensors = [v.contiguous() for v in leaves if isinstance(v, torch.Tensor)]
        else:
            tensors = [g.contiguous() for g in values]
        ops += [dist.P2POp(dist.isend, t, peer, group) for t in tensors]
        self.counter.add(COMM_KIND[kind], src, sum(t.numel() * t.element_size() for t in tensors))
        self.pending_sends.append((dist.batch_isend_irecv(ops), tensors))
        self._prune()

    def _prune(self) -> None:
        """Let go of sends that completed. gloo marks a send complete only once it is waited on, so an
        async-1f1b stream (never flushed) would otherwise keep every message it ever sent alive. Past
        SEND_WINDOW sends, the oldest are waited on: their receivers took them long ago, since a link
        holds only the few micro-batches in flight of a 1F1B schedule."""
        if len(self.pending_sends) <= SEND_WINDOW:
            return
        self.pending_sends = [(w, t) for w, t in self.pending_sends if not all(x.is_completed() for x in w)]
        while len(self.pending_sends) > SEND_WINDOW // 2:
            self._wait_sent(self.pending_sends.pop(0)[0])

    def _wait_sent(self, works: list) -> None:
        for w in works:
            try:
                w.wait(self.timeout)
            except RuntimeError as error:
                raise PeerFailure(f"rank {self.rank}: a send to another stage did not complete within "
                                  f"{self.timeout.total_seconds():g} s (the receiver died or hangs): {error}") from error

    def post(self, link: Link, kind: str, micro_batch: int, shape_key: Any = None) -> None:
        if self._is_local(link):
            return
        key = (link.index, kind, micro_batch)
        if key in self.posted:
            return
        shape_key = self._shape_key(micro_batch, shape_key)
        if kind == ACT and link.index in self.behind_header:
            self.posted[key] = ("deferred",)
            self.behind_header[link.index].append((key, shape_key))
            return
        self._post_now(link, kind, key, shape_key)

    def _post_now(self, link: Link, kind: str, key: tuple, shape_key: Any) -> None:
        peer = self._peer(link, kind, sending=False)
        group = self.groups[link.index]
        meta_key = (link.index, shape_key)
        if kind == ACT and (self.dynamic_shapes or meta_key not in self.meta_received):
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            work = dist.irecv(header, peer, group)
            self.posted[key] = ("header", work, header, meta_key)
            self.behind_header[link.index] = []
            return
        self.posted[key] = ("payload",) + self._post_payload(link, kind, meta_key, peer, group)

    def _post_payload(self, link, kind, meta_key, peer, group) -> tuple:
        # Gradients flow back along the link: the receiver of a gradient sent the activation.
        described, spec = (self.meta_received if kind == ACT else self.meta_sent)[meta_key]
        if kind == ACT:
            buffers = [torch.empty(d[1], dtype=d[2], device=self.device) for d in described if d[0] == "t"]
        else:
            buffers = [torch.empty(d[1], dtype=d[2], device=self.device)
                       for d in described if d[0] == "t" and d[2].is_floating_point]
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer, group) for b in buffers]) if buffers else []
        return works, buffers, (described, spec)

    def ready(self, link: Link, kind: str, micro_batch: int) -> bool:
        if self._is_local(link):
            return self.local.ready(link, kind, micro_batch)
        return True  # take() waits

    def take(self, link: Link, kind: str, micro_batch: int) -> list:
        if self._is_local(link):
            return self.local.take(link, kind, micro_batch)
        key = (link.index, kind, micro_batch)
        if key not in self.posted:
            raise RuntimeError(f"schedule error: {kind} of micro-batch {micro_batch} taken before it was received")
        entry = self.posted.pop(key)
        if entry[0] == "deferred":
            raise RuntimeError(f"schedule error: {kind} of micro-batch {micro_batch} taken before the activation "
                               f"received earlier on link {link.src}->{link.dst}; take messages in receive order")
        if entry[0] == "header":
            _, work, header, meta_key = entry
            self._wait(work, link, kind, micro_batch)
            self.meta_received[meta_key] = _decode_header(header.cpu())
            peer = self._peer(link, kind, sending=False)
            entry = ("payload",) + self._post_payload(link, kind, meta_key, peer, self.groups[link.index])
            waiting = self.behind_header.pop(link.index)
            for i, (later, later_shape) in enumerate(waiting):  # in posting order, before any newer receive
                self._post_now(link, ACT, later, later_shape)
                if link.index in self.behind_header:  # it needs a header too: the rest wait behind that one
                    self.behind_header[link.index] = waiting[i + 1:]
                    break
        _, works, buffers, (described, spec) = entry
        for w in works:
            self._wait(w, link, kind, micro_batch)
        if kind == GRAD:
            return buffers
        if spec.is_leaf():  # the common case of one tensor: no tree to rebuild
            return buffers[0] if described[0][0] == "t" else described[0][1]
        it = iter(buffers)
        leaves = [next(it) if d[0] == "t" else d[1] for d in described]
        return pytree.tree_unflatten(leaves, spec)

    def _wait(self, work: Any, link: Link, kind: str, micro_batch: int) -> None:
        """Wait for a receive; a dead or hung peer becomes an error that names it, within the timeout."""
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            src, dst = (link.src, link.dst) if kind == ACT else (link.dst, link.src)
            what = "activations" if kind == ACT else "gradients"
            raise PeerFailure(
                f"stage {dst} (rank {self.rank}) got no {what} of micro-batch {micro_batch} from stage {src} "
                f"(rank {self.rank_of(src)}) within {self.timeout.total_seconds():g} s: rank {self.rank_of(src)} "
                f"died or hangs; see its log (raise wrap(..., timeout=...) for very slow stages). "
                f"Transport said: {error}") from error

    def flush(self) -> None:
        """Wait until every send this rank posted has completed."""
        for works, _ in self.pending_sends:
            self._wait_sent(works)
        self.pending_sends.clear()
        if self.dynamic_shapes:  # per-micro-batch metadata is only needed within a step
            self.meta_sent.clear()
            self.meta_received.clear()


def _encode_header(meta: tuple) -> torch.Tensor:
    described, spec = meta
    blob = pickle.dumps((described, pytree.treespec_dumps(spec)))
    if len(blob) + 8 > HEADER_BYTES:
        raise ValueError(f"boundary metadata of {len(blob)} bytes is too large; send fewer, larger tensors")
    out = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    out[:8] = torch.tensor(list(len(blob).to_bytes(8, "little")), dtype=torch.uint8)
    out[8:8 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return out


def _decode_header(header: torch.Tensor) -> tuple:
    n = int.from_bytes(bytes(header[:8].tolist()), "little")
    described, spec = pickle.loads(bytes(header[8:8 + n].numpy()))
    return described, pytree.treespec_loads(spec)

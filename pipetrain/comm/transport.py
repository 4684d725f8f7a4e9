"""Moving boundary values between stages: in one process, or over torch.distributed.

Both transports offer the same calls, which the executor uses for every engine: ``exchange``
(post one comm batch of sends and receives between positions, non-blocking), ``hand_over`` (a link
inside one position, delivered in memory), ``ready`` (is it there? the distributed transport waits
until it is), ``take`` and ``flush``. A message is the list of values
on one link for one micro-batch: activations src -> dst, gradients dst -> src.
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pipetrain.comm import recording
from pipetrain.comm.agreed_shapes import KEPT_SHAPES, AgreedShapes
from pipetrain.comm.compile_grace import CompileGrace
from pipetrain.comm.failures import PeerFailure
from pipetrain.comm.wire import HEADER_BYTES, decode_header, describe, encode_header, flatten, list_spec
from pipetrain.runtime import host_sync
from pipetrain.runtime.devices import to_device
from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.topology import ACT, GRAD, Link, Message, Topology
from schedules.nccl_order import Op, link_comm

if TYPE_CHECKING:
    from pipetrain.tensor_parallel import Lanes


COMM_KIND = {ACT: "activations", GRAD: "activation_grads"}
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
        moved = to_device(pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, values),
                          self.devices[dst])
        self.messages[(link.index, kind, micro_batch)] = moved

    def hand_over(self, link: Link, kind: str, micro_batch: int, values: list) -> None:
        """A link inside one position: handed over as every message is in one process."""
        self.send(link, kind, micro_batch, values)

    def exchange(self, messages: list[Message], ahead: Sequence[Message] = ()) -> None:
        """Deliver the sends of one comm batch at once (a receive needs no posting in one process,
        ``ahead`` ones neither)."""
        for m in messages:
            if m.values is not None:
                self.send(m.link, m.kind, m.micro_batch, m.values)

    def ready(self, link: Link, kind: str, micro_batch: int) -> bool:
        return (link.index, kind, micro_batch) in self.messages

    def take(self, link: Link, kind: str, micro_batch: int) -> list:
        return self.messages.pop((link.index, kind, micro_batch))

    def flush(self) -> None:
        pass

    def deliver(self, taken: Callable[[Link, str, int], bool]) -> None:
        """In one process a send is complete once made."""

    def abandon(self) -> None:
        """A step raised: drop the messages nobody will take (their micro-batch numbers come again)."""
        self.messages.clear()


def payload_bytes(values: Any) -> int:
    return sum(v.numel() * v.element_size() for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor))


class DistributedTransport:
    """Point-to-point over torch.distributed, safe under NCCL's ordering rules by construction.

    Each ``exchange`` (one comm batch of the executor: everything between two computations) posts
    one ``batch_isend_irecv`` group per communicator, then one per communicator with the receives
    posted ahead, for the computation after the next (``schedules.nccl_order.posted_batches``, whose
    order ``schedules.nccl_order`` checks for every schedule). Receiving ahead, every direction of every
    link has a process group of its own; receiving at use, a link between adjacent stages of a one-chunk
    pipeline has one (a send and the receive its peer posts at the same point run in one kernel) and a
    skip connection or an interleaved pipeline's link one per direction (``link_comm``). Messages on
    different communicators never match each other's receives (NCCL ignores tags; FIFO holds per group).

    Shapes and dtypes are agreed once per (link, shape key) with a header message: the key is the
    shapes of the micro-batch's inputs, which every rank of the pipeline computes from the same
    mini-batch, so a new sequence length or micro-batch size costs one header per link and nothing is
    re-planned. ``dynamic_shapes`` sends a header with every activation for models whose boundary shapes
    depend on the data's values. A header travels in a group of its own just before its payload's
    group, and the receiver reads it at once (a host synchronisation, once per shape) to allocate the
    payload's buffers. A receive posted ahead whose shapes are not agreed yet is posted at the next
    exchange instead, its usual point: reading its header ahead would block the host until the peer
    sends it, which may wait for this rank's next result.
    """

    def __init__(self, topology: Topology, rank_of: Callable[[int], int], groups: dict[Hashable, Any],
                 device: torch.device, counter: CommCounter, dynamic_shapes: bool = False,
                 timeout: float = 30.0, receive_ahead: bool = True, lanes: Lanes | None = None,
                 grace: CompileGrace | None = None):
        self.topology = topology
        self.lanes = lanes
        # Looked up for every message: evaluated once per stage here.
        self.rank_of = [rank_of(v) for v in range(topology.num_stages)].__getitem__
        self.device = device
        self.dynamic_shapes = dynamic_shapes
        self.timeout = timedelta(seconds=timeout)
        self.grace = grace  # compile=: longer waits while a peer may be compiling (see comm.compile_grace)
        self.rank = dist.get_rank()
        self.local = LocalTransport([device] * topology.num_stages, counter)
        self.counter = counter
        self.agreed_sent = AgreedShapes(KEPT_SHAPES)
        self.agreed_received = AgreedShapes(KEPT_SHAPES)
        self.sent_meta: dict[tuple[int, int], tuple] = {}  # (link, micro-batch) -> activation meta, for its gradient
        # (its group, tensors kept alive, recorded ids, (link, kind, micro-batch) of the message)
        self.pending_sends: list[tuple[_Posted, list, list, tuple[Link, str, int], timedelta]] = []
        # (link, kind, micro-batch) -> (its group, buffers, meta, recorded ids, how long to wait for it)
        self.posted: dict[tuple, tuple] = {}
        self.deferred: list[Message] = []  # receives to post ahead whose shapes were not agreed: due next exchange
        self.recorder = recording.active()  # None unless a test records what is posted
        # gloo runs every op of a batch_isend_irecv group on its own (one work each): posting them one by one
        # gives the same works without the coalescing wrapper, 10 us of host time per group. Any other
        # backend (NCCL, a mixed "cpu:gloo,cuda:nccl") gets its groups as the ordering checker models them.
        self.one_by_one = dist.get_backend() == "gloo"
        # Per link: whether both ends are this rank, and per direction (communicator, its process group from
        # ``groups``, the peer rank): looked up for every message, resolved once.
        self.local_links = {l.index: self.rank_of(l.src) == self.rank_of(l.dst) for l in topology.links}
        self.routes: dict[tuple[int, str], _Route] = {}
        chunks = topology.num_stages // topology.positions
        for l in topology.links:
            if not self.local_links[l.index]:
                for kind in (ACT, GRAD):
                    comm = link_comm(l.index, l.src, l.dst, kind, chunks, receive_ahead)
                    other = self.rank_of(l.dst) if self.rank_of(l.src) == self.rank else self.rank_of(l.src)
                    self.routes[(l.index, kind)] = _Route(comm, groups.get(comm), other)

    def _is_local(self, link: Link) -> bool:
        return self.local_links[link.index]

    def hand_over(self, link: Link, kind: str, micro_batch: int, values: list) -> None:
        """A link between two stages of this rank (one pipeline position): delivered in memory."""
        self.local.send(link, kind, micro_batch, values)

    def exchange(self, messages: list[Message], ahead: Sequence[Message] = ()) -> None:
        """Post the sends and receives of one comm batch (links between positions only: ``hand_over`` moves
        the others): per communicator a group of the headers where shapes must be agreed first, then one
        group with every payload whose shapes are known, then, once the headers are read, one with the
        payloads they announced, then one with the receives ``ahead`` whose shapes are agreed (the others
        wait for the next exchange)."""
        batch = _Batch()
        reads: list[tuple] = []  # header receives, read before their payload's buffers can exist
        due, self.deferred = [*messages, *self.deferred], []
        # Sends first: a gradient received in this batch may belong to an activation sent in it.
        for m in due:
            if m.values is not None:
                self._add_send(m, batch)
        for m in due:
            if m.values is None and (m.link.index, m.kind, m.micro_batch) not in self.posted:
                self._add_receive(m, batch, reads)
        for comm, group in batch.headers.items():
            self._post(comm, group)
        # Before any header is read (the host blocks there): the peer may need one of these sends before it
        # can send the header read here (two chunks on each of two ranks: each sends an activation of a new
        # shape and reads the header of the other's next one).
        for comm, group in batch.payloads.items():
            self._post(comm, group)
        for m, header, works, recorded in reads:
            self._wait(works, m.link, m.kind, m.micro_batch, recorded, self._limit(m))
            host_sync.note("shape header")
            meta = decode_header(header.cpu())
            if not self.dynamic_shapes:
                self.agreed_received.add(m.link.index, m.shape_key, meta)
            self.posted[(m.link.index, m.kind, m.micro_batch)] = self._add_payload_receive(m, meta, batch.announced)
        for m in ahead:  # after the reads: a header read above may have agreed their shapes
            meta = self._known_meta(m)
            if meta is None:
                self.deferred.append(m)
            else:
                self.posted[(m.link.index, m.kind, m.micro_batch)] = self._add_payload_receive(m, meta, batch.ahead)
        for comm, group in batch.announced.items():
            self._post(comm, group)
        for comm, group in batch.ahead.items():
            self._post(comm, group)
        self._prune()

    def _post(self, comm: Hashable, group: tuple[list, list, list]) -> None:
        p2p, recorded, works = group
        if self.recorder is not None:
            self.recorder.group(comm, recorded)
        if self.one_by_one:
            works.works.extend(op.op(op.tensor, op.peer, op.group, op.tag) for op in p2p)
        else:
            works.works.extend(dist.batch_isend_irecv(p2p))  # NCCL: one work for the group

    def _add_send(self, m: Message, batch: _Batch) -> None:
        link, kind = m.link, m.kind
        comm, group, peer = self.routes[(link.index, kind)]
        if kind == ACT:
            leaves, spec = flatten(m.values)
            meta = (describe(leaves), spec)  # the spec is serialised only for a header
            self.sent_meta[(link.index, m.micro_batch)] = meta
            agreed = None if self.dynamic_shapes else self.agreed_sent.get(link.index, m.shape_key)
            if agreed is None:
                if not self.dynamic_shapes:
                    self.agreed_sent.add(link.index, m.shape_key, meta)
                header = encode_header(meta).to(self.device)
                message = self._message("header", link, m.micro_batch)
                works = batch.add(batch.headers, comm, dist.P2POp(dist.isend, header, peer, group),
                                  self._op(True, peer, message))
                self.pending_sends.append((works, [header], self._recorded(message), (link, kind, m.micro_batch),
                                           self._limit(m)))
            elif agreed != meta:
                raise RuntimeError(
                    f"boundary values {link.names} from stage {link.src} to {link.dst} changed shape or "
                    f"value for the same input shapes ({agreed[0]} -> {meta[0]}): they depend on the data's "
                    "values; fix: wrap(..., dynamic_shapes=True)")
            tensors = [v.contiguous() for v in leaves if isinstance(v, torch.Tensor)]
        else:
            tensors = [g.contiguous() for g in m.values]
        if self.lanes is not None:  # tensor-parallel lanes each send 1/T of a whole value
            tensors = [self._lane_part(t) for t in tensors]
        message = self._message(kind, link, m.micro_batch)
        works = _Posted()
        for i, t in enumerate(tensors):
            works = batch.add(batch.payloads, comm, dist.P2POp(dist.isend, t, peer, group),
                              self._op(True, peer, message, i))
        src = link.src if kind == ACT else link.dst
        self.counter.add(COMM_KIND[kind], src, sum(t.numel() * t.element_size() for t in tensors))
        self.pending_sends.append((works, tensors, self._recorded(message, len(tensors)), (link, kind, m.micro_batch),
                                   self._limit(m)))

    def _known_meta(self, m: Message) -> tuple | None:
        """The metadata of a message to receive, or None when a header must bring it."""
        if m.kind == GRAD:  # gradients flow back along the link: the receiver of a gradient sent the activation
            return self.sent_meta.pop((m.link.index, m.micro_batch))
        return None if self.dynamic_shapes else self.agreed_received.get(m.link.index, m.shape_key)

    def _add_receive(self, m: Message, batch: _Batch, reads: list) -> None:
        meta = self._known_meta(m)
        if meta is None:
            comm, group, peer = self.routes[(m.link.index, m.kind)]
            header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
            message = self._message("header", m.link, m.micro_batch)
            works = batch.add(batch.headers, comm, dist.P2POp(dist.irecv, header, peer, group),
                              self._op(False, peer, message))
            reads.append((m, header, works, self._recorded(message)))
            return
        self.posted[(m.link.index, m.kind, m.micro_batch)] = self._add_payload_receive(m, meta, batch.payloads)

    def _add_payload_receive(self, m: Message, meta: tuple, table: dict) -> tuple:
        """Buffers for one message and their receives in ``table`` (of a ``_Batch``): (works, buffers,
        meta, recorded ids)."""
        link, kind = m.link, m.kind
        described, spec = meta
        wanted = (lambda d: d[0] == "t") if kind == ACT else (lambda d: d[0] == "t" and d[2].is_floating_point)
        buffers = [torch.empty(d[1], dtype=d[2], device=self.device) for d in described if wanted(d)]
        comm, group, peer = self.routes[(link.index, kind)]
        message = self._message(kind, link, m.micro_batch)
        works = _Posted()
        for i, b in enumerate(buffers):
            part = b if self.lanes is None else self._lane_part(b)
            works = _Batch.add(table, comm, dist.P2POp(dist.irecv, part, peer, group),
                               self._op(False, peer, message, i))
        return works, buffers, (described, spec), self._recorded(message, len(buffers)), self._limit(m)

    def _lane_part(self, t: torch.Tensor) -> torch.Tensor:
        """What crosses the link of ``t`` (a boundary value, whole and the same on every tensor-parallel lane): this
        lane's 1/T of its elements, which the receiving lanes all-gather (`_gather_lanes`), so the stages exchange
        each value once, not once per lane; ``t`` itself where its size does not divide."""
        if t.numel() == 0 or t.numel() % self.lanes.size:
            return t
        return t.view(-1).chunk(self.lanes.size)[self.lanes.rank]

    def _gather_lanes(self, buffers: list[torch.Tensor]) -> None:
        """Each buffer whole from the lanes' parts (a collective of the stage's lanes, which take their messages
        in the same order)."""
        for b in buffers:
            part = self._lane_part(b)
            if part is not b:
                dist.all_gather_into_tensor(b.view(-1), part.clone(), group=self.lanes.group)

    def _op(self, send: bool, peer: int, message: tuple, part: int | None = None) -> Op | None:
        """The op a recording test replays (part: which tensor of a payload); None when nothing records."""
        if self.recorder is None:
            return None
        return Op(send, peer, message if part is None else message + (part,))

    def _recorded(self, message: tuple, parts: int | None = None) -> list:
        """The recorded ids of a message's ``parts`` tensors (None: a header, recorded under the message's id)."""
        if self.recorder is None:
            return []
        return [message] if parts is None else [message + (i,) for i in range(parts)]

    def _message(self, kind: str, link: Link, micro_batch: int) -> tuple:
        """The id a message is recorded under (recording numbers messages, as micro-batch ids repeat)."""
        if self.recorder is None:
            return (kind, link.index, micro_batch)
        return self.recorder.message_id(kind, link.index, micro_batch)

    def _prune(self) -> None:
        """Let go of sends that completed. gloo marks a send complete only once it is waited on, so an
        async-1f1b stream (never flushed) would otherwise keep every message it ever sent alive. Past
        SEND_WINDOW sends, the oldest are waited on: their receivers took them long ago, since a link
        holds only the few micro-batches in flight of a 1F1B schedule. Called once a batch is posted: a
        group not posted yet has no works and would look complete, and a send whose works are dropped
        unwaited is lost on gloo (its receiver waits forever)."""
        if len(self.pending_sends) <= SEND_WINDOW:
            return
        self.pending_sends = [entry for entry in self.pending_sends if not entry[0].is_completed()]
        while len(self.pending_sends) > SEND_WINDOW // 2:
            self._wait_sent(self.pending_sends.pop(0))

    def _wait_sent(self, entry: tuple) -> None:
        works, _, recorded, _, limit = entry
        if self.recorder is not None and recorded:
            self.recorder.wait(recorded)
        try:
            works.wait(limit)
        except RuntimeError as error:
            raise PeerFailure(f"rank {self.rank}: a send to another stage did not complete within "
                              f"{limit.total_seconds():g} s (the receiver died or hangs): {error}") from error

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
        works, buffers, (described, spec), recorded, limit = self.posted.pop(key)
        self._wait(works, link, kind, micro_batch, recorded, limit)
        if self.lanes is not None:
            self._gather_lanes(buffers)
        if kind == GRAD:
            return buffers
        if spec.is_leaf():  # the common case of one tensor: no tree to rebuild
            return buffers[0] if described[0][0] == "t" else described[0][1]
        if len(buffers) == len(described) and spec is list_spec(len(described)):
            return buffers  # a list of tensors, as flatten found it

        it = iter(buffers)
        leaves = [next(it) if d[0] == "t" else d[1] for d in described]
        return pytree.tree_unflatten(leaves, spec)

    def _limit(self, m: Message) -> timedelta:
        """How long to wait for message ``m`` before calling its peer dead."""
        return self.timeout if self.grace is None else self.grace.timeout(m.shape_key)

    def _wait(self, works: _Posted, link: Link, kind: str, micro_batch: int, recorded: list,
              limit: timedelta) -> None:
        """Wait for the group of a receive; a dead or hung peer becomes an error that names it, within the timeout."""
        if self.recorder is not None and recorded:
            self.recorder.wait(recorded)
        try:
            works.wait(limit)
        except RuntimeError as error:
            src, dst = (link.src, link.dst) if kind == ACT else (link.dst, link.src)
            what = "activations" if kind == ACT else "gradients"
            raise PeerFailure(
                f"stage {dst} (rank {self.rank}) got no {what} of micro-batch {micro_batch} from stage {src} "
                f"(rank {self.rank_of(src)}) within {limit.total_seconds():g} s: rank {self.rank_of(src)} "
                f"died or hangs; see its log (raise wrap(..., timeout=...) for very slow stages). "
                f"Transport said: {error}") from error

    def flush(self) -> None:
        """Wait until every send this rank posted has completed."""
        for entry in self.pending_sends:
            self._wait_sent(entry)
        self.pending_sends.clear()
        self.sent_meta.clear()  # a predict's activations get no gradient

    def deliver(self, taken: Callable[[Link, str, int], bool]) -> None:
        """Wait until the sends that their receivers will still ``taken(link, kind, micro_batch)`` have completed;
        leave the others. For a raise every rank takes at the same point of an async stream: on gloo a send
        whose work is dropped before its receiver posted the receive is lost, and the caller may drop this
        pipeline (or end the process) right after the raise, while its peers still need those messages to
        reach that point themselves."""
        kept = []
        for entry in self.pending_sends:
            if taken(*entry[3]):
                self._wait_sent(entry)
            else:
                kept.append(entry)
        self.pending_sends = kept

    def abandon(self) -> None:
        """A step raised: drop the messages between this rank's own stages. Sends and receives posted to
        other ranks stay: a peer may still take what was sent (an async stream's ranks raise one after the
        other), and a send dropped unfinished would never reach it. Receives not posted yet are dropped."""
        self.local.abandon()
        self.deferred.clear()


class _Route(NamedTuple):
    """Where the messages of one direction of a link go: communicator key, its process group, the peer rank."""

    comm: Hashable
    group: Any
    peer: int


class _Posted:
    """The works of one posted group, each waited on once: waiting twice for a completed gloo send
    waits for another send that never comes."""

    __slots__ = ("works",)

    def __init__(self):
        self.works: list = []

    def wait(self, timeout: timedelta) -> None:
        while self.works:
            self.works[0].wait(timeout)
            self.works.pop(0)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Batch:
    """The ops of one exchange by communicator, headers, payloads announced by headers read and receives
    ahead apart: (P2POps, recorded ops, its works once posted)."""

    def __init__(self):
        self.headers: dict[Hashable, tuple[list, list, _Posted]] = {}
        self.payloads: dict[Hashable, tuple[list, list, _Posted]] = {}
        self.announced: dict[Hashable, tuple[list, list, _Posted]] = {}  # payloads of the headers read
        self.ahead: dict[Hashable, tuple[list, list, _Posted]] = {}

    @staticmethod
    def add(table: dict, comm: Hashable, p2p: Any, op: Op | None) -> _Posted:
        """Add an op to ``comm``'s group in ``table`` (``op``: its record, None when nothing records); returns
        the group's works (filled on posting)."""
        group = table.get(comm) or table.setdefault(comm, ([], [], _Posted()))
        group[0].append(p2p)
        if op is not None:
            group[1].append(op)
        return group[2]



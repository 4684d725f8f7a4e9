"""Replaying posted point-to-point traffic under NCCL's model, to find the first stall.

gloo buffers and forgives; NCCL does not. The model replayed here is NCCL's worst case:

* A rank's program is a list of ``Group`` and ``Wait`` items, in the order its host issues them.
  The host posts a ``Group`` without blocking and blocks at a ``Wait`` until every group of that
  rank holding one of the named messages has completed: NCCL returns one work for a whole group.
  (On NCCL, ``work.wait()`` does not block the host but makes later kernels wait for the work,
  which orders later groups the same way.)
* A ``Group`` is one ``batch_isend_irecv`` call: one kernel on one communicator (``comm``: a
  process group). Per rank and communicator, groups run strictly in posting order: a group
  starts running once every earlier group of that rank on that communicator has completed.
  Groups on different communicators run independently.
* Matching: per communicator and ordered pair (src, dst), the k-th send src posts to dst matches
  the k-th receive dst posts from src, whatever their tags (NCCL has none). A matched pair whose
  message ids differ is reported as a mismatch: the receiver would get another message's bytes.
* Unbuffered: a send and its receive complete together, and only at a moment when the groups
  holding both are running. Ops of one running group progress independently, so a group may
  complete against several successive groups of its peer; a group completes when all its ops have.

The replay advances every rank as far as the model allows (the outcome does not depend on the
order: completing an op never prevents another from completing). It succeeds when every rank
has run its whole program and every group has completed; otherwise it reports the first stall.

``posted_groups`` derives the programs the runtime posts for a schedule's action lists: the comm
actions between two computations (``comm_batches``, with receives moved one batch earlier by
``posted_batches``) become one group per communicator, and each F or B waits for the messages it
consumes (``link_comm`` says which communicator each message uses). The runtime posts with the same
``posted_batches`` and ``link_comm``.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Hashable, Iterable, Iterator, Sequence

from schedules.actions import Action, ActionKind
from schedules.placement import location_of, virtual_stage_of
from schedules.schedule import Schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
BOUNDARY = frozenset({F, B})  # computations that consume or produce messages
COMMS = frozenset({SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD})
RECEIVES = frozenset({RECV_ACT, RECV_GRAD})


@dataclass(frozen=True)
class Op:
    """One point-to-point operation: send ``message`` to ``peer`` or receive it from ``peer``."""

    send: bool
    peer: int
    message: Hashable

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.message} {'to' if self.send else 'from'} rank {self.peer}"


@dataclass(frozen=True)
class Group:
    """One ``batch_isend_irecv`` on communicator ``comm``: its ops run as one kernel."""

    comm: Hashable
    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Wait:
    """The host blocks until this rank's ops carrying these messages have completed."""

    messages: tuple[Hashable, ...]


Program = Sequence["Group | Wait"]


@dataclass(frozen=True)
class Stall:
    """Where a replay got stuck: ``rank`` cannot go on past item ``item`` of its program."""

    rank: int
    item: int
    message: Hashable
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank}, item {self.item} of its program, message {self.message}: {self.reason}"


class NcclOrderError(RuntimeError):
    """Posted point-to-point traffic that would deadlock (or mismatch) under NCCL."""


def replay(programs: dict[int, Program]) -> Stall | None:
    """Replay every rank's program under the model above; the first stall, or None if all complete."""
    # Each op gets its matching key: (comm, src, dst, k) for the k-th message src -> dst on comm.
    keys: dict[tuple[int, int, int], tuple] = {}  # (rank, item, op index) -> key
    counters: dict[tuple, int] = defaultdict(int)
    for rank, program in programs.items():
        for i, item in enumerate(program):
            if isinstance(item, Group):
                for j, op in enumerate(item.ops):
                    pair = (item.comm, rank, op.peer) if op.send else (item.comm, op.peer, rank)
                    side = (pair, op.send)
                    keys[(rank, i, j)] = pair + (counters[side],)
                    counters[side] += 1
    pc = dict.fromkeys(programs, 0)
    queues: dict[tuple[int, Hashable], deque[int]] = defaultdict(deque)  # (rank, comm) -> posted item indices
    pending: dict[tuple[int, int], set[int]] = {}  # (rank, item) -> op indices not yet completed
    running: dict[tuple, tuple[int, int, int]] = {}  # (key, is send) -> (rank, item, op) of a running op
    group_of: dict[tuple[int, Hashable], int] = {}  # (rank, message) -> item of the group that posted it
    ready: deque[int] = deque(programs)  # ranks whose host may advance

    def start(rank: int, i: int) -> None:
        """Group i of ``rank`` reached the head of its queue: its ops run, and match where they can."""
        group = programs[rank][i]
        pending[(rank, i)] = set(range(len(group.ops)))
        for j, op in enumerate(group.ops):
            key = keys[(rank, i, j)]
            other = running.pop((key, not op.send), None)
            if other is None:
                running[(key, op.send)] = (rank, i, j)
                continue
            peer_op = programs[other[0]][other[1]].ops[other[2]]
            if peer_op.message != op.message:
                raise _Mismatch(Stall(rank, i, op.message, f"{op} is matched by rank {other[0]}'s "
                                      f"{peer_op} (item {other[1]}): the two ends post messages in another order"))
            complete(rank, i, j)
            complete(*other)

    def complete(rank: int, i: int, j: int) -> None:
        left = pending[(rank, i)]
        left.discard(j)
        ready.append(rank)
        if not left:
            del pending[(rank, i)]
            queue = queues[(rank, programs[rank][i].comm)]
            queue.popleft()
            if queue:
                start(rank, queue[0])

    def _group_done(rank: int, i: int | None) -> bool:
        return i is not None and (rank, i) not in pending and i not in queues[(rank, programs[rank][i].comm)]

    try:
        while ready:
            rank = ready.popleft()
            program = programs[rank]
            while pc[rank] < len(program):
                item = program[pc[rank]]
                if isinstance(item, Wait):
                    if not all(_group_done(rank, group_of.get((rank, m))) for m in item.messages):
                        break
                else:
                    group_of.update(((rank, op.message), pc[rank]) for op in item.ops)
                    queue = queues[(rank, item.comm)]
                    queue.append(pc[rank])
                    if len(queue) == 1:
                        start(rank, pc[rank])
                pc[rank] += 1
    except _Mismatch as mismatch:
        return mismatch.stall
    return _first_stall(programs, pc, queues, pending, keys)


class _Mismatch(Exception):
    def __init__(self, stall: Stall):
        self.stall = stall


def _first_stall(programs, pc, queues, pending, keys) -> Stall | None:
    """The lowest rank that cannot go on: the op it waits for and why that op cannot complete."""
    at = {(key, programs[r][i].ops[j].send): (r, i) for (r, i, j), key in keys.items()}

    def head(rank: int, i: int) -> int:
        return queues[(rank, programs[rank][i].comm)][0]

    for rank in sorted(programs):
        program = programs[rank]
        if pc[rank] < len(program):  # the host waits for messages
            wanted = program[pc[rank]].messages
            ops = [(i, j) for i in range(pc[rank]) if isinstance(program[i], Group)
                   for j, op in enumerate(program[i].ops) if op.message in wanted]
            if len(ops) < len(wanted):
                return Stall(rank, pc[rank], wanted[0], "the host waits for a message it never posted")
            items = sorted({i for i, _ in ops})  # the whole group of a waited message must complete
            unfinished = [(i, j) for i in items for j in range(len(program[i].ops)) if j in pending.get((rank, i), ())
                          or (i in queues[(rank, program[i].comm)] and (rank, i) not in pending)]
        else:
            unfinished = sorted((i, j) for (r, i), left in pending.items() if r == rank for j in left)
        if not unfinished:
            continue
        i, j = unfinished[0]
        op = program[i].ops[j]
        item = pc[rank] if pc[rank] < len(program) else i
        if head(rank, i) != i:
            blocking = program[head(rank, i)]
            return Stall(rank, item, op.message, f"{op} (group at item {i}) is queued behind this rank's group at "
                         f"item {head(rank, i)} ({', '.join(map(str, blocking.ops))}) on the same communicator")
        peer = at.get((keys[(rank, i, j)], not op.send))
        if peer is None:
            reason = f"rank {op.peer} never posts the matching op"
        elif peer[1] >= pc[peer[0]]:
            reason = f"rank {peer[0]} posts the matching op at item {peer[1]}, but its host is stuck at item {pc[peer[0]]}"
        else:
            blocking = programs[peer[0]][head(*peer)]
            reason = (f"rank {peer[0]}'s matching op (item {peer[1]}) is queued behind its group at item "
                      f"{head(*peer)} ({', '.join(map(str, blocking.ops))}) on the same communicator")
        return Stall(rank, item, op.message, f"{op} (group at item {i}) cannot complete: {reason}")
    return None


def check(programs: dict[int, Program]) -> None:
    """Raise NcclOrderError naming the first stall of ``replay(programs)``."""
    stall = replay(programs)
    if stall is not None:
        raise NcclOrderError(f"point-to-point order would stall under NCCL: {stall}")


# ----- what the runtime posts for a schedule ------------------------------------------------------

def comm_batches(actions: Iterable[Action]) -> Iterator[Action | tuple[Action, ...]]:
    """The actions with the comm actions between two computations (F or B) gathered into one batch,
    yielded right after the computation before them (ahead of any W, STEP or REDUCE in between).

    The runtime posts each batch as one group per link, so a send and the receive its peer posts
    at the same point go in one kernel (torch.distributed.pipelining and Megatron-LM batch the same
    way). Sends in a batch only carry what the computation before it produced, and the receives
    are consumed only by the computation after it, so moving them together changes nothing else.
    Lazy: it reads one computation ahead, so a streamed async-1f1b keeps its pace.
    """
    batch: list[Action] = []
    others: list[Action] = []
    for a in actions:
        if a.kind in COMMS:
            batch.append(a)
        elif a.kind in BOUNDARY:
            if batch:
                yield tuple(batch)
            yield from others
            batch, others = [], []
            yield a
        else:
            others.append(a)
    if batch:
        yield tuple(batch)
    yield from others


@dataclass(frozen=True)
class CommBatch:
    """The comm actions the runtime posts at one point, after a computation and before the next.

    ``actions``: the sends of the computation before, and the receives of the next computation not
    posted earlier. ``ahead``: receives of the computation after the next one, posted now so that they
    arrive while the next one computes. They go in groups of their own, posted last: waiting for a
    message of ``actions`` never waits for one of them (NCCL waits for a group as a whole).
    """

    actions: tuple[Action, ...]
    ahead: tuple[Action, ...] = ()


def posted_batches(actions: Iterable[Action], receive_ahead: bool = True) -> Iterator[Action | CommBatch]:
    """The actions as the runtime posts them: ``comm_batches``, each batch a ``CommBatch``.

    With ``receive_ahead`` the receives a computation C(k+1) consumes go in the batch right after
    C(k-1), ahead of C(k), so they can arrive while C(k) computes, with two exceptions:

    * a gradient receive is never posted before the send of the activation it answers (the
      receiver sizes the gradient's buffers from that send): it stays at its usual point, the batch
      right before its computation;
    * a batch, possibly empty, follows every batch with receives ahead: that is the usual point of
      those receives, where the transport posts the ones it could not post ahead (an activation
      whose shapes it must first read from a header: reading it ahead would block the host until
      the peer sends it, which may wait for this rank's next result).

    Lazy: the batch after C(k-1) is complete once C(k+1) is read, two computations ahead, so a
    streamed async-1f1b keeps its pace.
    """
    if not receive_ahead:
        return (CommBatch(item) if isinstance(item, tuple) else item for item in comm_batches(actions))
    return _receives_ahead(_segments(comm_batches(actions)))


Segment = tuple[tuple[Action, ...], list[Action], "Action | None"]  # (batch, other actions, computation)


def _segments(items: Iterable[Action | tuple[Action, ...]]) -> Iterator[Segment]:
    """``comm_batches``' output cut after each computation: the batch before it, the actions between
    the two, the computation (None after the last one)."""
    batch: tuple[Action, ...] = ()
    others: list[Action] = []
    for item in items:
        if isinstance(item, tuple):
            batch = item
        elif item.kind in BOUNDARY:
            yield batch, others, item
            batch, others = (), []
        else:
            others.append(item)
    if batch or others:
        yield batch, others, None


def _receives_ahead(segments: Iterator[Segment]) -> Iterator[Action | CommBatch]:
    sent: set[tuple[int, int]] = set()  # (micro-batch, chunk) of the activations sent whose gradient is not received
    current = next(segments, None)
    due = [a for a in current[0] if a.kind in RECEIVES] if current else []  # receives of the next computation
    had_ahead = False
    while current is not None:
        batch, others, computation = current
        sends = [a for a in batch if a.kind not in RECEIVES]
        sent.update((a.micro_batch, a.chunk) for a in sends if a.kind is SEND_ACT)
        following = next(segments, None)
        ahead, held = [], []
        for a in following[0] if following else ():
            if a.kind not in RECEIVES:
                continue
            if a.kind is RECV_ACT:
                ahead.append(a)
            elif (a.micro_batch, a.chunk) in sent:
                sent.remove((a.micro_batch, a.chunk))
                ahead.append(a)
            else:
                held.append(a)
        if sends or due or ahead or had_ahead:
            yield CommBatch(tuple(sends + due), tuple(ahead))
        had_ahead = bool(ahead)
        yield from others
        if computation is not None:
            yield computation
        current, due = following, held


Links = Sequence[tuple[int, int]]  # (src, dst) virtual stages of each link


def link_comm(index: int, src: int, dst: int, kind: str, chunks: int = 1, receive_ahead: bool = True) -> Hashable:
    """The communicator a message of ``kind`` ("act" or "grad") on link ``index`` (virtual stages
    src -> dst, ``chunks`` per device) uses.

    Receiving at use (``receive_ahead=False``), a link between adjacent stages of a one-chunk
    pipeline carries both directions on one communicator: the comm batches of its two ends pair up
    (checked for every schedule). Elsewhere (a skip connection, an interleaved pipeline) the two ends
    compute in other rhythms, and a group mixing directions could hold a send whose receive the peer
    posts only after it waited for this rank's next result (NCCL completes, and waits for, a group as
    a whole). There each direction gets a communicator of its own: one-way traffic in FIFO order never
    waits behind the other direction. Receives posted ahead break the pairing on every link (a group
    [send act 0, recv grad 0] would hold up the next send behind the peer's backward), so then every
    direction of every link has its own.
    """
    return index if dst == src + 1 and chunks == 1 and not receive_ahead else (index, kind)


def link_ops(a: Action, stages: int, links: Links, chunks: int = 1,
             receive_ahead: bool = True, placement: str = "loop") -> Iterator[tuple[Hashable, Op]]:
    """(communicator, op) of each message a comm action of device ``a.position`` posts
    (``placement``: which virtual stage each chunk is, see schedules.placement)."""
    v = virtual_stage_of(a.position, a.chunk, stages, placement)

    def comm(index: int, src: int, dst: int, kind: str) -> Hashable:
        return link_comm(index, src, dst, kind, chunks, receive_ahead)

    for index, (src, dst) in enumerate(links):
        src_device, dst_device = location_of(src, stages, placement)[0], location_of(dst, stages, placement)[0]
        if src_device == dst_device:
            continue  # both ends on one device: handed over in memory
        if a.kind is SEND_ACT and src == v:
            yield comm(index, src, dst, "act"), Op(True, dst_device, ("act", index, a.micro_batch))
        elif a.kind is RECV_ACT and dst == v:
            yield comm(index, src, dst, "act"), Op(False, src_device, ("act", index, a.micro_batch))
        elif a.kind is SEND_GRAD and dst == v:
            yield comm(index, src, dst, "grad"), Op(True, src_device, ("grad", index, a.micro_batch))
        elif a.kind is RECV_GRAD and src == v:
            yield comm(index, src, dst, "grad"), Op(False, dst_device, ("grad", index, a.micro_batch))


def batch_groups(batch: Sequence[Action], stages: int, links: Links, chunks: int = 1,
                 receive_ahead: bool = True, placement: str = "loop") -> list[Group]:
    """One group per communicator holding every op of ``batch`` on it (in the order first used)."""
    by_comm: dict[Hashable, list[Op]] = {}
    for a in batch:
        for comm, op in link_ops(a, stages, links, chunks, receive_ahead, placement):
            by_comm.setdefault(comm, []).append(op)
    return [Group(comm, tuple(ops)) for comm, ops in by_comm.items()]


def posted_groups(schedule: Schedule, links: Links | None = None,
                  receive_ahead: bool = True) -> dict[int, list[Group | Wait]]:
    """Per device, the groups and waits the runtime posts for ``schedule`` (adjacent virtual stages
    linked unless ``links`` lists (src, dst) pairs, e.g. with skip connections), with receives
    posted ahead or at use (``posted_batches``), every shape already agreed."""
    p, chunks = schedule.stages, schedule.chunks
    if links is None:
        links = [(v, v + 1) for v in range(schedule.virtual_stages - 1)]
    programs: dict[int, list[Group | Wait]] = {}
    for d, actions in enumerate(schedule.actions):
        program: list[Group | Wait] = []
        for item in posted_batches(actions, receive_ahead):
            if isinstance(item, CommBatch):
                program += batch_groups(item.actions, p, links, chunks, receive_ahead, schedule.placement)
                program += batch_groups(item.ahead, p, links, chunks, receive_ahead, schedule.placement)
            elif item.kind in BOUNDARY:
                receive = RECV_ACT if item.kind is F else RECV_GRAD
                needed = [op.message for _, op in link_ops(Action(d, receive, item.micro_batch, item.chunk), p, links,
                                                       chunks, receive_ahead, schedule.placement)]
                if needed:
                    program.append(Wait(tuple(needed)))
        programs[d] = program
    return programs

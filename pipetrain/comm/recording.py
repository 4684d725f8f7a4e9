"""Recording the point-to-point traffic the distributed engine posts, for the NCCL-order checker.

Inside ``with recording() as recorder:`` every DistributedTransport built there logs each
``batch_isend_irecv`` group and each wait into ``recorder.program``, in the order this rank's
host issued them, as ``schedules.nccl_order`` items; the tests gather every rank's program and
replay them (``schedules.nccl_order.replay``). Outside, nothing is recorded and nothing is paid.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Hashable, Iterator

from schedules.nccl_order import Group, Op, Wait

_active: list[Recorder] = []


class Recorder:
    """This rank's program: the groups and waits its transports posted."""

    def __init__(self):
        self.program: list[Group | Wait] = []
        self._count: dict[tuple, int] = defaultdict(int)

    def message_id(self, kind: str, link: Hashable, micro_batch: int) -> tuple:
        """(kind, link, n, micro-batch) for the n-th message of its kind on its link: micro-batch
        numbers repeat every step, the count does not, and both ends count alike when they agree
        on the order (the replay reports a mismatch where they do not)."""
        key = (kind, link)
        n = self._count[key]
        self._count[key] += 1
        return (kind, link, n, micro_batch)

    def group(self, comm: Hashable, ops: list[Op]) -> None:
        self.program.append(Group(comm, tuple(ops)))

    def wait(self, messages: list[Hashable]) -> None:
        self.program.append(Wait(tuple(messages)))

    def collective(self, comm: Hashable, ranks: list[int], rank: int) -> None:
        """A blocking collective over ``ranks`` on ``comm``, as the checker sees it: one group with a
        send to and a receive from every other member (so it completes only while all of theirs run),
        then a wait for it."""
        message = self.message_id("collective", comm, 0)
        self.group(comm, [Op(send, peer, message) for peer in ranks if peer != rank for send in (True, False)])
        self.wait([message])


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    """Record what transports built inside the block post (for their whole life)."""
    recorder = Recorder()
    _active.append(recorder)
    try:
        yield recorder
    finally:
        _active.remove(recorder)


def active() -> Recorder | None:
    """The recorder of the innermost ``recording()`` block, or None."""
    return _active[-1] if _active else None

"""All-or-nothing decisions among the ranks (wrap, save, load, the meeting after a failed step), taken over the
process group's store rather than a collective.

Every rank posts what it found; rank 0 waits for every post, applies a rule to them and posts the decision;
every rank returns that decision, so all ranks act alike. A rank that never posts is named, with the phase,
in one PeerFailure on every rank, after ``timeout`` (a collective cannot say whom it waited for, and a gloo
collective that times out breaks its group for good; the store does neither). A rank that gives up waiting
writes its PeerFailure as the decision with an atomic first-writer-wins ``compare_set``, so a decision and
a give-up can never both be taken: if rank 0 decided first, the waiting rank takes that decision after all.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from pipetrain.comm.failures import PeerFailure


@dataclass(frozen=True)
class _Decision:
    value: Any


@dataclass(frozen=True)
class _Unanswered:
    message: str


class Consensus:
    """Decisions of the ``size`` ranks of one pipeline, posted under ``namespace`` in ``store``; every rank
    calls ``decide`` in the same order, so the n-th call of every rank meets the others' n-th."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: float, namespace: str):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.namespace = namespace
        self.rounds = 0

    def decide(self, phase: str, value: Any, rule: Callable[[list[Any]], Any], wait: float | None = None) -> Any:
        """Post ``value`` (picklable); return ``rule`` applied by rank 0 to every rank's value, in rank order.
        ``phase`` names what the ranks meet for in the PeerFailure a missing rank causes; ``wait``: seconds a
        rank waits for the others (default: wrap's ``timeout``)."""
        seconds = self.timeout if wait is None else wait
        key = f"{self.namespace}/{self.rounds}"
        self.rounds += 1
        posts = [f"{key}/{r}" for r in range(self.size)]
        self.store.set(posts[self.rank], pickle.dumps(value))
        verdict = f"{key}/verdict"
        mine = None
        try:
            if self.rank == 0:
                self.store.wait(posts, timedelta(seconds=seconds))
                mine = _Decision(rule([pickle.loads(v) for v in self.store.multi_get(posts)]))
                if self.rounds > 1:  # every rank read the previous verdict before it posted to this round
                    self._forget(f"{self.namespace}/{self.rounds - 2}")
            else:
                self.store.wait([verdict], timedelta(seconds=seconds))
        except dist.DistStoreError:
            mine = _Unanswered(self._unanswered(phase, posts, seconds))
        stored = self.store.compare_set(verdict, "", pickle.dumps(mine)) if mine is not None else self.store.get(verdict)
        found = pickle.loads(stored)
        if isinstance(found, _Unanswered):
            raise PeerFailure(found.message)
        return found.value

    def _unanswered(self, phase: str, posts: list[str], seconds: float) -> str:
        missing = [r for r, k in enumerate(posts) if not self.store.check([k])]
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reached it" if missing
               else "rank 0 never posted the decision")
        return (f"{phase}: rank {self.rank} waited {seconds:g} s for every rank and {who} (died, hangs, or is "
                "still busy: see that rank's log, or raise wrap(..., timeout=...) if it is only slow)")

    def _forget(self, key: str) -> None:
        for r in range(self.size):
            self.store.delete_key(f"{key}/{r}")
        self.store.delete_key(f"{key}/verdict")


def default_store() -> dist.Store:
    """The store of the default process group (torch.distributed exposes it only through this accessor)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as error:
        raise RuntimeError("pipetrain's ranks agree through the default process group's store, and this process "
                           "group has none: initialise it with init_method='env://' or 'tcp://...' (torchrun "
                           "does), or let pipetrain initialise it") from error

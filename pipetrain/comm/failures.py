"""Failures of other ranks: ``PeerFailure``, what a rank raises when a peer died or stopped answering, and the
board that explains it.

The first error of a failed step is posted where every rank can read it: the rendezvous store of the
process group. A rank whose step raises posts its error; the others stop waiting for it after ``timeout``
(gloo cannot be woken earlier: a point-to-point wait that times out closes the connection) with a
PeerFailure, which then names the rank that raised first and its error instead of only the wait."""
from __future__ import annotations

import torch.distributed as dist


class PeerFailure(RuntimeError):
    """Another rank of the pipeline died or stopped answering."""


class FailureBoard:
    """Posts and reads the first error of each failed step; ``failures`` counts them alike on every rank
    (each failure makes every rank raise once), so that all ranks use the same key under ``prefix`` (one
    pipeline's: another pipeline's failures are not this one's)."""

    def __init__(self, store: dist.Store, rank: int, prefix: str):
        self.store = store
        self.rank = rank
        self.prefix = prefix
        self.failures = 0

    def explain(self, error: BaseException) -> BaseException:
        """What to raise for ``error``: a PeerFailure gains the first error posted for this failure;
        any other error is posted (first writer wins) and raised as it is."""
        key = f"{self.prefix}/failed-step/{self.failures}"
        self.failures += 1
        if isinstance(error, GeneratorExit):
            return error
        try:
            if isinstance(error, PeerFailure):
                if self.store.check([key]):
                    return PeerFailure(f"{self.store.get(key).decode()} (raised first); here: {error}")
                return error
            self.store.compare_set(key, "", f"rank {self.rank} raised {type(error).__name__}: {error}")
        except RuntimeError:  # the store is gone with the rank that hosted it: keep the error we have
            pass
        return error

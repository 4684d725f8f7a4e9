"""How long a rank waits for a peer that may be compiling (wrap(compile=...)).

torch.compile compiles a stage the first time it runs an input shape, inside that step: inductor takes tens of
seconds per graph with a cold cache, minutes on a loaded machine, and a split schedule compiles its B and W graphs
later in the same step. A rank waiting for that peer's activations or gradients must not call it dead after wrap's
``timeout`` (30 s by default), a bound meant for a rank that died or hangs in steady state. So, when the pipeline
compiles, a message of a mini-batch whose input shapes this rank has not yet finished ``positions + 1`` times (the
most mini-batches a peer can lag behind in a stream; a synchronous step needs one) is waited on for
``COMPILE_SECONDS`` at least, and the process groups get that timeout too (NCCL's watchdog aborts a p2p operation
that outlives its group's timeout). Once the shapes are settled, a hang is reported after ``timeout`` again.
Predictions run other graphs (eval mode, no autograd), so they settle on their own.
"""
from __future__ import annotations

import collections
import contextlib
from datetime import timedelta
from typing import Hashable, Iterable, Iterator

# As long as NCCL's default collective timeout: room for a cold inductor compile of a large stage on a busy host.
COMPILE_SECONDS = 600.0
KEPT_KEYS = 256  # shape keys remembered; a forgotten one only waits with the grace again


def group_timeout(timeout: float, compiles: bool) -> float:
    """The timeout, in seconds, of the process groups a pipeline creates."""
    return max(timeout, COMPILE_SECONDS) if compiles else timeout


class CompileGrace:
    """Which messages may be held up by a compiling peer: those of input shapes not yet settled on this rank."""

    def __init__(self, timeout: float, positions: int):
        self.steady = timedelta(seconds=timeout)
        self.compiling = timedelta(seconds=max(timeout, COMPILE_SECONDS))
        self.settled_after = positions + 1
        self.finished: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self.mode = "train"

    def timeout(self, shape_key: Hashable) -> timedelta:
        """How long to wait for a message of a micro-batch with these input shapes."""
        return self.steady if self.finished.get((self.mode, shape_key), 0) >= self.settled_after else self.compiling

    def finished_mini_batch(self, shape_keys: Iterable[Hashable]) -> None:
        """This rank finished a mini-batch whose micro-batches had these input shapes."""
        for key in {(self.mode, k) for k in shape_keys}:
            self.finished[key] = self.finished.pop(key, 0) + 1
        while len(self.finished) > KEPT_KEYS:
            self.finished.popitem(last=False)

    @contextlib.contextmanager
    def predicting(self) -> Iterator[None]:
        """Messages inside belong to predict's graphs."""
        self.mode = "predict"
        try:
            yield
        finally:
            self.mode = "train"

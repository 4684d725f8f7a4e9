"""Stopping a training run on SIGTERM (what schedulers and torchrun send before killing a job) at a mini-batch
every rank agrees on, so that the run can save a checkpoint there and exit with status 0.

The handler only takes note (StopRequest) and passes the request to the pipeline, whose next step report
carries it to every rank; the training loop (pipetrain.apps.training) feeds each epoch through a Feed it can
end early and asks a StopAgreement where to stop.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

import pipetrain


class StopRequest:
    """SIGTERM's handler during run(): it only takes note, and passes the request to the pipeline,
    whose next step report carries it to every rank; the loop acts at the next safe point."""

    def __init__(self) -> None:
        self.signalled = False
        self._pipe: pipetrain.Pipeline | None = None

    def attach(self, pipe: pipetrain.Pipeline) -> None:
        """Forward requests to ``pipe`` from now on (and one that came while it was being built)."""
        self._pipe = pipe
        if self.signalled:
            pipe.request_stop()

    def __call__(self, signum: int, frame: Any) -> None:
        self.signalled = True
        if self._pipe is not None:
            self._pipe.request_stop()


@contextlib.contextmanager
def sigterm_requests_stop(enabled: bool) -> Iterator[StopRequest | None]:
    """Catch SIGTERM for the duration of the block (only the main thread may install handlers);
    the previous handler comes back afterwards, also after an error."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield None
        return
    request = StopRequest()
    previous = signal.signal(signal.SIGTERM, request)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, previous)


class Feed:
    """The mini-batches of one epoch, counted as the pipeline pulls them, ending early once ``limit``
    is set: that is how a stream ends at a mini-batch every rank agreed on."""

    def __init__(self, batches: Iterator[tuple[Any, Any]]):
        self._batches = batches
        self.pulled = 0
        self.limit: int | None = None

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        while self.limit is None or self.pulled < self.limit:
            batch = next(self._batches, None)
            if batch is None:
                return
            self.pulled += 1  # counted when handed over, so ``pulled`` is what the pipeline holds
            yield batch


class StopAgreement:
    """Where the ranks stop: all at the same mini-batch, since each save has barriers.

    Ranks get SIGTERM at slightly different times. Within an epoch they learn of any rank's request
    from the step report they exchange anyway (StepResult.stop_requested), which every rank reads at
    the same step: a request that comes after a rank sent step t's report stops the run after step
    t + 1. Between epochs (a signal during validation or the save) they vote once, on a gloo group of
    its own (CPU tensors whatever the backend; no interleaving with the pipeline's collectives)."""

    def __init__(self, schedule: str, timeout: float) -> None:
        # Bounded like every collective of the pipeline (wrap's timeout), not torch's 30-minute default.
        self._group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
                       if dist.is_initialized() else None)
        # A distributed async-1f1b stream reads step t's report while ranks have taken different numbers
        # of later mini-batches, so no count to stop after follows from it; it stops at the epoch's end.
        self._mid_stream = self._group is None or schedule != "async-1f1b"

    def stop_after(self, result: pipetrain.StepResult, request: StopRequest) -> bool:
        """Whether to stop after the mini-batch of ``result``, in the middle of an epoch."""
        if not self._mid_stream:
            return False
        return request.signalled if self._group is None else result.stop_requested

    def any_rank_asked(self, request: StopRequest) -> bool:
        """Whether any rank got SIGTERM (every rank calls this at the same point)."""
        if self._group is None:
            return request.signalled
        vote = torch.tensor([int(request.signalled)], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote[0])


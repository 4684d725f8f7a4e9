"""SIGTERM as a request to stop training at a mini-batch every rank agrees on, so that the run can save a
checkpoint there and exit with status 0: what schedulers (Slurm, Kubernetes) and torchrun send before they kill
a job.

    with pipetrain.StopOnSigterm(pipe) as stop:
        for epoch in range(epochs):
            for x, y in stop.batches(loader):          # ends early once every rank agreed to stop
                pipe.step(x, y)                        # (or: for result in pipe.train(stop.batches(loader)))
            if not stop.stopped:
                validate()                             # a whole epoch was trained
            pipe.save(checkpoint_dir)
            if stop.requested():                       # every rank calls it, and all get the same answer
                break

The handler only takes note and calls ``pipe.request_stop()``, whose flag rides in the step report the ranks
exchange anyway, so all ranks of a synchronous schedule stop after the same mini-batch without a collective of
their own. A signal that lands outside a stream (validation, a save) is caught by ``requested()``: one vote at
that point. An async-1f1b stream stops taking mini-batches and drains in one process; under torchrun it runs to
the end of its ``batches`` (ranks read a step's report while they hold different numbers of later mini-batches,
so no mini-batch to stop after follows from it), and ``requested()`` stops the run there.
"""
from __future__ import annotations

import signal
import threading
from datetime import timedelta
from types import FrameType
from typing import Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

from pipetrain.pipeline import Pipeline

Batch = TypeVar("Batch")


class StopOnSigterm:
    """A context manager that turns SIGTERM into ``pipe.request_stop()`` while it is open (the previous handler
    comes back on exit, also after an error). With ``enabled=False`` (no checkpoint directory to save into) it
    leaves SIGTERM alone and never stops anything, so a script can use it unconditionally. Every rank must open
    it, with the same ``enabled``."""

    def __init__(self, pipe: Pipeline, enabled: bool = True) -> None:
        self.pipe = pipe
        self.enabled = enabled
        self.signalled = False  # this process got SIGTERM
        self.stopped = False  # the last batches() ended early, at a mini-batch every rank agreed on
        self._previous: object = None
        self._group: dist.ProcessGroup | None = None

    def __enter__(self) -> StopOnSigterm:
        if not self.enabled:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopOnSigterm must be opened in the main thread: Python runs signal handlers "
                               "there only")
        if self.pipe.world is not None:
            # The vote of requested() gets a gloo group of its own (CPU tensors whatever the pipeline's backend,
            # never interleaved with its collectives), bounded by wrap's timeout like every wait of the pipeline.
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.pipe.options.timeout))
        self._previous = signal.signal(signal.SIGTERM, self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler: it only sets flags (safe at any point of a step)."""
        self.signalled = True
        self.pipe.request_stop()

    def batches(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """``batches``, ending after the first mini-batch at which every rank agreed to stop (``stopped`` then
        says so). Feed it to ``pipe.step`` one by one or to ``pipe.train``."""
        self.stopped = False
        first = True
        for batch in batches:
            # Asked before handing out the next one, once the previous one's result is in (pipe.last_result):
            # a synchronous schedule takes one mini-batch per step, so every rank asks at the same step.
            if not first and self._agreed_to_stop():
                self.stopped = True
                return
            first = False
            yield batch

    def requested(self) -> bool:
        """Whether to stop now. Every rank calls it at the same point and gets the same answer: True after a
        ``batches()`` that stopped early, else whether any rank got SIGTERM (a vote under torchrun)."""
        if not self.enabled:
            return False
        if self.stopped or self._group is None:
            return self.stopped or self.signalled
        vote = torch.tensor([int(self.signalled)], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._group)
        return bool(vote[0])

    def _agreed_to_stop(self) -> bool:
        if not self.enabled:
            return False
        if self._group is None:  # one process: its own flag is the agreement
            return self.signalled
        if self.pipe.options.schedule == "async-1f1b":
            return False
        result = self.pipe.last_result
        return result is not None and result.stop_requested

"""Ending the process groups while the interpreter is still alive.

gloo runs each collective on a worker thread, which lets go of the collective's tensors just after the
caller's ``wait`` returns. When the process exits right then (a script whose last line gathers a result, or
reads ``state_dict``), that release needs the GIL of an interpreter being torn down and the process aborts:
"terminate called without an active exception", SIGABRT, after a run that succeeded (pytorch/pytorch#190489).
A group's workers are joined when the group is destroyed and nothing refers to it any more. So a pipeline
destroys the groups it made in ``close()``, pipelines still open are closed when the process exits, and so
is the default group when pipetrain started it. An exit by an unhandled error is left to torch: its peers
may be gone, and NCCL's orderly teardown would wait for them where torch's own aborts.
"""
from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Any, Iterable, Protocol

import torch.distributed as dist


class Closable(Protocol):
    def close(self) -> None: ...


class _AtExit:
    """What this process ends when it exits normally: the pipelines still open, and the default group if
    pipetrain started it."""

    def __init__(self) -> None:
        self.open: weakref.WeakSet = weakref.WeakSet()
        self.owns_default_group = False
        self.registered = False

    def own_default_group(self) -> None:
        self.register()
        self.owns_default_group = True

    def register(self) -> None:
        if not self.registered:
            atexit.register(self.run)
            self.registered = True

    def run(self) -> None:
        if hasattr(sys, "last_value"):  # the interpreter printed an unhandled error: torch's teardown aborts
            return
        for closable in list(self.open):
            closable.close()
        if self.owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()  # groups held in reference cycles are freed (their workers joined) now, not in the teardown


_at_exit = _AtExit()


def close_at_exit(closable: Closable) -> None:
    """Call ``closable.close()`` when the process exits normally, unless it was closed (``forget``) before."""
    _at_exit.register()
    _at_exit.open.add(closable)


def forget(closable: Closable) -> None:
    """``closable`` was closed: nothing to do for it at exit."""
    _at_exit.open.discard(closable)


def own_default_group() -> None:
    """pipetrain started the default process group, so it destroys it at exit."""
    _at_exit.own_default_group()


def destroy_groups(groups: Iterable[Any]) -> None:
    """Destroy this rank's ``groups`` (None and non-member handles are skipped), newest first, as every rank
    does in the same order (an NCCL communicator's teardown may wait for its peers). Nothing to do once the
    default group is gone: destroying it destroyed every group."""
    if not dist.is_initialized():
        return
    for group in reversed(list(groups)):
        if group is not None:
            dist.destroy_process_group(group)  # returns at once for a non-member handle

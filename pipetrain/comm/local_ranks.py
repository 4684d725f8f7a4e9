"""Start a world of ranks on this machine as processes forked from one that has imported torch once.

``torch.multiprocessing.spawn`` starts each rank as a new interpreter, which imports torch and pipetrain again:
about 4 s of CPU per rank here, more than a short benchmark or test spends on its own work. Forking each rank
from a server process that imported them once (multiprocessing's ``forkserver``) keeps spawn's isolation (the
server holds no threads, process group or CUDA context, so a rank starts as clean as a spawned one, CUDA
included) without paying the imports per rank.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from multiprocessing import reduction

import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "pipetrain")


class _CallersFd:
    """A file descriptor of the calling process, handed to the rank with its arguments. The server's own
    standard output is the one the caller had when the server started; a spawned rank writes to the caller's
    current one, and so does a forked rank given these."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _inherited, (reduction.DupFd(self.fd),)


def _inherited(fd) -> int:
    return fd.detach()


def _rank_main(rank: int, fn: Callable, stdout: int, stderr: int, *args) -> None:
    for fd, target in ((stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    fn(rank, *args)


def start_local_ranks(fn: Callable, args: tuple, nprocs: int, join: bool = True,
                      preload: Sequence[str] = PRELOAD):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join)``: ``fn(rank, *args)`` on ``nprocs`` processes,
    forked from a server that has imported ``preload``, writing to this process's standard output and error. As
    with spawn, ``fn`` must be importable by name (a module-level function, a script's included) and the calling
    script must guard its start with ``if __name__ == "__main__"``. The first call in a process starts the
    server: later calls reuse it, with the modules it preloaded then."""
    sys.stdout.flush()
    sys.stderr.flush()
    mp.set_forkserver_preload(list(preload))
    return mp.start_processes(_rank_main, args=(fn, _CallersFd(1), _CallersFd(2), *args), nprocs=nprocs, join=join,
                              start_method="forkserver")

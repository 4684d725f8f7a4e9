"""pipetrain.comm.local_ranks: ranks forked from a preloaded server write where their caller writes now."""
import contextlib
import os
import sys
from pathlib import Path

import pytest

from pipetrain.comm.local_ranks import start_local_ranks

pytestmark = pytest.mark.slow  # starts processes


def report(rank: int, caller: int, tag: str) -> None:
    print(f"{tag} rank {rank} forked by the server: {os.getppid() != caller}", flush=True)
    print(f"{tag} rank {rank} on stderr", file=sys.stderr, flush=True)


@contextlib.contextmanager
def output_to(path: Path):
    """This process's file descriptors 1 and 2 point at ``path`` inside the block."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def test_each_start_writes_to_the_callers_output_of_its_time(tmp_path):
    # The server starts during the first call (or an earlier test's) with the output of that time; a spawned rank
    # writes to its caller's current output, and so must a forked one.
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    with output_to(first):
        start_local_ranks(report, (os.getpid(), "first"), 2)
    with output_to(second):
        start_local_ranks(report, (os.getpid(), "second"), 2)
    for path, tag in ((first, "first"), (second, "second")):
        lines = sorted(path.read_text().splitlines())
        assert lines == sorted([f"{tag} rank {r} forked by the server: True" for r in range(2)]
                               + [f"{tag} rank {r} on stderr" for r in range(2)]), (path, lines)

"""Counting the host synchronisations the runtime makes on purpose.

On a GPU, reading a device value on the host (``.item()``, ``float()``, ``.tolist()``, ``.cpu()``)
waits for every kernel queued before it: the pipeline stalls. The runtime reads device values only
at the few points that need them on the host, each marked with ``note``; ``counting()`` tallies
them (tests, benchmarks). The README lists each remaining point and why it stays.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

_active: list[Counter] = []


def note(where: str) -> None:
    """One host synchronisation at ``where`` (a short fixed name)."""
    for counter in _active:
        counter[where] += 1


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Tally the host synchronisations noted inside the block, by where they happen."""
    counter: Counter = Counter()
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)

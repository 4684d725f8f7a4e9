"""Agreeing on fp16 overflow: every device skips the same optimizer steps.

In one process the devices of the local engine wait for each other inside the executor loop;
across processes the loss scaler's own all-reduce (MAX) of the overflow flag already agreed.
"""
from __future__ import annotations

from typing import Iterator

from pipetrain.runtime.executor import BLOCKED


class LocalOverflowAgreement:
    """All devices in one process: the step of mini-batch t waits until every device reported."""

    def __init__(self, devices: int):
        self.devices = devices
        self.flags: dict[int, list[bool]] = {}
        self.read: dict[int, int] = {}

    def agree(self, t: int, found_inf: bool) -> Iterator[str]:
        flags = self.flags.setdefault(t, [])
        flags.append(found_inf)
        while len(self.flags[t]) < self.devices:
            yield BLOCKED
        decision = any(self.flags[t])
        self.read[t] = self.read.get(t, 0) + 1
        if self.read[t] == self.devices:
            del self.flags[t], self.read[t]
        return decision


class DistributedOverflowAgreement:
    """The scaler's own all-reduce (MAX) over every rank already agreed; nothing to add."""

    def agree(self, t: int, found_inf: bool) -> Iterator[str]:
        yield from ()
        return found_inf

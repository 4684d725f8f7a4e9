"""`Costs`: how long each action takes, per stage, for the simulator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

Number = Union[int, float]
PerStage = Union[Number, Sequence[Number]]


def _per_stage(name: str, value: PerStage, length: int) -> list[float]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value)] * length
    else:
        values = [float(x) for x in value]
        if len(values) != length:
            raise ValueError(f"Costs.{name} has {len(values)} entries for {length} stages; "
                             "give one number per stage or a single number")
    if any(x < 0 for x in values):
        raise ValueError(f"Costs.{name} must be non-negative, got {values}")
    return values


@dataclass(frozen=True)
class Costs:
    """Durations of one micro-batch's work; each a number or one number per stage (device).

    `backward` is the input-gradient part and `weight` the weight-gradient part
    of the backward pass: a zero-bubble schedule runs them as B and W, every
    other schedule's B costs backward + weight. In interleaved schedules a
    device's cost is split evenly over its chunks. `comm` is the latency of a
    message on an edge: a number, stages-1 numbers (edge k joins stage k and
    k+1, both directions) or `stages` numbers (the last joins stage p-1 and 0,
    used by interleaved schedules). Times are taken as seconds in traces.
    """

    forward: PerStage
    backward: PerStage
    weight: PerStage = 0.0
    comm: PerStage = 0.0

    @classmethod
    def from_plan(cls, plan: object, *, backward_ratio: float = 2.0, comm: PerStage = 0.0) -> "Costs":
        """Costs from a partition plan (any object with `stage_times`: per-stage seconds of
        forward + backward of one micro-batch), split as forward : backward = 1 : backward_ratio."""
        times = getattr(plan, "stage_times", None)
        if times is None:
            raise TypeError(f"{type(plan).__name__} has no stage_times; pass a partition Plan or "
                            "build Costs(forward=[...], backward=[...]) directly")
        share = 1.0 / (1.0 + backward_ratio)
        return cls(forward=[t * share for t in times],
                   backward=[t * backward_ratio * share for t in times], comm=comm)

    def compute(self, stages: int) -> tuple[list[float], list[float], list[float]]:
        """(forward, backward, weight) per stage."""
        return (_per_stage("forward", self.forward, stages),
                _per_stage("backward", self.backward, stages),
                _per_stage("weight", self.weight, stages))

    def latency(self, stages: int, wraps: bool) -> list[list[float]]:
        """latency[a][b] of a message from stage a to neighbour b (wraps: p-1 <-> 0 used)."""
        if isinstance(self.comm, (int, float)) and not isinstance(self.comm, bool):
            edges = [float(self.comm)] * stages
        else:
            edges = [float(x) for x in self.comm]
            if len(edges) not in (stages - 1, stages) or (wraps and stages > 2 and len(edges) < stages):
                need = f"{stages} (the last for the edge {stages - 1} -> 0)" if wraps else f"{stages - 1}"
                raise ValueError(f"Costs.comm has {len(edges)} entries; this schedule needs {need}")
            if any(x < 0 for x in edges):
                raise ValueError(f"Costs.comm must be non-negative, got {edges}")
        table = [[0.0] * stages for _ in range(stages)]
        for a in range(stages - 1):
            table[a][a + 1] = table[a + 1][a] = edges[a]
        if wraps and stages > 2:  # only interleaved schedules use the p-1 <-> 0 edge
            table[stages - 1][0] = table[0][stages - 1] = edges[stages - 1]
        return table

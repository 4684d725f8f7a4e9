"""Turning per-stage counters into a StepResult; across ranks, summing them without stalling.

The distributed engine sums every rank's numbers once per step (`SumExchange`). A sync step's
report rides in the skip-or-step agreement's exchange (one collective per step); for
async-1f1b the sum is started without waiting (``async_op``), so the last stage never waits
for the first one to finish a mini-batch before it can report.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipetrain.comm.peers import peers_answer
from pipetrain.runtime import host_sync
from pipetrain.runtime.metrics import COMM_KINDS, CommCounter, StageReport, StepResult, per_stage_fields


class SumExchange:
    """One sum over the ranks of a group of a small float64 vector, every rank getting the same bits;
    its last ``maximised`` entries are maximised instead (the skip-or-step flags of a sync step ride
    in the step report's exchange that way, pipetrain.comm.overflow_agreement).

    NCCL (and other backends): one all_reduce (two with a maximised part, posted back to back). gloo:
    a gather to the group's first rank, which adds the parts in rank order and broadcasts the total
    on ``broadcast_group``. gloo's all_reduce is a ring of 2 (W - 1) dependent messages even for a
    few hundred bytes, each waking a process, where gather + broadcast is 2 hops: several times
    faster when processes share cores (README, "Cost-model calibration"). Exchanges left in flight
    (async-1f1b reports) need a broadcast group of their own, so a root that is still summing step
    N never interleaves its broadcast with step N + 1's gather; one waited on at once can share it.
    """

    def __init__(self, mine: torch.Tensor, group: Any, broadcast_group: Any, maximised: int = 0):
        self.total = mine
        self.maximised = maximised
        self.broadcast: Any = None
        self.rooted = dist.get_backend(group) == "gloo"
        if not self.rooted:
            summed = mine[:mine.numel() - maximised]
            self.gathered = _Works([dist.all_reduce(summed, group=group, async_op=True)] + (
                [dist.all_reduce(mine[-maximised:], op=dist.ReduceOp.MAX, group=group, async_op=True)]
                if maximised else []))
            return
        self.broadcast_group = broadcast_group
        self.root = dist.get_global_rank(group, 0)
        self.parts = ([torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
                      if dist.get_rank() == self.root else None)
        self.gathered = dist.gather(mine, self.parts, dst=self.root, group=group, async_op=True)
        if self.parts is None:  # the total arrives in a buffer of its own, not over the part being sent
            self.total = torch.empty_like(mine)
            self.broadcast = dist.broadcast(self.total, src=self.root, group=broadcast_group, async_op=True)

    def _send_total(self) -> None:
        parts = torch.stack(self.parts)
        self.total = parts.sum(0)
        if self.maximised:
            self.total[-self.maximised:] = parts[:, -self.maximised:].amax(0)
        self.broadcast = dist.broadcast(self.total, src=self.root, group=self.broadcast_group, async_op=True)

    def is_completed(self) -> bool:
        """True once `wait` would not block (the root starts its broadcast as soon as it can)."""
        if not self.gathered.is_completed():
            return False
        if self.rooted and self.broadcast is None:
            self._send_total()
        return self.broadcast is None or self.broadcast.is_completed()

    def wait(self) -> torch.Tensor:
        """The sum over the group's ranks."""
        self.gathered.wait()
        if self.rooted:
            if self.broadcast is None:
                self._send_total()
            self.broadcast.wait()
        return self.total


class _Works:
    """Works posted back to back, waited on as one."""

    def __init__(self, works: list[Any]):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class Reporter:
    """Builds the result of each mini-batch from the reports of the stages this process runs."""

    def __init__(self, num_stages: int, counter: CommCounter, has_last_stage: bool,
                 groups: tuple[Any, Any] | None = None, replicas: int = 1, device: torch.device | str = "cpu"):
        self.num_stages = num_stages
        self.counter = counter
        self.has_last_stage = has_last_stage
        self.groups = groups  # (sum, broadcast) groups of every rank; None: one process holds every stage
        self.replicas = replicas
        self.device = device  # NCCL reduces device tensors only
        self._comm = counter.snapshot()
        self._fields = per_stage_fields()

    def local(self, loss_sum: float, samples: int, seconds: float, reports: dict[int, StageReport],
              busy_seconds: dict[int, float]) -> StepResult:
        """This process's view of one mini-batch (complete when it runs every stage); ``loss_sum``
        is the loss summed over samples."""
        V = self.num_stages
        result = StepResult(0, loss_sum / samples, samples, seconds)
        for f in self._fields:
            setattr(result, f.name, [f.metadata["per_stage"](0)] * V)
        for v, report in reports.items():
            result.busy_fraction[v] = busy_seconds.get(v, 0.0) / max(seconds, 1e-12)
            for name, value in vars(report).items():
                getattr(result, name)[v] = value
        if self.groups is None:  # under torchrun the errors travel to the step report on the device
            result.prediction_error = _read_on_host(result.prediction_error)
        result.comm_bytes = self.counter.since(self._comm)
        self._comm = self.counter.snapshot()
        return result

    def vector(self, result: StepResult, loss_sum: float) -> torch.Tensor:
        """What this rank adds to the sum over ranks: the loss sums and sample counts of last stages,
        per-stage numbers, and whether it was asked to stop."""
        V = self.num_stages
        per_stage = [getattr(result, f.name) for f in self._fields] + [result.comm_bytes[k] for k in COMM_KINDS]
        # The last entry: this rank was asked to stop (summed: any rank was), so every rank learns it
        # from the report it already exchanges instead of from a collective of its own.
        numbers = [0.0] * (2 + len(per_stage) * V + 1)  # one tensor made from a list: no write per entry
        if self.has_last_stage:
            numbers[0], numbers[1] = loss_sum, result.samples
        numbers[-1] = float(result.stop_requested)
        on_device: list[tuple[int, torch.Tensor]] = []
        for i, values in enumerate(per_stage):
            for v, value in enumerate(values):
                if isinstance(value, torch.Tensor):  # staleness diagnostics, still on the stage's device
                    on_device.append((2 + i * V + v, value))
                elif value:
                    numbers[2 + i * V + v] = value
        mine = torch.tensor(numbers, dtype=torch.float64, device=self.device)
        if on_device:  # device-side copies, not host reads
            index = torch.tensor([i for i, _ in on_device], device=mine.device)
            mine[index] = torch.stack([value.to(mine.device, mine.dtype) for _, value in on_device])
        return mine

    def post(self, result: StepResult, loss_sum: float) -> tuple[StepResult, SumExchange]:
        """Start summing ``vector`` over ranks without waiting (async-1f1b: one per mini-batch)."""
        return result, SumExchange(self.vector(result, loss_sum), *self.groups)

    def collect(self, result: StepResult, exchange: SumExchange) -> StepResult:
        """Finish ``post``."""
        with peers_answer("the end-of-step report (loss and metrics summed over every rank)"):
            total = exchange.wait().tolist()
        host_sync.note("step report")
        return self.read(result, total)

    def read(self, result: StepResult, total: list[float]) -> StepResult:
        """``result`` from the sum of every rank's ``vector``: the global mean loss; per-stage numbers
        averaged over replicas (bytes summed)."""
        V, D = self.num_stages, self.replicas
        result.loss = total[0] / total[1]
        result.samples = int(total[1])
        part = lambda i: total[2 + i * V: 2 + (i + 1) * V]  # noqa: E731
        for i, f in enumerate(self._fields):
            kind = f.metadata["per_stage"]
            setattr(result, f.name, [kind(x / D) for x in part(i)])
        n = len(self._fields)
        result.comm_bytes = {k: [int(x) for x in part(n + i)] for i, k in enumerate(COMM_KINDS)}
        result.stop_requested = total[-1] > 0
        return result


def _read_on_host(values: list) -> list:
    """The staleness diagnostics stay on the device until the report: one read per device for all stages."""
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(values):
        if isinstance(x, torch.Tensor):
            by_device.setdefault(x.device, []).append(i)
    out = list(values)
    for indices in by_device.values():
        host_sync.note("staleness diagnostics")
        for i, x in zip(indices, torch.stack([values[i].double() for i in indices]).tolist()):
            out[i] = x
    return out

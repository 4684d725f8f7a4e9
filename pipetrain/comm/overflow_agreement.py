"""Agreeing on skip-or-step: every position skips the same optimizer steps.

Each position reports flags (non-finite gradients, including fp16 overflow; non-finite losses);
the agreement returns, per flag, the first position that raised it anywhere. Maximising
``participants - index`` over the flagged positions gives both whether and where in one number per flag.

In one process the positions of the local engine wait for each other inside the executor loop;
across processes it is one collective over every rank, the only one of the decision (the fp16
loss scaler's overflow flag travels in it too): an all-reduce (MAX), or, in a sync step, the step
report's sum with the flags as a maximised part (pipetrain.comm.reporting.SumExchange).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from pipetrain.comm import recording
from pipetrain.comm.peers import peers_answer
from pipetrain.comm.reporting import SumExchange
from pipetrain.runtime import host_sync
from pipetrain.runtime.optimizer_step import Agreed
from pipetrain.runtime.progress import BLOCKED


def _first(code: list[float], participants: int) -> list[int | None]:
    return [None if c == 0 else participants - int(c) for c in code]


def combine_norm_parts(parts: torch.Tensor, largest: bool) -> torch.Tensor:
    """The positions' gradient-norm parts (float64, in position or rank order) combined as both engines do: summed
    (p-th powers) or, for the inf-norm, maximised."""
    return parts.amax(0) if largest else parts.sum(0)


class LocalOverflowAgreement:
    """All positions in one process: the step of mini-batch t waits until every position reported; the
    first position to go on reads the agreed flags (and the summed gradient-norm parts) once for all of them.
    ``largest_norm``: norm parts are maximised (the inf-norm), not summed."""

    def __init__(self, positions: int, describe: Callable[[int], str] = lambda d: f"pipeline position {d}",
                 largest_norm: bool = False):
        self.positions = positions
        self.describe = describe
        self.largest_norm = largest_norm
        self.flags: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.codes: dict[int, tuple[list[float], float]] = {}
        self.read: dict[int, int] = {}

    def agree(self, t: int, position: int, flags: torch.Tensor, report: torch.Tensor | None,
              norm_part: torch.Tensor) -> Generator[str, None, Agreed]:
        """This position's flags and gradient-norm part for mini-batch t; waits (BLOCKED) for every position, returns
        the first reporters and the combined norm part. No ``report``: one process has nothing to sum over ranks."""
        if t not in self.flags:
            self.flags[t] = {}
        self.flags[t][position] = (flags.detach() * (self.positions - position), norm_part)
        while len(self.flags[t]) < self.positions:
            yield BLOCKED
        if t not in self.codes:
            host_sync.note("skip-or-step decision")  # the decision is the host's: step or not
            found = [self.flags[t][d] for d in range(self.positions)]
            here = found[0][0].device
            code = torch.stack([f.to(here) for f, _ in found]).amax(0).double()
            parts = torch.stack([n.reshape(1).to(here, torch.float64) for _, n in found])
            read = torch.cat([code, combine_norm_parts(parts, self.largest_norm)]).tolist()  # one host read
            self.codes[t] = (read[:-1], read[-1])
        code, norm = self.codes[t]
        self.read[t] = self.read.get(t, 0) + 1
        if self.read[t] == self.positions:
            self.forget(t)
        return Agreed(_first(code, self.positions), norm=norm)

    def where(self, index: int) -> str:
        return self.describe(index)

    def post(self, t: int, position: int, flags: torch.Tensor) -> None:
        """In one process every position's step already runs in turn: nothing to gain in the background."""
        return None

    def forget(self, t: int) -> None:
        """Drop what is kept for mini-batch t once every position read it."""
        self.flags.pop(t, None)
        self.codes.pop(t, None)
        self.read.pop(t, None)

    def abandon(self) -> None:
        """A step raised: drop every flag reported for it (some positions never reached its STEP)."""
        self.flags.clear()
        self.codes.clear()
        self.read.clear()


class DistributedOverflowAgreement:
    """One collective over ``group`` (all ranks), blocking at STEP t: a sum of the step report and the gradient-norm
    parts with the flags as its maximised part (an async stream's background agreement: an all-reduce, ``post``)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 describe: Callable[[int], str] = lambda r: f"rank {r}", largest_norm: bool = False):
        self.largest_norm = largest_norm
        self.group = group
        self.device = device  # NCCL reduces device tensors only
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.describe = describe
        self.recorder = recording.active()  # None unless a test records what is posted

    def agree(self, t: int, position: int, flags: torch.Tensor, report: torch.Tensor | None,
              norm_part: torch.Tensor) -> Generator[str, None, Agreed]:
        """This rank's flags for mini-batch t, maximised over every rank; returns the first reporters,
        ``report`` summed over every rank and the gradient-norm parts combined, all in one exchange: the summed
        part is [report..., norm (a p-th power)], the maximised one [flags..., norm (the inf-norm's)]."""
        code = flags.detach().to(self.device, torch.float64) * (self.size - self.rank)
        if self.recorder is not None:
            self.recorder.collective("agreement", list(range(self.size)), self.rank)
        yield from ()
        norm = norm_part.detach().reshape(1).to(self.device, torch.float64)
        reported = [report.to(self.device, torch.float64)] if report is not None else []
        summed = reported + ([] if self.largest_norm else [norm])
        maximised = [code] + ([norm] if self.largest_norm else [])
        # Waited on at once, so the broadcast can share the group (nothing else is in flight on it).
        exchange = SumExchange(torch.cat(summed + maximised), self.group, self.group,
                               maximised=sum(x.numel() for x in maximised))
        with self._peers_answer(t):
            total = exchange.wait().tolist()
        host_sync.note("skip-or-step decision and step report" if report is not None else "skip-or-step decision")
        at = sum(x.numel() for x in summed)  # where the flags start
        first = _first(total[at:at + code.numel()], self.size)
        reported_total = total[:report.numel()] if report is not None else None
        return Agreed(first, reported_total, total[-1] if self.largest_norm else total[at - 1])

    def post(self, t: int, position: int, flags: torch.Tensor) -> Callable[[], list[int | None]]:
        """The same all-reduce, started without waiting; the returned call waits and decodes it."""
        code = flags.detach().to(self.device, torch.float32) * (self.size - self.rank)
        work = dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def result() -> list[int | None]:
            with self._peers_answer(t):
                work.wait()
            host_sync.note("skip-or-step decision")
            return _first(code.tolist(), self.size)
        return result

    def where(self, index: int) -> str:
        return self.describe(index)

    def _peers_answer(self, t: int) -> contextlib.AbstractContextManager:
        """A rank that died or hangs before its step: an error that says so, not gloo's bare time-out."""
        return peers_answer(f"the skip-or-step agreement of mini-batch {t} (every rank, each optimizer step)",
                            "raise wrap(..., timeout=...) for very slow steps")

    def abandon(self) -> None:
        """Nothing is kept between steps."""

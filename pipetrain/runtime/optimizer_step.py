"""The STEP action: make tied copies agree, check for non-finite values (and unscale in fp16), agree
on skip-or-step everywhere, step.

Every device runs this at its STEP of mini-batch t. The decisions that need more than one
device (tied gradients, skip-or-step) are made by objects the engine gives it
(pipetrain.comm): in one process the positions wait for each other inside the executor loop;
across processes it is one collective per step.

Skip-or-step is ONE agreement per step whatever the precision: each position checks its gradients
with the fused kernel torch's GradScaler uses (in fp16 the same call unscales them) and the last
stage checks its losses; the agreement takes the maximum of those flags over every position of every
replica. A step is skipped everywhere or nowhere, so stages and replicas never diverge.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch import nn

from pipetrain.runtime.local_shards import local_grads
from pipetrain.runtime.nonfinite import NonFiniteError, advice, check_and_unscale_, first_nonfinite, losses_nonfinite
from pipetrain.runtime.precision import DynamicLossScaler
from pipetrain.runtime.stage import StageRuntime

GRADS, LOSSES = 0, 1  # the entries of the flags every position reports


class TiedSync(Protocol):
    """Makes the copies of tied parameters agree before the step (pipetrain.comm.tied)."""

    def sync(self, stages: list[int], t: int) -> Iterator[str]: ...

    def abandon(self) -> None:
        """Drop what was deposited for a step that raised."""


@dataclass
class Agreed:
    """The skip-or-step decision: per flag, the first position that raised it anywhere (None: no position
    did), the sum over ranks of the report that rode in the agreement's exchange (None without one), and
    every position's gradient-norm part combined (summed p-th powers, or the largest for the inf-norm)."""

    first: list[int | None]
    report: list[float] | None = None
    norm: float = math.nan


class OverflowAgreement(Protocol):
    """Makes every position take the same skip-or-step decision (pipetrain.comm.overflow_agreement).

    ``agree`` takes this position's flags (a float tensor, 1 where found: [non-finite gradients,
    non-finite losses]) and returns, per flag, the index of the first position (``where`` describes
    it) that raised it anywhere, or None where no device did; a ``report`` (a float64 vector, across
    processes only) is summed over every rank in the same exchange, so a sync step waits for one
    collective, not two, and so is this position's ``norm_part`` of the global gradient norm (GradientNorm.part;
    maximised for the inf-norm). ``abandon`` drops what is kept for a step that raised before every position
    read the decision.
    """

    def agree(self, t: int, position: int, flags: torch.Tensor, report: torch.Tensor | None,
              norm_part: torch.Tensor) -> Generator[str, None, Agreed]: ...

    def where(self, index: int) -> str: ...

    def abandon(self) -> None: ...

    def post(self, t: int, position: int, flags: torch.Tensor) -> Callable[[], list[int | None]] | None:
        """Start the agreement without waiting and return what waits for its result; None where the
        agreement cannot run in the background (one process: the positions wait in the executor loop)."""


class Shards(Protocol):
    """ZeRO: what this replica steps, and the all-gather of the owners' updates (pipetrain.comm.replicas.StageReducer)."""

    def stepped(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(tensor, its parameter) for each tensor this replica's optimizers step (a parameter it owns whole, or
        a flat slice of one) that holds a reduced gradient."""

    def gather(self) -> None: ...


class StepReport(Protocol):
    """A sync step's report, taken at STEP (pipetrain.runner)."""

    def vector(self, t: int) -> torch.Tensor | None:
        """Before the agreement: what this process reports, to be summed over ranks in the agreement's
        exchange (None in one process, whose devices report once all of them agreed)."""

    def agreed(self, t: int, skip: bool, total: list[float] | None, grad_norm: float) -> None:
        """Once every position agreed, before the update: the sum of ``vector`` over ranks (None: none) and the
        global gradient norm."""


@dataclass(frozen=True)
class GradientNorm:
    """How the global gradient norm is taken and applied: ``norm_type`` (p, or inf), ``max_norm`` (None:
    measured, not clipped); ``counted``: whether this position's gradients count (replica 0's without ZeRO,
    every replica's own shard with it); ``duplicates``: ids of tied copies after the first (counted once)."""

    norm_type: float = 2.0
    max_norm: float | None = None
    counted: bool = True
    duplicates: frozenset[int] = frozenset()

    def part(self, stepped: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
        """This position's part of the global norm (float64) over the gradients of ``stepped`` ((tensor, its
        parameter) pairs: a ZeRO slice counts for its parameter): the p-th power of their norm, or for the
        inf-norm their largest entry, as clip_grad_norm_ would take it over these gradients (their local shards)
        alone."""
        grads = local_grads(t for t, p in stepped if id(p) not in self.duplicates) if self.counted else []
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=device)
        norm = torch.nn.utils.get_total_norm(grads, self.norm_type).to(device, torch.float64)
        return norm if self.norm_type == math.inf else norm ** self.norm_type

    def total(self, combined: float) -> float:
        """The global norm from the positions' parts combined."""
        return combined if self.norm_type == math.inf else combined ** (1.0 / self.norm_type)

    def clip_(self, params: list[torch.Tensor], total: float, device: torch.device) -> None:
        """Scale the gradients by max_norm / (total + 1e-6) where that is below 1, as clip_grad_norm_ does (on
        their local shards: a sharded gradient is scaled where it lives)."""
        grads = local_grads(params)
        if self.max_norm is not None and self.max_norm != math.inf and grads:
            coefficient = self.max_norm / (torch.tensor(total, dtype=torch.float32, device=device) + 1e-6)
            torch._foreach_mul_(grads, torch.clamp(coefficient, max=1.0))


class OptimizerStep:
    """What one position does at STEP t for all of its stages; the generator returns whether t was skipped.

    ``nonfinite``: "raise" (a NonFiniteError on every rank, after they agreed) or "skip" (no
    optimizer step and no staleness-policy update on any stage, gradients zeroed). In fp16 a
    non-finite gradient is a loss-scale overflow, always skipped (the scale backs off); a non-finite
    loss is not (scaling happens after the loss), so it follows ``nonfinite`` there too.
    ``process_stages``: every (stage, module) this process holds, to name the bad parameter.
    ``shards`` (ZeRO): this position checks and steps only the tensors its replica owns, then all-gathers;
    the agreement still spans every rank, so all replicas skip, raise or step together.
    """

    def __init__(self, stages: list[StageRuntime], tied: TiedSync, scaler: DynamicLossScaler | None,
                 agreement: OverflowAgreement, nonfinite: str = "raise", precision: str = "fp32",
                 position: int = 0, process_stages: Sequence[tuple[int, nn.Module]] | None = None,
                 shards: Shards | None = None, grad_norm: GradientNorm = GradientNorm()):
        self.stages = stages
        self.grad_norm = grad_norm
        self.grad_norms: dict[int, float] = {}  # STEP t -> its global gradient norm (streams report it)
        self.shards = shards
        self.indices = [s.index for s in stages]
        self.tied = tied
        self.scaler = scaler
        self.agreement = agreement
        self.nonfinite = nonfinite
        self.precision = precision
        self.position = position
        self.process_stages = list(process_stages) if process_stages is not None else [
            (s.index, s.module) for s in stages]
        self.device = stages[0].device if stages else torch.device("cpu")
        # async-1f1b with nonfinite="raise": the agreement of the previous step, still running, with what
        # this position found then (t, wait for the result, this position's first bad parameter).
        self.in_flight: tuple[int, Callable[[], list[int | None]], tuple[int, str] | None] | None = None
        self.first_update = 1  # the pipeline's update number of mini-batch 0 of the current call (messages)
        self.stream = False
        self.applied = False  # whether this call changed weights or optimizer state (a step past undoing)

    def __call__(self, t: int, losses: list[torch.Tensor],
                 report: StepReport | None = None) -> Generator[str, None, bool]:
        """STEP t, given the losses of mini-batch t's micro-batches computed by this position (if any). A sync
        step's ``report``: under torchrun it rides in the agreement's exchange, so the step waits for one
        collective (not an agreement, then a report after it); in one process it is taken once all agreed."""
        yield from self.tied.sync(self.indices, t)
        # With ZeRO each replica checks, measures and clips what it steps: every element exactly once.
        stepped = self.shards.stepped() if self.shards is not None else [
            (p, p) for s in self.stages for p in s.params if p.grad is not None]
        params = [t for t, _ in stepped]
        if self.scaler is not None:
            grads_bad = self.scaler.unscale_local_(params, self.device)
        else:
            grads_bad = check_and_unscale_(local_grads(params), 1.0, self.device)
        flags = torch.cat([grads_bad, losses_nonfinite(losses, self.device)])
        # With ZeRO every replica must take the same decision before stepping: each all-gathers its update; with
        # max_grad_norm every stage needs the global norm of the update before stepping.
        if self.stream and self.nonfinite == "raise" and self.shards is None and self.grad_norm.max_norm is None:
            result = self.agreement.post(t, self.position, flags)
            if result is not None:
                return self._step_then_agree(t, flags, result)
        vector = report.vector(t) if report is not None else None
        agreed = yield from self.agreement.agree(t, self.position, flags, vector,
                                                 self.grad_norm.part(stepped, self.device))
        norm = self.grad_norm.total(agreed.norm)
        if self.stream:  # a sync step hands its norm to its report (report.agreed)
            self.grad_norms[t] = norm
        first = agreed.first
        overflow = self.scaler is not None and first[GRADS] is not None
        bad = first[LOSSES] is not None or (self.scaler is None and first[GRADS] is not None)
        if bad and self.nonfinite == "raise":
            # Raised before anything moves: the runner then abandons the step on every position
            # (gradients dropped, loss scale unchanged), as for any step that raises.
            raise NonFiniteError(self._message(t, first))
        skip = overflow or bad
        if report is not None:
            report.agreed(t, skip, agreed.report, norm)
        if self.scaler is not None:
            self.scaler.update(overflow)
        if not skip:
            self.grad_norm.clip_(params, norm, self.device)
        self._apply(skip)
        return skip

    def _apply(self, skip: bool) -> None:
        """Step every stage of this position (or skip the step), then clear the gradients."""
        self.applied = True
        for s in self.stages:
            if s.optimizer is not None:
                if not skip:
                    s.policy.before_step()
                    s.optimizer.step()
                    for scheduler in s.schedulers:
                        scheduler.step()  # once per applied update: a skipped one does not advance the schedule
                s.optimizer.zero_grad(set_to_none=True)
            if skip or self.shards is not None:
                # A stage without an optimizer still must not carry bad gradients into the next step; with
                # ZeRO the optimizer holds only what this replica owns, and the parameters' gradients go too.
                s.module.zero_grad(set_to_none=True)
        if not skip and self.shards is not None:
            self.shards.gather()  # before on_step: a policy that copies the weights sees the updated ones
        for s in self.stages:
            if skip:
                s.policy.on_skip()
            else:
                s.policy.on_step()

    def _step_then_agree(self, t: int, flags: torch.Tensor, result: Callable[[], list[int | None]]) -> bool:
        """async-1f1b, nonfinite="raise", several processes: the stream never flushes, so waiting at STEP t
        for every rank would hold each stage until stage 0 finished mini-batch t's backward (N-1 backward
        hops every mini-batch). Nothing needs the decision before the next step, so STEP t steps on this
        position's own finding while the all-reduce runs, and STEP t + 1 (or the end of the stream) reads
        it: every rank raises there, before applying t + 1. Stages whose gradients were finite have then
        applied update t; a stage that found a non-finite value never applies it."""
        self.finish_stream()
        mine = bool(flags.any())
        found = first_nonfinite(self.process_stages) if mine and self.scaler is None else None
        self.in_flight = (t, result, found)
        self._apply(mine)
        return mine

    def finish_stream(self) -> None:
        """Read the agreement still running from the last step; raise NonFiniteError if any rank found a
        non-finite value there (every rank raises at the same point)."""
        if self.in_flight is None:
            return
        t, result, found = self.in_flight
        self.in_flight = None
        first = result()
        if first[LOSSES] is not None or first[GRADS] is not None:
            raise NonFiniteError(self._message(t, first, found, applied="stages whose gradients were finite applied "
                                               "it (an async stream learns of it one step later)"))

    def connect(self, tied: TiedSync, agreement: OverflowAgreement, shards: Shards | None = None) -> None:
        """Use new connections to the other devices (the engine reconnected after a failed step)."""
        self.tied, self.agreement = tied, agreement
        if self.shards is not None:
            self.shards = shards

    def start(self, first_update: int, stream: bool) -> None:
        """Called before each step() (stream=False) or train() stream: the update number of its
        mini-batch 0, for messages."""
        self.first_update = first_update
        self.stream = stream
        self.applied = False
        self.grad_norms.clear()  # a call that raised may have left some behind

    def _message(self, t: int, first: list[int | None], found: tuple[int, str] | None = None,
                 applied: str = "the update was not applied on any stage") -> str:
        """Every rank raises; the one holding the first bad parameter names it, the others name that rank.
        ``applied``: what became of the update."""
        update = self.first_update + t
        when = f"optimizer step {update}" + (f" (mini-batch {t} of this train() stream)" if self.stream else "")
        if first[LOSSES] is not None:
            what = f"the loss is NaN or infinite at {when}, computed by {self.agreement.where(first[LOSSES])}"
        else:
            what = f"a gradient is NaN or infinite at {when}"
            if found is None and self.scaler is None:
                found = first_nonfinite(self.process_stages)
            if found is not None:
                what += f": stage {found[0]}, parameter {found[1]!r} (the first bad one)"
            else:
                what += f", found by {self.agreement.where(first[GRADS])}, whose error names the parameter"
        return (f"{what}; {applied} (nonfinite='raise'). To fix: "
                f"{advice(self.precision)}")

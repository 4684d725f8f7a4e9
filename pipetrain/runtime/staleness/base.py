"""The policy interface, the diagnostics every policy reports, and the two policies without
prediction: vanilla (latest weights) and stash (PipeDream weight stashing).

Writes into tensors that autograd saved go through ``.data`` on purpose: they must not bump the
version counter, because the point is that the backward reads new values.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Callable, Generic, TypeVar

import torch
from torch import nn

from pipetrain.runtime.staleness.extrapolation import Extrapolation
from schedules import StreamLags

WeightSet = dict[str, torch.Tensor]
V = TypeVar("V")


def _named_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def accumulate(params: list[tuple[str, nn.Parameter]], weights: WeightSet) -> None:
    """Move the gradients autograd left on ``weights`` into the live parameters' ``.grad``: handed over where
    ``.grad`` is empty (nothing else holds them once taken off ``weights``), added with one fused call where
    it is not. Policies that swap weights in call it once per weight set per mini-batch (autograd sums the
    micro-batches' gradients on the set meanwhile), and when a set is dropped."""
    into: list[torch.Tensor] = []
    adding: list[torch.Tensor] = []
    for name, p in params:
        w = weights[name]
        g = w.grad
        if g is None:
            continue
        w.grad = None
        if p.grad is None:
            p.grad = g
        else:
            into.append(p.grad)
            adding.append(g)
    if into:
        torch._foreach_add_(into, adding)


class VersionStore(Mapping, Generic[V]):
    """Weight versions shared by the micro-batches that use them, reference-counted: a version is made
    by the first micro-batch that asks for its key and dropped when the last user releases it (unless
    the caller says to keep it unused). ``on_drop`` sees every version that leaves by ``release`` or
    ``drop_unused`` (not by ``clear``). As a mapping: key -> version."""

    def __init__(self, on_drop: Callable[[V], None] | None = None):
        self.on_drop = on_drop
        self._entries: dict[object, tuple[V, int]] = {}  # key -> (version, micro-batches using it)
        self.key_of: dict[int, object] = {}  # micro-batch -> the key of the version it uses
        self.peak = 0  # the most versions held at once

    def __getitem__(self, key: object) -> V:
        return self._entries[key][0]

    def __iter__(self) -> Iterator[object]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, micro_batch: int, key: object, make: Callable[[], V]) -> V:
        """The version under ``key`` (made now if absent), used by ``micro_batch`` until it releases it."""
        version, users = self._entries.get(key, (None, 0))
        if version is None:
            version = make()
        self._entries[key] = (version, users + 1)
        self.key_of[micro_batch] = key
        self.peak = max(self.peak, len(self._entries))
        return version

    def add_unused(self, key: object, version: V) -> None:
        """Hold ``version`` under ``key`` with no user yet."""
        self._entries[key] = (version, 0)
        self.peak = max(self.peak, len(self._entries))

    def of(self, micro_batch: int) -> V:
        return self._entries[self.key_of[micro_batch]][0]

    def release(self, micro_batch: int, drop: Callable[[object], bool] = lambda key: True) -> V:
        """``micro_batch`` is done with its version; the version goes when nobody uses it and ``drop(key)``."""
        key = self.key_of.pop(micro_batch)
        version, users = self._entries[key]
        if users == 1 and drop(key):
            del self._entries[key]
            if self.on_drop is not None:
                self.on_drop(version)
        else:
            self._entries[key] = (version, users - 1)
        return version

    def drop_unused(self, where: Callable[[object], bool] = lambda key: True) -> None:
        """Drop the versions no micro-batch uses whose key satisfies ``where``."""
        for key, (version, users) in list(self._entries.items()):
            if users == 0 and where(key):
                del self._entries[key]
                if self.on_drop is not None:
                    self.on_drop(version)

    def clear(self) -> None:
        self._entries.clear()
        self.key_of.clear()


class StalenessPolicy:
    """Synchronous schedules: forward and backward both use the live parameters.

    Subclasses override ``_forward_weights`` / ``_before_backward``; the public methods around
    them record the diagnostics: per micro-batch the prediction distance its forward used, and
    for one sampled micro-batch per mini-batch the prediction error, the distance between the
    weights its forward used and the weights in force when its backward runs (those its gradient
    is applied to), in units of one update ``lr * |v|`` (v: the optimizer's smoothed update; NaN
    when the optimizer has none, e.g. SGD without momentum).
    """

    name = "none"
    keeps_forward_weights = True  # the forward's weight set is not overwritten before its backward
    # Recomputation keeps, beside the versions above, the forward's weights of every micro-batch in
    # flight (stage k of N: N - k), which nothing else would keep until the forward runs again.
    recompute_keeps_forward_weights = False

    @classmethod
    def weight_versions(cls, stage: int, stages: int) -> int:
        """The most weight copies beyond the live parameters that stage ``stage`` of ``stages`` holds
        (without recomputation): the memory model's count."""
        return 0

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, stage: int, stages: int,
                 micro_batches: int = 1, lookahead: float = 1.0):
        self.module = module
        self.optimizer = optimizer
        self.stage = stage
        self.stages = stages
        self.micro_batches = micro_batches
        self.lookahead = lookahead
        self.params = _named_params(module)
        self._version_bytes = sum(p.numel() * p.element_size() for _, p in self.params)  # one weight copy
        self.updates = 0  # optimizer steps taken by this stage
        self.distances: dict[int, float] = {}  # micro-batch -> prediction distance (updates) of its forward
        self.errors: dict[int, torch.Tensor | float] = {}  # sampled micro-batch -> prediction error (updates)
        self._probe: tuple[int, list[torch.Tensor]] | None = None  # the sampled micro-batch's forward weights
        self._update_size: Extrapolation | None = None
        # Delay corrections (pipetrain.runtime.staleness.corrections) read each step's gradient delay:
        self.records_delays = False
        self._forward_at: dict[int, int] = {}  # micro-batch -> updates applied when its forward ran
        self._step_delays: list[float] = []  # the delays of the gradients the next step applies
        # Run first at each stream's start, when a checkpoint may have been loaded (stage_momentum re-derives
        # the stage's momentum from the loaded groups).
        self.stream_hooks: list[Callable[[], None]] = []
        if optimizer is not None and self.name != "none":
            try:
                self._update_size = Extrapolation(optimizer, [p for _, p in self.params])
            except TypeError:  # no smoothed update: the error has no unit (reported as NaN)
                pass

    # -- what the stage runtime calls ------------------------------------------------------------

    def forward_weights(self, micro_batch: int) -> WeightSet | None:
        """Weights for the forward of ``micro_batch``; None means the module's own."""
        weights = self._forward_weights(micro_batch)
        if self.records_delays:
            self._forward_at[micro_batch] = self.updates
        if weights is not None:
            self.distances[micro_batch] = self.distance(micro_batch)
            if self._probe is None and self._sampled(micro_batch):
                kept = [weights[n] for n, _ in self.params]
                self._probe = (micro_batch, kept if self.keeps_forward_weights else [w.detach().clone() for w in kept])
        return weights

    def before_backward(self, micro_batch: int) -> None:
        """Make the weights the backward of ``micro_batch`` must see current."""
        if self._probe is not None and self._probe[0] == micro_batch:
            self.errors[micro_batch] = self._error(self._probe[1])
            self._probe = None
        if self.records_delays:
            lag = self.updates - self._forward_at.pop(micro_batch)
            self._step_delays.append(self.gradient_delay(micro_batch, lag))
        self._before_backward(micro_batch)

    def gradient_delay(self, micro_batch: int, lag: int) -> float:
        """Updates between the weights the gradient of ``micro_batch`` is computed at and the weights it is
        applied to; ``lag``: the updates between its forward and its backward, which it is for every policy
        whose forward meets the weights in force (or their prediction)."""
        return float(lag)

    def steady_delay(self) -> float:
        """The mean gradient delay of a mini-batch past the warm-up: stage k of N at m micro-batches per
        mini-batch, the mean lag of the schedule's steady period ((N - k - 1) / m on average)."""
        lags = StreamLags(self.stage, self.stages, self.micro_batches)
        return sum(lags(lags.steady + j) for j in range(self.micro_batches)) / self.micro_batches

    def scale_learning_rate(self, scale: Callable[[], float]) -> None:
        """The optimizer's steps scale its rates by ``scale()``: predictions and their unit follow."""
        if self._update_size is not None:
            self._update_size.lr_scale = scale

    def take_step_delay(self) -> float:
        """The mean delay of the gradients the step about to run applies (forgotten afterwards)."""
        delays, self._step_delays = self._step_delays, []
        return sum(delays) / len(delays) if delays else 0.0

    def after_backward(self, micro_batch: int, last: bool) -> None:
        """Release what the backward of ``micro_batch`` held. Gradients computed on weight copies reach the
        live parameters' ``.grad`` by the mini-batch's ``last`` backward on this stage, before its reduction
        and step read them."""

    def keep_for_recompute(self, micro_batch: int) -> None:
        """The forward of ``micro_batch`` will run again before its backward: keep its weights if
        nothing else does (called right after ``forward_weights``)."""

    def recompute_weights(self, micro_batch: int) -> WeightSet | None:
        """The weights to run the forward of ``micro_batch`` again with, right before its backward: those
        its forward used (None: the module's own, unchanged since without an asynchronous schedule)."""
        return None

    def before_step(self) -> None:
        """Called right before the optimizer applies an update (not for a skipped step)."""

    def on_step(self) -> None:
        self.updates += 1
        if self._update_size is not None:
            self._update_size.invalidate()

    def receive_updates(self, updates: list[torch.Tensor]) -> None:
        """ZeRO: ``lr * v`` of each of this stage's parameters (in ``params`` order), all-gathered from the
        replicas that step them after every update, for the prediction (see Extrapolation.provide)."""
        if self._update_size is not None:
            self._update_size.provide(updates)

    def on_skip(self) -> None:
        """Called instead of ``before_step`` and ``on_step`` when a step is skipped on every stage
        (nonfinite="skip", fp16 overflow): the weights and the optimizer state did not move."""
        self._step_delays.clear()

    def start_stream(self) -> None:
        """A train() stream begins: micro-batch numbers start again at 0 and the optimizer state may
        have been loaded from a checkpoint since the last stream."""
        for hook in self.stream_hooks:
            hook()
        if self._update_size is not None:
            self._update_size.invalidate()

    def end_stream(self) -> None:
        """The stream has drained (or was abandoned): drop what only later micro-batches would read."""
        self._probe = None

    def abandon(self) -> None:
        """A step or stream raised: forget the micro-batches in flight, their diagnostics and the gradients
        held outside the parameters, as if they had never run."""
        self.end_stream()
        self.distances.clear()
        self.errors.clear()
        self._forward_at.clear()
        self._step_delays.clear()

    def take_diagnostics(self, micro_batches: range) -> tuple[float, torch.Tensor | float]:
        """The mean prediction distance and error over ``micro_batches`` (forgotten afterwards); the error is
        NaN where no micro-batch of them was sampled (0.0 for synchronous schedules: nothing ever differs)."""
        distance = _mean_popped(self.distances, micro_batches, 0.0)
        return distance, _mean_popped(self.errors, micro_batches, 0.0 if self.name == "none" else math.nan)

    def extra_weight_bytes(self) -> int:
        """Bytes held in weight copies beyond the live parameters."""
        held = self.versions_held()
        return self._version_bytes * held if held else 0

    def versions_held(self) -> int:
        return 0

    def distance(self, micro_batch: int) -> float:
        """How many updates ahead the forward of ``micro_batch`` predicts the weights (0: no prediction)."""
        return 0.0

    # -- overridden by the policies --------------------------------------------------------------

    def _forward_weights(self, micro_batch: int) -> WeightSet | None:
        return None

    def _before_backward(self, micro_batch: int) -> None:
        pass

    # -- diagnostics -----------------------------------------------------------------------------

    def _sampled(self, micro_batch: int) -> bool:
        # One micro-batch per mini-batch, its position rotating from one mini-batch to the next so
        # every position (and so every lag the schedule gives) is measured in turn.
        m = self.micro_batches
        return micro_batch % m == (micro_batch // m) % m

    def _error(self, forward: list[torch.Tensor]) -> torch.Tensor | float:
        """A device scalar (read once per step by the reporter, not here: a read would stall a GPU)."""
        if self._update_size is None or not self.params:
            return math.nan
        unit = self._update_size.update_norm()
        live = [p.detach() for _, p in self.params]
        diff = torch._foreach_sub([w.detach() for w in forward], live)
        distance = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(diff)))
        # Before the first step nothing has moved (unit 0) and nothing was predicted: no error.
        return torch.where(unit > 0, distance / unit.clamp_min(torch.finfo(unit.dtype).tiny), 0.0)


class VanillaPolicy(StalenessPolicy):
    """Latest weights in the forward and in the backward (PipeDream without stashing)."""

    name = "vanilla"
    keeps_forward_weights = False  # the aliases follow the live weights

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Aliases share storage with the live weights but not their version counter,
        # so in-place optimizer steps are visible to the backward without tripping autograd.
        self.alias = {n: p.data.requires_grad_() for n, p in self.params}

    def _forward_weights(self, micro_batch: int) -> WeightSet:
        return self.alias

    def after_backward(self, micro_batch: int, last: bool) -> None:
        if last:  # the aliases summed every micro-batch's gradient meanwhile: one hand-over per mini-batch
            accumulate(self.params, self.alias)

    def recompute_weights(self, micro_batch: int) -> WeightSet:
        # Vanilla keeps no old weights: the recomputed forward runs on the weights in force.
        return self.alias

    def abandon(self) -> None:
        super().abandon()
        for w in self.alias.values():
            w.grad = None


class StashPolicy(StalenessPolicy):
    """PipeDream weight stashing: the backward uses exactly the forward's weight version.

    Versions are keyed by ``_key(micro_batch)``, a tuple whose first entry is the update count at the
    forward, and made by ``_make_version``; subclasses that stash predicted weights key them by prediction
    as well. A version made from the weights in force stays, even unused, until the next update: the
    micro-batches forwarded before it reuse it instead of copying the same weights again (on the last
    stage, where each forward is followed by its backward, that is one copy per mini-batch, not per
    micro-batch).
    """

    name = "stash"

    @classmethod
    def weight_versions(cls, stage: int, stages: int) -> int:
        # One per micro-batch in flight (N - k), each forwarded after a different update.
        return stages - stage

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A version that goes hands its gradients over (those of the micro-batches that used it).
        self.versions: VersionStore[WeightSet] = VersionStore(on_drop=lambda version: accumulate(self.params, version))
        # DC-ASGD: the mean over the mini-batch's micro-batches of the weights their gradients were computed at
        # (id of the live parameter -> tensor); None when nobody reads it.
        self._stale: dict[int, torch.Tensor] | None = None

    def keep_stale_mean(self) -> None:
        """From now on, average the weights each backward's gradient is computed at, per mini-batch."""
        self._stale = {}

    def take_stale_mean(self) -> dict[int, torch.Tensor] | None:
        """The averaged weights of the mini-batch whose step is about to run (forgotten afterwards)."""
        stale, self._stale = self._stale, ({} if self._stale is not None else None)
        return stale

    def _before_backward(self, micro_batch: int) -> None:
        if self._stale is None:
            return
        version = self.versions.of(micro_batch)
        with torch.no_grad():
            for name, p in self.params:
                mean = self._stale.get(id(p))
                if mean is None:
                    self._stale[id(p)] = version[name].detach() / self.micro_batches
                else:
                    mean.add_(version[name].detach(), alpha=1.0 / self.micro_batches)

    @property
    def peak_versions(self) -> int:
        return self.versions.peak

    def _key(self, micro_batch: int) -> object:
        return (self.updates,)

    def _make_version(self, micro_batch: int) -> WeightSet:
        return {n: p.detach().clone().requires_grad_() for n, p in self.params}

    def _forward_weights(self, micro_batch: int) -> WeightSet:
        return self.versions.acquire(micro_batch, self._key(micro_batch), lambda: self._make_version(micro_batch))

    def recompute_weights(self, micro_batch: int) -> WeightSet:
        return self.versions.of(micro_batch)

    def after_backward(self, micro_batch: int, last: bool) -> None:
        self.versions.release(micro_batch, self._release_when_unused)
        if last:  # versions still held keep the gradients of this mini-batch's micro-batches until now
            for version in self.versions.values():
                accumulate(self.params, version)

    def _release_when_unused(self, key: object) -> bool:
        return key[0] != self.updates  # type: ignore[index]

    def on_step(self) -> None:
        super().on_step()
        self.versions.drop_unused(self._release_when_unused)

    def on_skip(self) -> None:
        super().on_skip()
        if self._stale is not None:
            self._stale = {}

    def abandon(self) -> None:
        super().abandon()
        self.versions.clear()  # with the micro-batches that used them, and the gradients they held
        if self._stale is not None:
            self._stale = {}

    def _predicted_version(self, steps: Callable[[dict], float]) -> WeightSet:
        """A new version holding W - steps(group) * lr * v (the stage's own weights before any step)."""
        if self._update_size is None:  # a stage without parameters
            return {}
        weights = {n: torch.empty_like(p).requires_grad_() for n, p in self.params}
        self._update_size.write(list(weights.values()), steps)
        return weights

    def versions_held(self) -> int:
        return len(self.versions)


def _mean_popped(values: dict, micro_batches: range, empty: float):
    """Mean of the entries of ``micro_batches`` (removed from ``values``); ``empty`` when there are none."""
    found = [values.pop(g) for g in micro_batches if g in values]
    return sum(found) / len(found) if found else empty

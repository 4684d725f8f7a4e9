"""SpecTrain weight prediction (Chen et al., 2018), by the schedule's real lag per micro-batch.

The paper predicts floor(k/2) + N-k-1 updates ahead in the forward and floor(k/2) in the
backward, with one micro-batch per mini-batch. With m micro-batches a stage steps once every m
backwards, so the distance counts real updates: s_fwd(u) = lag(u) + floor(k/2)/m (the paper's
floor(k/2) slots of offset are micro-batch slots, 1/m of an update each) and s_bwd = floor(k/2)/m,
where lag(u) is read off the stage's action list (schedules.StreamLags). ``lookahead`` scales
both: 1 is the prediction above, larger values predict further ahead than the weights will move.
"""
from __future__ import annotations

import torch

from pipetrain.runtime.staleness.base import StalenessPolicy, StashPolicy, VersionStore, WeightSet, accumulate
from pipetrain.runtime.staleness.extrapolation import require_smoothed_update
from schedules import StreamLags


class SpecTrainPolicy(StalenessPolicy):
    """Forward and backward use W_hat = W - s * lr * v (v: the optimizer's smoothed update).

    One scratch copy of the weights serves every in-flight micro-batch: it is rewritten with
    the forward prediction before each forward and with the backward prediction before each
    backward, so memory stays at one extra version whatever the depth.
    """

    name = "spectrain"
    keeps_forward_weights = False
    recompute_keeps_forward_weights = True  # the scratch copy is rewritten: a recomputed forward needs its own

    @classmethod
    def weight_versions(cls, stage: int, stages: int) -> int:
        return 1  # the scratch copy

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require_smoothed_update(self.optimizer)
        self.lags = StreamLags(self.stage, self.stages, self.micro_batches)
        self.offset = (self.stage // 2) / self.micro_batches
        self.s_bwd = self.lookahead * self.offset
        # Predicting 0 updates ahead in both passes (the last stage of a short pipeline) means W as it
        # is at forward and at backward time: aliases of the live weights give exactly that, copy-free.
        ahead = self.offset > 0 or self.stages - self.stage - 1 > 0
        self.predicts = self.optimizer is not None and self.lookahead != 0 and ahead
        self.scratch = ({n: torch.empty_like(p).requires_grad_() for n, p in self.params} if self.predicts
                        else {n: p.data.requires_grad_() for n, p in self.params})
        self._outs = list(self.scratch.values())
        self._holds: tuple[int, float] | None = None  # (updates, distance) of the prediction in the scratch copy
        # Forward predictions kept for recomputation, keyed by (updates, distance).
        self.kept: VersionStore[list[torch.Tensor]] = VersionStore()

    def distance(self, micro_batch: int) -> float:
        return self.lookahead * (self.lags(micro_batch) + self.offset)

    def _forward_weights(self, micro_batch: int) -> WeightSet:
        if self.predicts:
            self._predict(self.distance(micro_batch))
        return self.scratch

    def _predict(self, steps: float) -> None:
        """Write W - steps * lr * v into the scratch copy, unless it holds that very prediction already: the
        backward of a micro-batch whose forward predicted as far with no update since (the last stage, where
        the forward's and the backward's distances are both the offset) needs no second write."""
        if self._holds != (self.updates, steps):
            self._update_size.write(self._outs, lambda group: steps)
            self._holds = (self.updates, steps)

    def keep_for_recompute(self, micro_batch: int) -> None:
        if not self.predicts:  # no prediction: the forward ran on the weights in force, as vanilla's does
            return
        key = (self.updates, self.distance(micro_batch))
        self.kept.acquire(micro_batch, key, lambda: [w.detach().clone() for w in self._outs])

    def recompute_weights(self, micro_batch: int) -> WeightSet:
        """The scratch copy holding the forward's prediction again (``_before_backward`` then writes the
        backward's prediction into it, so the backward sees what it would have without recomputation)."""
        if micro_batch in self.kept.key_of:
            kept_as = self.kept.key_of[micro_batch]  # (updates, distance) at the forward
            copies = self.kept.release(micro_batch)
            with torch.no_grad():
                torch._foreach_copy_([o.data for o in self._outs], copies)
            self._holds = kept_as
        return self.scratch

    def _before_backward(self, micro_batch: int) -> None:
        if self.predicts:
            self._predict(self.s_bwd)

    def after_backward(self, micro_batch: int, last: bool) -> None:
        if last:  # the scratch copy summed every micro-batch's gradient meanwhile
            accumulate(self.params, self.scratch)

    def versions_held(self) -> int:
        return (1 + len(self.kept)) if self.predicts else 0

    def receive_updates(self, updates: list[torch.Tensor]) -> None:
        super().receive_updates(updates)
        self._holds = None  # another v: the scratch copy's prediction is not the one its key says

    def start_stream(self) -> None:
        super().start_stream()
        self._holds = None  # weights or optimizer state may have been loaded since

    def end_stream(self) -> None:
        super().end_stream()
        self.kept.clear()

    def abandon(self) -> None:
        super().abandon()
        for w in self._outs:
            w.grad = None


class SpecTrainForwardOnlyPolicy(StashPolicy):
    """SpecTrain's forward-only variant: predict lag(u) updates ahead in the forward and keep that
    prediction for the backward (one copy per distinct (version, distance) in flight, like stash)."""

    name = "spectrain-forward"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require_smoothed_update(self.optimizer)
        self.lags = StreamLags(self.stage, self.stages, self.micro_batches)

    def distance(self, micro_batch: int) -> float:
        return self.lookahead * self.lags(micro_batch)

    def _key(self, micro_batch: int) -> object:
        return self.updates, self.distance(micro_batch)

    def _make_version(self, micro_batch: int) -> WeightSet:
        steps = self.distance(micro_batch)
        return self._predicted_version(lambda group: steps)

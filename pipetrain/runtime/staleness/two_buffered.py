"""PipeDream-2BW (Narayanan et al., ICML 2021): double-buffered weights, one update of delay.

Every micro-batch of mini-batch t (counted from the start of the train() stream) runs its
forward and its backward on weight version t - 1 (version 0 for t = 0), and the mini-batch's
gradient, summed over its micro-batches, is applied as update t + 1:

    W(t + 1) = W(t) - lr * step(grad f(W(t - 1)))

the same delay at every stage and any depth. The paper's condition m >= d (micro-batches per
mini-batch at least the depth) becomes m >= N - k - 1 here: stage k forwards N - k - 1
micro-batches ahead of its oldest backward, and version t - 1 must exist when the first
micro-batch of t is forwarded. Then at most two versions are in use at a time.
"""
from __future__ import annotations

from pipetrain.runtime.staleness.base import StashPolicy, WeightSet


def check_two_buffered(stages: int, micro_batches: int) -> None:
    """PipeDream-2BW's condition for every stage of an async-1f1b pipeline."""
    if micro_batches < stages - 1:
        raise ValueError(f"staleness='2bw' needs micro_batches >= stages - 1 = {stages - 1} (PipeDream-2BW's "
                         f"m >= depth: the first stage forwards {stages - 1} micro-batches ahead, and a one-update "
                         f"delay needs the previous version by then), got micro_batches={micro_batches}; raise "
                         "micro_batches or use staleness='stash'")


class TwoBufferedPolicy(StashPolicy):
    """Stashes version t - 1 for the micro-batches of mini-batch t; versions are released once no
    micro-batch uses them and a newer one is in use."""

    name = "2bw"

    @classmethod
    def weight_versions(cls, stage: int, stages: int) -> int:
        return 2

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_two_buffered(self.stages, self.micro_batches)
        # Steps of this stream, taken or skipped: version t is the weights after mini-batch t - 1's step,
        # whether that step moved them or not (counting only updates, a skip would shift every later key).
        self.steps = 0
        self.newest: int | None = None  # the newest version a forward has used

    def _key(self, micro_batch: int) -> int:
        return max(micro_batch // self.micro_batches - 1, 0)

    def _make_version(self, micro_batch: int) -> WeightSet:
        key = self._key(micro_batch)
        if key != self.steps:
            raise RuntimeError(f"2bw at stage {self.stage}: micro-batch {micro_batch} needs weight version {key} "
                               f"but the stage is at {self.steps} and did not keep it")
        return super()._make_version(micro_batch)

    def _forward_weights(self, micro_batch: int) -> WeightSet:
        weights = super()._forward_weights(micro_batch)
        self.newest = self._key(micro_batch)
        self.versions.drop_unused(lambda key: key < self.newest)
        return weights

    def _release_when_unused(self, key: object) -> bool:
        return self.newest is not None and key < self.newest

    def before_step(self) -> None:
        # The next mini-batch's micro-batches run on the version in force now; keep it before the
        # optimizer overwrites it (a no-op where a forward already stashed it).
        if self.steps not in self.versions:
            self.versions.add_unused(self.steps, super()._make_version(-1))

    def on_step(self) -> None:
        super().on_step()
        self.steps += 1

    def gradient_delay(self, micro_batch: int, lag: int) -> float:
        return float(self.steps - self._key(micro_batch))  # version t - 1 applied to version t: 1 past mini-batch 0

    def steady_delay(self) -> float:
        return 1.0

    def on_skip(self) -> None:
        super().on_skip()
        self.before_step()  # the next mini-batch still runs on the version in force now
        self.steps += 1

    def start_stream(self) -> None:
        super().start_stream()
        self.versions.clear()
        self.steps = 0
        self.newest = None

    def end_stream(self) -> None:
        super().end_stream()
        self.versions.drop_unused()

"""Which weights a stage's forward and backward use: the staleness policies.

With a synchronous schedule nothing changes between a micro-batch's forward and backward, so
the stage module is called with its own parameters. With async-1f1b the optimizer steps while
micro-batches are in flight; each policy then hands the forward an explicit set of weight
tensors (swapped in for the parameters, ``pipetrain.runtime.weight_swap``) and decides what those tensors hold when the backward
runs:

- vanilla: tensors that alias the live weights (PipeDream without stashing);
- stash: a copy per weight version, kept until the last backward that used it (PipeDream);
- 2bw: version t - 1 for every micro-batch of mini-batch t, at most two in use (PipeDream-2BW);
- spectrain: one scratch copy rewritten with W - s*lr*v before every forward and backward, s
  from the schedule's real lag per micro-batch;
- nesterov: the Nesterov look-ahead point of the update the gradient enters, stashed.
"""
from pipetrain.runtime.staleness.base import StalenessPolicy, StashPolicy, VanillaPolicy, VersionStore, WeightSet
from pipetrain.runtime.staleness.extrapolation import Extrapolation, require_smoothed_update
from pipetrain.runtime.staleness.nesterov import NesterovPolicy, look_ahead_steps
from pipetrain.runtime.staleness.spectrain import SpecTrainForwardOnlyPolicy, SpecTrainPolicy
from pipetrain.runtime.staleness.two_buffered import TwoBufferedPolicy, check_two_buffered

POLICIES = {
    "none": StalenessPolicy,
    "vanilla": VanillaPolicy,
    "stash": StashPolicy,
    "2bw": TwoBufferedPolicy,
    "spectrain": SpecTrainPolicy,
    "spectrain-forward": SpecTrainForwardOnlyPolicy,
    "nesterov": NesterovPolicy,
}
STALENESS = ("none", "vanilla", "stash", "2bw", "spectrain", "nesterov")  # wrap's staleness= choices
SPECTRAIN_VARIANTS = {"paper": "spectrain", "forward-only": "spectrain-forward"}  # spectrain_variant= -> policy
PREDICTING = ("spectrain", "nesterov")  # the policies whose prediction distance `lookahead` scales

__all__ = ["POLICIES", "PREDICTING", "SPECTRAIN_VARIANTS", "STALENESS", "Extrapolation", "NesterovPolicy", "SpecTrainForwardOnlyPolicy", "SpecTrainPolicy",
           "StalenessPolicy", "StashPolicy", "TwoBufferedPolicy", "VanillaPolicy", "VersionStore", "WeightSet",
           "check_two_buffered", "look_ahead_steps", "require_smoothed_update"]

"""A Nesterov-style delay correction for asynchronous pipelines (after Ajanthan et al., ICML 2025,
"Nesterov method for asynchronous pipeline parallel optimization").

Nesterov's accelerated gradient evaluates each gradient at the look-ahead point of the update it
enters, W + gamma * d (d: the last update, -lr * v). In an asynchronous pipeline the gradient of
micro-batch u enters the update D = lag(u) steps after its forward, so the look-ahead point
is further away: if no new gradient arrives, momentum alone moves the weights by lr * v * gamma^i
at the i-th next update, and the look-ahead point of update D + 1 is

    W_hat = W - lr * v * (gamma + gamma^2 + ... + gamma^(D+1)) = W - lr * v * gamma (1 - gamma^(D+1)) / (1 - gamma).

The forward computes at W_hat and the backward reuses it (stashed), so the gradient is exactly
the gradient at W_hat. With D = 0 this is the plain NAG look-ahead: SGD-momentum becomes Nesterov
momentum. Unlike SpecTrain, which assumes the next gradients equal the running average (v keeps
its size, distance D), this assumes they are unknown (v decays by gamma each update), which never
extrapolates further than 1/(1 - gamma) updates. ``lookahead`` scales D. Muon's update is its momentum
orthogonalised, which keeps its size while the momentum decays: its gamma is 1 here (W_hat = W - lr * v * (D + 1)).
"""
from __future__ import annotations

from pipetrain.runtime.staleness.base import StashPolicy, WeightSet
from pipetrain.runtime.staleness.extrapolation import require_smoothed_update, update_decay
from schedules import StreamLags


def look_ahead_steps(gamma: float, delay: float) -> float:
    """gamma + gamma^2 + ... + gamma^(delay + 1), for a possibly fractional delay (0 <= gamma < 1)."""
    return gamma * (1 - gamma ** (delay + 1)) / (1 - gamma) if gamma < 1 else delay + 1


class NesterovPolicy(StashPolicy):
    """Forward and backward of micro-batch u at the Nesterov look-ahead point of its update."""

    name = "nesterov"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        require_smoothed_update(self.optimizer)
        if self.optimizer is not None and any(g.get("nesterov", False) for g in self.optimizer.param_groups):
            raise ValueError("staleness='nesterov' evaluates gradients at the Nesterov look-ahead point itself; "
                             "an optimizer with nesterov=True would look ahead twice: use nesterov=False")
        self.lags = StreamLags(self.stage, self.stages, self.micro_batches)

    @property
    def gamma(self) -> float:
        """The momentum the look-ahead follows (the first group's; Muon's: 1, see ``update_decay``): read at each use
        (stage_momentum sets it after the policy is built)."""
        return update_decay(self.optimizer.param_groups[0]) if self.optimizer is not None else 0.0

    def delay(self, micro_batch: int) -> float:
        return self.lookahead * self.lags(micro_batch)

    def distance(self, micro_batch: int) -> float:
        return look_ahead_steps(self.gamma, self.delay(micro_batch))

    def _key(self, micro_batch: int) -> object:
        return self.updates, self.delay(micro_batch)

    def _make_version(self, micro_batch: int) -> WeightSet:
        delay = self.delay(micro_batch)
        return self._predicted_version(lambda group: look_ahead_steps(update_decay(group), delay))

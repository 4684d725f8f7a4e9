"""The seconds a run's optimizer steps take on this rank: what stepping after every micro-batch (async m = 1)
costs over stepping once per mini-batch."""
from __future__ import annotations

import time

import pipetrain


class OptimizerClock:
    """Times every ``step`` of the optimizers of the stages this process holds, with torch's step hooks
    (``register_step_pre_hook`` / ``register_step_post_hook``): wall seconds from a step's start to its end,
    summed, and the steps counted. A stage's step is the whole optimizer update, a CombinedOptimizer's inner
    steps included."""

    def __init__(self, pipe: pipetrain.Pipeline):
        self.seconds = 0.0
        self.steps = 0
        self._started = 0.0
        for runtime in pipe.held_stages.values():  # the hooks live as long as the pipeline's optimizers
            if runtime.optimizer is not None:
                runtime.optimizer.register_step_pre_hook(self._start)
                runtime.optimizer.register_step_post_hook(self._stop)

    def _start(self, optimizer, args, kwargs) -> None:
        self._started = time.perf_counter()

    def _stop(self, optimizer, args, kwargs) -> None:
        self.seconds += time.perf_counter() - self._started
        self.steps += 1

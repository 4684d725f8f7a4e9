"""Optimizers and learning-rate schedules for large-batch and pipelined training.

`LARS` (with LARC clipping), `LAMB`, the warm-up / polynomial-decay schedules and the linear scaling
rule (`lr_schedules`), and `smoothed_update`: the optimizer's running update direction that
SpecTrain weight prediction extrapolates.
"""
from pipetrain.optim.lamb import LAMB
from pipetrain.optim.lars import LARS
from pipetrain.optim.lr_schedules import (linear_scaling_rule, linear_warmup, warmup_cosine_decay,
                                          warmup_poly_decay)
from pipetrain.optim.smoothed import smoothed_update

__all__ = ["LAMB", "LARS", "linear_scaling_rule", "linear_warmup", "smoothed_update", "warmup_cosine_decay",
           "warmup_poly_decay"]

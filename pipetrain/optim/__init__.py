"""Optimizers and learning-rate schedules for large-batch and pipelined training.

`LARS` (with LARC clipping), `LAMB`, `CombinedOptimizer` (several optimizers stepped as one stage optimizer),
`Muon` (torch's, also stepping matrices split over ranks), `muon_with_adamw` (Muon for the matrices, AdamW for the
rest), the warm-up / polynomial-decay schedules and the linear scaling rule (`lr_schedules`), and
`smoothed_update`: the optimizer's running update direction that SpecTrain weight prediction extrapolates.
"""
from pipetrain.optim.combined import CombinedOptimizer
from pipetrain.optim.lamb import LAMB
from pipetrain.optim.lars import LARS
from pipetrain.optim.lr_schedules import (linear_scaling_rule, linear_warmup, warmup_cosine_decay,
                                          warmup_poly_decay)
from pipetrain.optim.muon import Muon, muon_with_adamw
from pipetrain.optim.smoothed import smoothed_update

__all__ = ["CombinedOptimizer", "LAMB", "LARS", "Muon", "linear_scaling_rule", "linear_warmup", "muon_with_adamw",
           "smoothed_update", "warmup_cosine_decay", "warmup_poly_decay"]

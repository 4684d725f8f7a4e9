"""The errors of giving a stage its tensors: reading a checkpoint, initialising without one."""
from __future__ import annotations


class WeightsError(ValueError):
    """Weights that cannot be read, or that do not fit the model; the message names the file or the tensors
    and says what to do."""


class InitialisationError(ValueError):
    """A requested tensor that the model lacks, or that none of the model's initialisers writes."""

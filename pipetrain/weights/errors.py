"""The one error type of weight loading."""
from __future__ import annotations


class WeightsError(ValueError):
    """Weights that cannot be read, or that do not fit the model; the message names the file or the tensors
    and says what to do."""

"""Loading a model's weights from a checkpoint into the stages, one tensor at a time (``wrap(..., weights=)``)."""
from pipetrain.weights.errors import WeightsError
from pipetrain.weights.sources import WeightSource, copy_into, match_names, open_weights

__all__ = ["WeightSource", "WeightsError", "copy_into", "match_names", "open_weights"]

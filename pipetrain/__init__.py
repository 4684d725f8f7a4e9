"""pipetrain: pipeline-parallel training for PyTorch.

``pipetrain.wrap(model, example_inputs, stages=..., schedule=...)`` splits a model into
balanced stages and trains it with GPipe, 1F1B, interleaved 1F1B, the zero-bubble ZB-H1, ZB-V,
DualPipeV and interleaved zero-bubble schedules, or asynchronous 1F1B (with PipeDream weight
stashing, PipeDream-2BW, SpecTrain weight prediction or a Nesterov look-ahead), in one process or
one process per stage under torchrun.
"""
from importlib.metadata import version

from pipetrain.api import wrap
from pipetrain.assembly.parameter_names import parameter_name
from pipetrain.checkpoint import CheckpointError, export_state_dict
from pipetrain.comm.failures import PeerFailure
from pipetrain.losses import model_loss
from pipetrain.runtime.metrics import StepResult
from pipetrain.runtime.nonfinite import NonFiniteError
from pipetrain.options import PipelineOptions
from pipetrain.pipeline import Pipeline
from pipetrain.preemption import StopOnSigterm
from pipetrain.weights.errors import InitialisationError, WeightsError

__all__ = ["wrap", "Pipeline", "PipelineOptions", "StepResult", "export_state_dict", "CheckpointError",
           "NonFiniteError", "PeerFailure", "model_loss", "WeightsError", "InitialisationError",
           "parameter_name", "StopOnSigterm"]
__version__ = version("pipetrain")  # one source: pyproject.toml

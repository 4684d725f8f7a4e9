"""Pipeline schedules as data: build, validate and simulate per-stage action lists.

Pure Python (no torch): the runtime executes the same lists this package builds.
"""
from schedules.actions import Action, ActionKind
from schedules.builders import BUILDERS, async_1f1b_actions, build, stream_with_reductions, with_reductions
from schedules.cluster import PRESETS, Cluster, load_cluster
from schedules.cluster.reductions import Reduction
from schedules.costs import Costs
from schedules.lags import StreamLags, forward_backward_lags
from schedules.cluster.step import ClusterStepResult, StageWork, simulate_cluster_step
from schedules.cluster.stream import stream_step_time
from schedules.cluster.overheads import RuntimeOverheads
from schedules.schedule import Schedule, ScheduleError
from schedules.simulate import SimResult, simulate
from schedules.trace_export import write_chrome_trace, write_png
from schedules.validate import validate

__all__ = [
    "Action", "ActionKind", "BUILDERS", "Cluster", "Costs", "ClusterStepResult", "PRESETS", "Reduction", "RuntimeOverheads", "StageWork",
    "load_cluster", "simulate_cluster_step", "Schedule", "ScheduleError", "SimResult", "StreamLags",
    "async_1f1b_actions", "build", "forward_backward_lags", "simulate", "stream_step_time", "stream_with_reductions", "validate",
    "with_reductions", "write_chrome_trace", "write_png",
]

"""Pipeline schedules as data: build, validate and simulate per-stage action lists.

Pure Python (no torch): the runtime executes the same lists this package builds.
"""
from schedules.actions import Action, ActionKind
from schedules.builders import BUILDERS, async_1f1b_actions, build
from schedules.cluster import PRESETS, Cluster, load_cluster
from schedules.collectives_cost import Reduction
from schedules.costs import Costs
from schedules.hybrid import HybridResult, StageWork, simulate_hybrid
from schedules.overheads import RuntimeOverheads
from schedules.schedule import Schedule, ScheduleError
from schedules.simulate import SimResult, simulate
from schedules.validate import validate

__all__ = [
    "Action", "ActionKind", "BUILDERS", "Cluster", "Costs", "HybridResult", "PRESETS", "Reduction", "RuntimeOverheads", "StageWork",
    "load_cluster", "simulate_hybrid", "Schedule", "ScheduleError", "SimResult",
    "async_1f1b_actions", "build", "simulate", "validate",
]

"""Model -> cost graph -> partition plan -> stage modules (never imports pipetrain)."""
from .auto_capture import trace_for_training
from .chain import DEFAULT_BANDWIDTH, STAYS_IN_STAGE
from .errors import PartitionError, TraceError
from .graph import CostGraph
from .memory_model import MemoryModel
from .planners.replicas import plan_replicas
from .planners.layout import Layout, evaluate_layout, format_ranking, plan_layout, search_layouts
from .partition import partition
from .plan import Plan
from .trace import placeholder_values, trace

__all__ = ["CostGraph", "DEFAULT_BANDWIDTH", "STAYS_IN_STAGE",
           "Layout", "MemoryModel", "PartitionError", "Plan", "TraceError",
           "evaluate_layout", "format_ranking", "partition", "plan_replicas", "plan_layout", "search_layouts",
           "placeholder_values", "trace", "trace_for_training"]

"""Model -> cost graph -> partition plan -> stage modules (never imports pipetrain)."""
from .chain import DEFAULT_BANDWIDTH
from .errors import PartitionError, TraceError
from .graph import CostGraph
from .hybrid import plan_hybrid
from .partition import partition
from .plan import Plan
from .trace import trace

__all__ = ["CostGraph", "DEFAULT_BANDWIDTH", "PartitionError", "Plan", "TraceError",
           "partition", "plan_hybrid", "trace"]

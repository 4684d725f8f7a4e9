"""The cluster cost model: what one training step of stages x replicas costs on given machines.

`Cluster` describes the machines (links, cores, the runtime's own overheads); `reductions`
prices the data-parallel gradient all-reduce; `shared_cores` simulates ranks that share a
node's processors; `step.simulate_cluster_step` puts them together for the layout planner
(partitioners.planners) and `pipetrain plan`; `stream.stream_step_time` is the period of an
async-1f1b stream (no flush), for `pipetrain compare`'s predicted throughput. The schedule IR (actions, builders, validate,
simulate) knows nothing of this package.
"""
from schedules.cluster.spec import BACKENDS, GBIT, PRESETS, Cluster, load_cluster

__all__ = ["BACKENDS", "GBIT", "PRESETS", "Cluster", "load_cluster"]

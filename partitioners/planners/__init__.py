"""Planners above the partitioner: how many stages, how many replicas of each, on which cluster.

`replicas.plan_replicas` picks the stage count and per-stage replica counts for a device
budget with the chain cost model (PipeDream's planner); `layout` ranks stages x replicas x
schedule layouts of a cluster by the step time schedules.cluster predicts (`pipetrain plan`).
"""

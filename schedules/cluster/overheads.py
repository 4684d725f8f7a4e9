"""`RuntimeOverheads`: what a training step costs beyond module compute and message transfer.

On a fast device with a Python runtime these terms dominate small stages, so a
step-time prediction that ignores them is far too low (examples/benchmarks/
bench_calibration.py measures them; README, "Cost-model calibration"):

* action: seconds of runtime work around every F and every B (executor dispatch,
  autograd leaves, RNG forking, loss bookkeeping, posting sends), on top of the
  module's own forward or backward. Measure it on the engine being modelled: the
  distributed engine's, which posts its sends to other processes, is several times the
  local engine's (bench_calibration). It is work on the device, so it delays the
  device's next action like compute does.
* step: fixed seconds per training step (building the executors, draining sends,
  collecting the loss), paid once after the last stage finishes.
* report_bytes: size of the vector every rank of the job sums at the end of each step to
  agree on the loss and metrics (0: none); costed by reductions.report_time (an
  all-reduce on NCCL, a gather + broadcast on gloo, as the runtime does).
* reduce_call, reduce_byte: what one gradient reduction (one fused bucket) costs beyond
  the link's alpha-beta ring time: seconds per call (launching the collective, waiting
  on it) and seconds per byte (packing gradients into the bucket, scaling, the sums,
  unpacking). On CPU both are memory-bound work that the ring model does not see.
  With a Cluster whose devices share cores (Cluster.cores) this is the reducer's CPU, run
  as work on the rank's core in the shared-cores simulation (schedules.cluster.step), so measure
  it as CPU time (process_time); without, it is a delay after the ring time.

All three are measured on the target, so unlike stage compute they are not divided
by Cluster.speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class RuntimeOverheads:
    """Per-action, per-step and per-step-synchronisation costs of the runtime (seconds, bytes)."""

    action: float = 0.0
    step: float = 0.0
    report_bytes: float = 0.0
    reduce_call: float = 0.0
    reduce_byte: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"RuntimeOverheads.{f.name} must be a finite number >= 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: object) -> "RuntimeOverheads":
        """From the dict Cluster.to_json writes; unknown keys are an error, not ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"cluster 'overheads' must be an object with keys {OVERHEAD_KEYS}, got {data!r}")
        unknown = sorted(set(data) - set(OVERHEAD_KEYS))
        if unknown:
            raise ValueError(f"unknown overhead key(s) {unknown}; valid keys: {', '.join(OVERHEAD_KEYS)}")
        return cls(**data)


OVERHEAD_KEYS = tuple(f.name for f in fields(RuntimeOverheads))


def contention(processes: float, cores: float) -> float:
    """Slowdown of CPU work when `processes` busy processes share `cores` cores (fair sharing):
    max(1, processes / cores). The calibration benchmark compares it with the measured one."""
    if not (processes > 0 and cores > 0):
        raise ValueError(f"contention needs processes > 0 and cores > 0, got {processes!r}, {cores!r}")
    return max(1.0, processes / cores)

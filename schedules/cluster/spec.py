"""`Cluster`: the machines a layout runs on, as a small dataclass that reads and writes JSON.

Links follow the alpha-beta model: a message of n bytes over a link takes
latency + n / bandwidth seconds (bandwidth in bytes/s). `speed` is a device's
compute speed relative to the device the cost graph was profiled on (compute
times are divided by it). Ranks fill nodes in order: rank r is on node
r // devices_per_node. `overheads` are the runtime's own costs per action and per step
(schedules.cluster.overheads; zero unless measured).

`cores` (None: every device has its own processor) is how many processors a node's
devices share, e.g. CPU ranks on a small host: compute then runs under processor
sharing, and a message to a device that sleeps while all `cores` are busy waits
`wakeup` more seconds for one (schedules.cluster.shared_cores). It may be fractional: the
processors a job gets when other work takes part of the machine.

`send_cpu` + n x `send_cpu_byte` and `recv_cpu` + n x `recv_cpu_byte` (seconds; n bytes) are
the CPU a message costs the sending process and the receiving process when it takes it
(gloo over TCP copies on the caller's thread and the kernel's loopback stack burns CPU).
With shared cores that work competes with compute (schedules.cluster.shared_cores), so they need
`cores`; they are measured on the target, so not divided by `speed`.

`interference` (>= 1; needs `cores`) is how much more CPU a rank's module compute takes when
its node's ranks all compute at once than alone: co-running processes slow each other beyond
sharing the processors (shared caches and memory bandwidth, sibling hyperthreads), and
processor sharing only divides the cores. The shared-cores simulation multiplies every F and
B's module compute by it (schedules.cluster.step), so measure it with the ranks computing together
for long enough that they really overlap: all-at-once process_time / alone process_time.
It is applied to all compute, also when a rank happens to compute alone (most of a pipeline
step's compute co-runs); runtime overheads and message CPU are measured in place, not scaled.

`backend` is the torch.distributed backend the runtime uses there ("nccl" on GPUs, "gloo" on
CPUs): it picks the collective of the runtime's end-of-step report (schedules.cluster.reductions.report_time).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields

from schedules.cluster.overheads import RuntimeOverheads

GBIT = 1e9 / 8  # bytes/s in one Gb/s
BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical devices; one link type inside a node and one between nodes."""

    nodes: int
    devices_per_node: int
    intra_bandwidth: float   # bytes/s between two devices of a node
    intra_latency: float     # seconds per message inside a node
    inter_bandwidth: float   # bytes/s of a node's network link
    inter_latency: float     # seconds per message between nodes
    speed: float = 1.0       # compute speed relative to the profiled device
    memory: float | None = None  # bytes per device (None: unlimited)
    name: str = "custom"
    overheads: RuntimeOverheads = field(default_factory=RuntimeOverheads)
    cores: float | None = None   # processors a node's devices share (None: one per device)
    wakeup: float = 0.0          # seconds a message waits for a core when the node's cores are busy
    send_cpu: float = 0.0        # sender CPU seconds per message
    send_cpu_byte: float = 0.0   # sender CPU seconds per message byte
    recv_cpu: float = 0.0        # receiver CPU seconds per message
    recv_cpu_byte: float = 0.0   # receiver CPU seconds per message byte
    interference: float = 1.0    # module compute's CPU co-running / alone (shared cores only)
    backend: str = "nccl"        # torch.distributed backend of the runtime: "nccl" or "gloo"

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster.{name} must be an integer >= 1, got {value!r}")
        for name in ("intra_bandwidth", "inter_bandwidth", "speed"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"Cluster.{name} must be a number > 0, got {value!r}")
        for name in ("intra_latency", "inter_latency"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Cluster.{name} must be a finite number >= 0 seconds, got {value!r}")
        if self.memory is not None and not self.memory > 0:
            raise ValueError(f"Cluster.memory must be > 0 bytes or None, got {self.memory!r}")
        if self.cores is not None and (isinstance(self.cores, bool) or not isinstance(self.cores, (int, float))
                                       or not (math.isfinite(self.cores) and self.cores > 0)):
            raise ValueError(f"Cluster.cores must be a number > 0 of processors per node or None "
                             f"(one per device), got {self.cores!r}")
        if not (isinstance(self.wakeup, (int, float)) and math.isfinite(self.wakeup) and self.wakeup >= 0):
            raise ValueError(f"Cluster.wakeup must be a finite number >= 0 seconds, got {self.wakeup!r}")
        if self.wakeup > 0 and self.cores is None:
            raise ValueError("Cluster.wakeup only applies when devices share cores; fix: set Cluster.cores too")
        for name in _MESSAGE_CPU:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise ValueError(f"Cluster.{name} must be a finite number >= 0 seconds, got {value!r}")
            if value > 0 and self.cores is None:
                raise ValueError(f"Cluster.{name} only applies when devices share cores; "
                                 "fix: set Cluster.cores too")
        if isinstance(self.interference, bool) or not isinstance(self.interference, (int, float)) or not (
                math.isfinite(self.interference) and self.interference >= 1):
            raise ValueError(f"Cluster.interference must be a finite number >= 1 (co-running / alone CPU), "
                             f"got {self.interference!r}")
        if self.interference != 1 and self.cores is None:
            raise ValueError("Cluster.interference only applies when devices share cores; fix: set Cluster.cores too")
        if self.backend not in BACKENDS:
            raise ValueError(f"Cluster.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.overheads, RuntimeOverheads):
            raise TypeError(f"Cluster.overheads must be a RuntimeOverheads, got {type(self.overheads).__name__}")

    @property
    def devices(self) -> int:
        """Devices in the whole cluster."""
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """Node that rank `rank` runs on."""
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> tuple[float, float]:
        """(bandwidth, latency) of the link between ranks a and b."""
        if self.node_of(a) == self.node_of(b):
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency

    def message_cpu(self, nbytes: float) -> tuple[float, float]:
        """(sender, receiver) CPU seconds of one nbytes message."""
        return (self.send_cpu + nbytes * self.send_cpu_byte, self.recv_cpu + nbytes * self.recv_cpu_byte)

    def to_json(self) -> str:
        """JSON text of every field (from_json reads it back)."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        """A Cluster from JSON text; unknown keys are an error, not ignored."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("cluster JSON must be an object with keys " + ", ".join(_FIELDS))
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown cluster key(s) {unknown}; valid keys: {', '.join(_FIELDS)}")
        missing = [f.name for f in fields(cls) if f.name in _REQUIRED and f.name not in data]
        if missing:
            raise ValueError(f"cluster JSON lacks {missing}; it needs {', '.join(_REQUIRED)}")
        if "overheads" in data:
            data["overheads"] = RuntimeOverheads.from_dict(data["overheads"])
        return cls(**data)


_MESSAGE_CPU = ("send_cpu", "send_cpu_byte", "recv_cpu", "recv_cpu_byte")
_FIELDS = [f.name for f in fields(Cluster)]
_REQUIRED = ("nodes", "devices_per_node", "intra_bandwidth", "intra_latency",
             "inter_bandwidth", "inter_latency")

# speed is relative to partitioners' profile=False estimate (a nominal 1e11 FLOP/s device), so
# the presets give sensible absolute times for estimated cost graphs: fp32 peak FLOP/s / 1e11.
# Latencies are per message (per ring step), typical NCCL-over-fabric figures.
PRESETS: dict[str, Cluster] = {
    # 8 NVLink GPUs per node (V100 class), nodes joined by 100 Gb/s.
    "nvlink8-100g": Cluster(nodes=4, devices_per_node=8, intra_bandwidth=100e9, intra_latency=5e-6,
                            inter_bandwidth=100 * GBIT, inter_latency=10e-6, speed=157.0,
                            memory=32e9, name="nvlink8-100g"),
    # Jia et al. 2018: 8 Tesla P40 per node over PCIe, 100 Gb/s InfiniBand, 1,024 GPUs.
    "jia-p40": Cluster(nodes=128, devices_per_node=8, intra_bandwidth=10e9, intra_latency=5e-6,
                       inter_bandwidth=100 * GBIT, inter_latency=10e-6, speed=120.0, memory=24e9,
                       name="jia-p40"),
    # PipeDream (Narayanan et al. 2019) cluster A: 4 V100 per server over PCIe, 10 Gb/s Ethernet.
    "pipedream-a": Cluster(nodes=4, devices_per_node=4, intra_bandwidth=10e9, intra_latency=5e-6,
                           inter_bandwidth=10 * GBIT, inter_latency=30e-6, speed=157.0, memory=16e9,
                           name="pipedream-a"),
    # PipeDream cluster B: 8 V100 per server with NVLink, 25 Gb/s between servers.
    "pipedream-b": Cluster(nodes=4, devices_per_node=8, intra_bandwidth=100e9, intra_latency=5e-6,
                           inter_bandwidth=25 * GBIT, inter_latency=20e-6, speed=157.0, memory=16e9,
                           name="pipedream-b"),
    # 4 CPU processes sharing 2 cores, gloo over loopback: the model fitted (rounded) by
    # `examples/benchmarks/bench_calibration.py --save-cluster` on the machine of the README's
    # "Cost-model calibration", which gives how well it predicts that machine's validation steps.
    # speed 1: plan with costs measured there (`pipetrain plan --profile`).
    "gloo-local4": Cluster(nodes=1, devices_per_node=4, intra_bandwidth=3.4e9, intra_latency=0.0,
                           inter_bandwidth=3.4e9, inter_latency=0.0, speed=1.0, name="gloo-local4",
                           overheads=RuntimeOverheads(action=6.5e-4, step=1.9e-3, report_bytes=272,
                                                      reduce_call=6.8e-4, reduce_byte=8.7e-10),
                           cores=2.0, wakeup=3.1e-4, send_cpu=1.0e-4, send_cpu_byte=1.7e-10, recv_cpu=1.0e-4,
                           recv_cpu_byte=1.0e-10, interference=1.22, backend="gloo"),
}


def load_cluster(spec: str) -> Cluster:
    """A preset name (see PRESETS) or the path of a JSON file written by Cluster.to_json."""
    if spec in PRESETS:
        return PRESETS[spec]
    if not os.path.exists(spec):
        raise ValueError(f"cluster {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                         "existing JSON file; fix: pass a preset name or a path")
    with open(spec, encoding="utf-8") as f:
        return Cluster.from_json(f.read())

"""The engine: everything that differs between one process and one process per stage.

The assembly asks its engine where stages run, how the plan reaches every process, and for the
cross-position pieces of the stages it built (`connect`): transport, tied-weight sync, skip-or-step
agreement (non-finite values, fp16 overflow), step reporter and the gradient reducers of hybrid mode.
The runner asks it how a mini-batch is sharded over replicas and how a prediction reaches every
process. `select_engine` is the one place that chooses; the options are reduced to the values each
engine needs right here.

- `LocalEngine`: every stage in this process (one device or several), the deterministic
  reference.
- `DistributedEngine`: one pipeline position per rank under torchrun (gloo on CPU, NCCL on
  GPU), ranks = stages x data_parallel x tensor_parallel.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn

import partitioners
from pipetrain.comm.compile_grace import CompileGrace, group_timeout
from pipetrain.comm.consensus import Consensus, default_store
from pipetrain.comm.failures import FailureBoard
from pipetrain.comm.replica_start import check_replicas_read_alike, start_replicas_equal
from pipetrain.comm.overflow_agreement import DistributedOverflowAgreement, LocalOverflowAgreement
from pipetrain.comm.peers import peers_answer
from pipetrain.comm.replicas import ReductionSettings, StageReducer, replica_shard, shard_weight
from pipetrain.comm.reporting import Reporter
from pipetrain.comm.tied import DistributedTiedSync, LocalTiedSync
from pipetrain.comm.transport import DistributedTransport, LocalTransport
from pipetrain.comm.world import SETTING_UP, World, ensure_process_group, launched_by_torchrun
from pipetrain.runtime.batching import batch_size
from pipetrain.runtime.devices import to_device
from pipetrain.runtime.metrics import CommCounter
from pipetrain.runtime.optimizer_step import OverflowAgreement, TiedSync
from pipetrain.runtime.stage import StageRuntime
from pipetrain.runtime.topology import Topology

if TYPE_CHECKING:
    from pipetrain.comm.fully_sharded import FullyShardedReducer

ENGINES = ("auto", "local", "distributed")  # wrap's engine= choices (select_engine)
# Distributed pipelines this process built: each takes its own namespace in the store, numbered alike on every rank.
_PIPELINES = itertools.count()
Tied = list[list[tuple[int, str]]]  # per tied parameter: its (stage, name) copies


class EngineOptions(Protocol):
    """What the engines read of wrap's options (pipetrain.options.PipelineOptions; ReductionSettings.of
    reads the hybrid-mode ones)."""

    engine: str
    stages: int
    data_parallel: int
    devices: list[torch.device] | None
    allreduce: str
    hierarchy: tuple[int, int] | None
    timeout: float
    dynamic_shapes: bool
    receive_ahead: bool
    norm_type: float
    tensor_parallel: int
    compile: bool | dict


@dataclass
class Connections:
    """The cross-position pieces of one pipeline, built by its engine."""

    transport: LocalTransport | DistributedTransport
    tied: TiedSync
    agreement: OverflowAgreement
    reporter: Reporter
    reducers: dict[int, StageReducer | FullyShardedReducer]  # hybrid mode: position -> its gradient reducer
    counter: CommCounter
    grace: CompileGrace | None = None  # compile=: which waits allow for a compiling peer

    def abandon(self) -> None:
        """A step raised: drop what each piece kept for it, so the next step starts clean."""
        self.transport.abandon()
        self.tied.abandon()
        self.agreement.abandon()
        for reducer in self.reducers.values():
            reducer.abandon()

    def close(self) -> None:
        """The pipeline ends: the reducers take their hooks off the model's parameters."""
        for reducer in self.reducers.values():
            reducer.close()


class LocalEngine:
    """Every stage in this process; ``devices`` gives each pipeline position its torch device."""

    distributed = False
    receive_ahead = False  # one process posts no receives: nothing to move ahead
    world: World | None = None
    is_rank_zero = True
    decides_plan = True

    def __init__(self, stages: int, devices: list[torch.device | str] | None, norm_type: float = 2.0):
        self.largest_norm = norm_type == math.inf  # the inf-norm's parts are maximised, not summed
        self.devices = [torch.device(d) for d in (devices or ["cpu"] * stages)]
        if len(self.devices) != stages:
            raise ValueError(f"devices lists {len(self.devices)} devices for {stages} stages; give one per stage")

    def positions(self) -> list[int]:
        """The pipeline positions this process runs: all of them."""
        return list(range(len(self.devices)))

    def torch_device(self, position: int) -> torch.device:
        return self.devices[position]

    def agree_on_setup(self, fingerprint: dict[str, str], rule: Callable[[list[dict[str, str]]], str | None]) -> None:
        """One process: nothing to agree with."""

    def agree_on_plan(self, plan: partitioners.Plan, graph: partitioners.CostGraph) -> partitioners.Plan:
        return plan

    def start_replicas_equal(self, modules: dict[int, nn.Module], same_source: bool) -> None:
        """One process holds no replicas."""

    def check_replicas_read_alike(self, digests: dict[int, str]) -> None:
        """One process holds no replicas."""

    def start_lanes_equal(self, modules: dict[int, nn.Module], same_source: bool) -> None:
        """One process runs no tensor-parallel ranks."""

    def check_lanes_read_alike(self, digests: dict[int, str]) -> None:
        """One process runs no tensor-parallel ranks."""

    def connect(self, topology: Topology, stages: dict[int, StageRuntime], tied: Tied) -> Connections:
        counter = CommCounter(topology.num_stages)
        stage_devices = [self.devices[topology.position_of(v)] for v in range(topology.num_stages)]
        describe = lambda d: f"pipeline position {d} ({topology.describe(d)})"  # noqa: E731
        return Connections(LocalTransport(stage_devices, counter), LocalTiedSync(tied, stages, counter),
                           LocalOverflowAgreement(len(self.devices), describe, self.largest_norm),
                           Reporter(topology.num_stages, counter, has_last_stage=True), {}, counter)

    def explain_failure(self, error: BaseException) -> BaseException:
        """One process: the error is the whole story."""
        return error

    def shard(self, x: Any, y: Any) -> tuple[Any, Any, float]:
        """One process holds the whole mini-batch."""
        return x, y, 1.0

    def share_prediction(self, output: Any, topology: Topology) -> Any:
        return output

    def close(self) -> None:
        """One process made no process groups."""


class DistributedEngine:
    """One pipeline position of one replica per rank of the torch.distributed world."""

    distributed = True
    world: World

    def __init__(self, options: EngineOptions):
        # A compiling peer holds up collectives too: the groups' timeout leaves room for it (comm.compile_grace).
        self.group_timeout = group_timeout(options.timeout, bool(options.compile))
        ensure_process_group(self.group_timeout)
        self.options = options
        self.data_parallel = options.data_parallel
        self.dynamic_shapes, self.timeout = options.dynamic_shapes, options.timeout
        self.receive_ahead = options.receive_ahead
        self.reduction = ReductionSettings.of(options) if options.data_parallel > 1 else None
        self.rank = dist.get_rank()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # Keys of their own per pipeline and torchrun attempt: a later pipeline in the same process group
        # must not read an earlier one's posts.
        keys = f"pipetrain/attempt-{attempt}/pipeline-{next(_PIPELINES)}"
        store = default_store()
        self.failures = FailureBoard(store, self.rank, keys)
        self.consensus = Consensus(store, self.rank, dist.get_world_size(), options.timeout, keys)

    def agree_on_setup(self, fingerprint: dict[str, str], rule: Callable[[list[dict[str, str]]], str | None]) -> None:
        """Every rank posts what it is about to train (``fingerprint``); ``rule`` names what differs. Any
        difference is one ValueError on every rank; once all agree, this rank joins the process groups."""
        problem = self.consensus.decide("wrap(): agreeing on what every rank trains", fingerprint, rule)
        if problem is not None:
            raise ValueError(problem)
        self.world = self._new_world()

    def _new_world(self) -> World:
        o = self.options
        with peers_answer(SETTING_UP):
            return World(o.stages, o.data_parallel, o.allreduce, o.hierarchy, self.group_timeout, o.tensor_parallel)

    def reconnect(self, topology: Topology, stages: dict[int, StageRuntime], tied: Tied) -> Connections:
        """Fresh process groups and connections after a step that raised on some rank: the old groups may hold
        sends and receives that will never be matched, and a gloo wait that timed out closed its connection.
        Every rank calls it at its next step (each raised in the failed one), so the groups pair up; ranks reach
        it up to ``timeout`` apart (the rank that raised at once, its peers when their wait gave up), so they
        meet first in the store, waiting up to 3 x ``timeout`` (the last rank learns of the failure when its own
        wait gives up, itself possibly after a neighbour's): no collective of a group a failed wait may have
        broken, nor of the default group whose timeout may be the very one that ran out."""
        self.consensus.decide("the new process groups after a failed step (every rank steps again after it)",
                              None, lambda _: None, wait=3 * self.timeout)
        self.world = self._new_world()
        return self.connect(topology, stages, tied)

    def close(self) -> None:
        """Destroy this pipeline's process groups (every rank closes its pipeline)."""
        self.world.close()

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def decides_plan(self) -> bool:
        """Rank 0 traces with profiling and partitions; the others follow its plan."""
        return self.rank == 0

    def start_replicas_equal(self, modules: dict[int, nn.Module], same_source: bool) -> None:
        """The replicas of each stage start from replica 0's tensors (see comm.replica_start)."""
        if self.data_parallel > 1:
            start_replicas_equal(modules, self.world.data_parallel_group, same_source)

    def start_lanes_equal(self, modules: dict[int, nn.Module], same_source: bool) -> None:
        """A stage's tensor-parallel ranks start from lane 0's whole tensors, before each cuts its blocks."""
        if self.world.tensor_parallel > 1:
            start_replicas_equal(modules, self.world.tensor_group, same_source)

    def check_lanes_read_alike(self, digests: dict[int, str]) -> None:
        """A model without data, split: each lane made its own blocks from the source; the whole tensors they read
        must be the same."""
        if self.world.tensor_parallel > 1:
            check_replicas_read_alike(digests, self.world.tensor_group)

    def check_replicas_read_alike(self, digests: dict[int, str]) -> None:
        """zero=3 built each replica's shards from the source: the whole tensors they saw must be the same."""
        if self.data_parallel > 1:
            check_replicas_read_alike(digests, self.world.data_parallel_group)

    def positions(self) -> list[int]:
        return [self.world.position]

    def torch_device(self, position: int) -> torch.device:
        return self.world.device

    def agree_on_plan(self, plan: partitioners.Plan | None, graph: partitioners.CostGraph) -> partitioners.Plan:
        """Every rank gets rank 0's plan, rebuilt over its own traced graph."""
        box = [plan.to_json() if self.decides_plan else None]
        with peers_answer("the plan broadcast from rank 0 (which traces, profiles and partitions the model)",
                          "raise wrap(..., timeout=...) if rank 0 needs longer to profile and partition"):
            dist.broadcast_object_list(box, src=0, group=self.world.control)
        return partitioners.Plan.from_json(box[0], graph)

    def connect(self, topology: Topology, stages: dict[int, StageRuntime], tied: Tied) -> Connections:
        world = self.world
        counter = CommCounter(topology.num_stages)
        with peers_answer(SETTING_UP):
            links = world.link_groups(topology, self.receive_ahead)
            tied_groups = world.tied_groups(topology, tied)
        lanes = None
        if world.tensor_parallel > 1:  # boundary values cross once per stage pair, each lane sending 1/T
            from pipetrain.tensor_parallel import Lanes

            lanes = Lanes(world.tensor_group, world.tensor_parallel, world.lane)
        grace = CompileGrace(self.timeout, topology.positions) if self.options.compile else None
        transport = DistributedTransport(topology, lambda v: world.rank_of(topology.position_of(v)), links,
                                         world.device, counter, self.dynamic_shapes, self.timeout, self.receive_ahead,
                                         lanes, grace)
        tied_sync = DistributedTiedSync(tied, stages, tied_groups, counter)
        # Every lane of the last stage computes the same loss: lane 0 reports it; per-stage numbers are averaged over
        # the stage's replicas and lanes.
        reporter = Reporter(topology.num_stages, counter, world.lane == 0 and any(s.is_last for s in stages.values()),
                            (world.control, world.report), self.data_parallel * world.tensor_parallel, world.device)
        describe = lambda r: world.describe_rank(r, topology.describe(world.place_of(r)[1]))  # noqa: E731
        agreement = DistributedOverflowAgreement(world.agreement, world.device, describe,
                                                 largest_norm=self.options.norm_type == math.inf)
        reducers = {}
        if self.reduction is not None:
            held = [stages[v] for v in topology.stages_at(world.position)]
            if self.options.zero == 3:
                from pipetrain.comm.fully_sharded import FullyShardedReducer  # FSDP2: ~1 s to import, zero=3 only

                reducers[world.position] = FullyShardedReducer(held, counter, self.options.reshard_after_forward)
            else:
                reducers[world.position] = StageReducer(held, world.data_parallel_group, world.hierarchy,
                                                        self.reduction, counter, tied)
        return Connections(transport, tied_sync, agreement, reporter, reducers, counter, grace)

    def explain_failure(self, error: BaseException) -> BaseException:
        """The error to raise for a step that raised here (see pipetrain.comm.failures)."""
        return self.failures.explain(error)

    def shard(self, x: Any, y: Any) -> tuple[Any, Any, float]:
        """This replica's share of a global mini-batch and the factor that keeps the mean exact."""
        D = self.data_parallel
        if D == 1:
            return x, y, 1.0
        r, size = self.world.replica, batch_size(x)
        xs = replica_shard(x, r, D, size)
        return xs, replica_shard(y, r, D, size), shard_weight(size, batch_size(xs), D)

    def share_prediction(self, output: Any, topology: Topology) -> Any:
        """The full output on every rank, from replica 0's last stage (every replica computes the same)."""
        # Pickled on the CPU: a CUDA tensor would be unpickled onto the source rank's device index.
        box = [to_device(output, torch.device("cpu")) if output is not None else None]
        last = self.world.rank_of(topology.position_of(topology.num_stages - 1), replica=0, lane=0)
        with peers_answer(f"predict()'s output broadcast from rank {last} (every rank calls predict())"):
            dist.broadcast_object_list(box, src=last, group=self.world.control)
        return box[0]


Engine = LocalEngine | DistributedEngine


def select_engine(options: EngineOptions) -> Engine:
    """The engine ``options.engine`` asks for ("auto": distributed under torchrun or an initialised
    process group, else local)."""
    distributed = options.engine == "distributed" or (
        options.engine == "auto" and (launched_by_torchrun() or dist.is_initialized()))
    if distributed:
        return DistributedEngine(options)
    if options.data_parallel > 1:
        raise ValueError("data_parallel > 1 runs one process per stage and replica: launch with torchrun "
                         f"--nproc-per-node {options.stages * options.data_parallel} (engine='distributed' or 'auto')")
    return LocalEngine(options.stages, options.devices, options.norm_type)

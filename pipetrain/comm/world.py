"""The process layout of the distributed engine: ranks, pipeline positions and process groups.

Rank r is tensor-parallel rank (lane) ``r % T`` of pipeline position ``(r // T) % stages`` of replica
``r // (T * stages)``: a stage's T tensor-parallel ranks are consecutive (one machine: their all-reduces run
on every layer), then each replica's pipeline occupies consecutive ranks, so with
``--nproc-per-node=stages x T`` a pipeline stays inside one machine and only the data-parallel reduction
crosses machines. Every lane of a stage talks to the same lane of its neighbours.
"""
from __future__ import annotations

import importlib
import itertools
import os
import queue
import threading
import weakref
from datetime import timedelta
from typing import Callable, Hashable

import torch
import torch.distributed as dist

from pipetrain.allreduce.hierarchy import build_hierarchy_groups
from pipetrain.comm.group_lifetime import destroy_groups, own_default_group
from pipetrain.comm.peers import peers_answer
from pipetrain.runtime.topology import ACT, GRAD, Topology
from schedules.nccl_order import link_comm

SETTING_UP = "setting up the pipeline's process groups (every rank calls wrap())"


def _replicas_per_node(ranks: list[int]) -> tuple[int, int]:
    """(nodes, replicas per node) of a data-parallel group from torchrun's LOCAL_WORLD_SIZE
    (one node when unknown)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    nodes = len({r // local for r in ranks})
    if len(ranks) % nodes:
        raise ValueError(f"data-parallel ranks {ranks} spread unevenly over {nodes} nodes; "
                         "use allreduce='flat' or a layout with the same processes on every node")
    return nodes, len(ranks) // nodes


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


# Ranks reach wrap() after start-up work of their own (importing torch, reading data, building the model), which a
# loaded machine or a large model spreads over minutes: at the rendezvous, wrap's ``timeout`` (a bound for a peer that
# died or hangs in steady state) would call a slow starter dead. Under torchrun a dead worker cannot keep the others
# waiting: its agent stops every worker of the job. So there the rendezvous waits this long at least (as long as
# NCCL's default collective timeout). Launched otherwise, nothing would stop a rank waiting for a dead peer, and the
# timeout stands as given.
STARTUP_SECONDS = 600.0


def rendezvous_seconds(timeout_seconds: float) -> float:
    """How long the rendezvous of the default process group waits for every rank to arrive (see STARTUP_SECONDS)."""
    return max(timeout_seconds, STARTUP_SECONDS) if "TORCHELASTIC_RUN_ID" in os.environ else timeout_seconds


def ensure_process_group(timeout_seconds: float) -> None:
    """Join the default process group torchrun described (gloo on CPU, NCCL on GPU); the ranks wait for each other
    there ``rendezvous_seconds(timeout_seconds)``. pipetrain's own process groups, which carry every collective of
    its pipelines, keep ``timeout_seconds``."""
    if dist.is_initialized():
        return
    if not launched_by_torchrun():
        raise RuntimeError("engine='distributed' needs torchrun (or an initialised torch.distributed process "
                           "group); run `torchrun --nproc-per-node N script.py` or use engine='local'")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=rendezvous_seconds(timeout_seconds))
    # NCCL binds each rank to one GPU: set it before the first collective, and name it to the group
    # (device_id) so that communicators are created eagerly on that device instead of guessed later.
    device = None
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    with peers_answer(f"the rendezvous at {address} (MASTER_ADDR:MASTER_PORT) of {size} ranks",
                      "check that every rank got the same MASTER_ADDR and MASTER_PORT and that nothing else "
                      "listens there, or raise wrap(..., timeout=...) if the ranks start far apart"):
        store = _within(timeout.total_seconds(), address, lambda: _rendezvous_store(rank, size, timeout))
        # torch._dynamo imported while a gloo group exists keeps that group's worker threads alive after it is
        # destroyed (torch 2.14), and they abort the interpreter's teardown. Every training process imports it
        # anyway (torch.optim's constructors do); here it comes first, so the default group still ends at exit.
        importlib.import_module("torch._dynamo")
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, device_id=device)
    own_default_group()


def _rendezvous_store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """The store the ranks meet in: the one env:// would make, or torchrun's agent store, namespaced per
    restart attempt (it outlives a restart with --max-restarts; without a namespace the restarted workers
    read the dead workers' addresses and fail to connect their groups)."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"pipetrain/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    return dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout, multi_tenant=True)


def _within(seconds: float, address: str, connect: Callable[[], dist.Store]) -> dist.Store:
    """``connect()`` bounded by ``seconds``: a TCPStore client whose server accepts but never answers (a port
    held by another program) waits in its handshake for ever; the thread left there is a daemon."""
    results: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        try:
            results.put((connect(), None))
        except BaseException as error:  # noqa: BLE001  (re-raised in the caller's thread)
            results.put((None, error))

    threading.Thread(target=run, name="pipetrain-rendezvous", daemon=True).start()
    try:
        store, error = results.get(timeout=seconds + 1)  # the store's own timeout error, when it has one, comes first
    except queue.Empty:
        raise RuntimeError(f"no answer from {address} within {seconds:g} s") from None
    if error is not None:
        raise error
    return store


class World:
    """This rank's place in the (replica x pipeline position x tensor-parallel lane) grid and the groups it talks
    over."""

    def __init__(self, stages: int, data_parallel: int, allreduce: str = "flat",
                 hierarchy: tuple[int, int] | None = None, timeout: float = 30.0, tensor_parallel: int = 1):
        self.stages = stages
        self.data_parallel = data_parallel
        self.tensor_parallel = T = tensor_parallel
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        if self.size != stages * data_parallel * T:
            grid = (f"stages x data_parallel x tensor_parallel = {stages} x {data_parallel} x {T}" if T > 1
                    else f"stages x data_parallel = {stages} x {data_parallel}")
            raise ValueError(
                f"the world has {self.size} processes but {grid} = {stages * data_parallel * T}; launch with "
                f"--nproc-per-node (x nodes) = {stages * data_parallel * T} or change stages/data_parallel"
                + ("/tensor_parallel" if T > 1 else ""))
        self.replica, self.position, self.lane = self.place_of(self.rank)
        self.timeout = timedelta(seconds=timeout)
        self._made: list = []  # every group this rank made, in the order every rank made them (close)
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        # new_group must be called by every rank in the same order, so groups are built up front.
        self.control = self._group(list(range(self.size)))
        self.report = self._group(list(range(self.size)))  # broadcasts of the step report's sum (reporting)
        # The skip-or-step all-reduce at every STEP (comm.overflow_agreement); its own group so it never queues
        # behind the reports' asynchronous gathers on `control`.
        self.agreement = self._group(list(range(self.size)))
        self.data_parallel_group = None
        self.hierarchy = None
        for d in range(stages):
            for lane in range(T):
                mine = (d, lane) == (self.position, self.lane)
                ranks = [self.rank_of(d, r, lane) for r in range(data_parallel)]
                group = self._group(ranks)
                if mine:
                    self.data_parallel_group = group
                if data_parallel > 1 and allreduce in ("hybrid", "hierarchical"):
                    nodes, per_node = hierarchy if hierarchy else _replicas_per_node(ranks)
                    found = build_hierarchy_groups(ranks, nodes, per_node, self.timeout)
                    if mine:
                        self.hierarchy = found
                        self._made += [found.intra_reduce, found.intra_gather, found.inter]
        # A stage's tensor-parallel ranks: the all-reduces of its split layers (pipetrain.tensor_parallel).
        self.tensor_group = None
        self._replica_lane_mesh = None
        for replica in range(data_parallel) if T > 1 else ():
            for d in range(stages):
                group = self._group([self.rank_of(d, replica, lane) for lane in range(T)])
                if (replica, d) == (self.replica, self.position):
                    self.tensor_group = group

    def replica_lane_mesh(self):
        """zero=3 with tensor parallelism: the DeviceMesh of this rank's stage, made once. Its last dimension is the
        tensor-parallel lanes, which cut the parameters; the others are the replicas, over which FSDP2 shards the
        blocks: (replica, lane), or (node, replica in the node, lane) when the replicas span several nodes (HSDP:
        sharded inside a node, replicated across nodes, torchtitan's (dp_replicate, dp_shard, tp)). FSDP2 takes a
        tensor-parallel DTensor only on a mesh whose root is its own. The dimensions are named after their groups, as
        `pipetrain.comm.fully_sharded` names its meshes' (DTensor's caches key meshes by ranks and names: a closed
        pipeline's groups must not be found again)."""
        if self._replica_lane_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh  # DTensor: ~1 s to import, zero=3 with T > 1 only

            T, h = self.tensor_parallel, self.hierarchy
            layout = torch.tensor([[self.rank_of(self.position, replica, lane) for lane in range(T)]
                                   for replica in range(self.data_parallel)])
            if h is not None and h.nodes > 1 and h.inter is not None and h.intra_reduce is not None:
                layout = layout.view(h.nodes, h.per_node, T)
                groups = [h.inter, h.intra_reduce, self.tensor_group]
                roles = ("replicate", "shard", "tensor")
            else:
                groups, roles = [self.data_parallel_group, self.tensor_group], ("shard", "tensor")
            self._replica_lane_mesh = DeviceMesh.from_group(
                groups, self.device.type, mesh=layout,
                mesh_dim_names=tuple(f"{role}-{group.group_name}" for role, group in zip(roles, groups)))
        return self._replica_lane_mesh

    def replicas_of_lane_mesh(self):
        """zero=3 with tensor parallelism: the replica dimensions of `replica_lane_mesh` (1-D, or 2-D under HSDP),
        over which FSDP2 shards the lanes' blocks."""
        mesh = self.replica_lane_mesh()
        replicas = mesh.mesh_dim_names[:-1]
        return mesh[replicas if len(replicas) > 1 else replicas[0]]

    def lanes_of_replica_mesh(self):
        """zero=3 with tensor parallelism: the lane dimension of `replica_lane_mesh`, which cuts the parameters."""
        mesh = self.replica_lane_mesh()
        return mesh[mesh.mesh_dim_names[-1]]

    def _group(self, ranks: list[int]):
        # Collectives on our groups give up after the same bound as point-to-point waits.
        group = dist.new_group(ranks, timeout=self.timeout)
        self._made.append(group)
        return group

    def group_refs(self) -> list[weakref.ref]:
        """Weak references to the process groups this rank made and belongs to: dead once nothing holds them."""
        return [weakref.ref(group) for group in self._made if isinstance(group, dist.ProcessGroup)]

    def close(self) -> None:
        """Destroy the process groups made for this world (every rank calls it, as for their creation)."""
        destroy_groups(self._made)
        self._made.clear()

    def rank_of(self, position: int, replica: int | None = None, lane: int | None = None) -> int:
        """The rank running tensor-parallel lane ``lane`` of pipeline position ``position`` of ``replica`` (defaults:
        this rank's)."""
        replica = self.replica if replica is None else replica
        return (replica * self.stages + position) * self.tensor_parallel + (self.lane if lane is None else lane)

    def place_of(self, rank: int) -> tuple[int, int, int]:
        """(replica, pipeline position, tensor-parallel lane) of ``rank``."""
        pipeline_rank, lane = divmod(rank, self.tensor_parallel)
        replica, position = divmod(pipeline_rank, self.stages)
        return replica, position, lane

    def describe_rank(self, rank: int, stage: str) -> str:
        """``rank`` in messages: its stage (``stage``, described by the caller), replica and lane."""
        replica, _, lane = self.place_of(rank)
        lane_text = f", tensor rank {lane}" if self.tensor_parallel > 1 else ""
        return f"rank {rank} ({stage}, replica {replica}{lane_text})"

    def link_groups(self, topology: Topology, receive_ahead: bool) -> dict[Hashable, object]:
        """This replica's (and lane's) process groups for the links between stages on different pipeline positions,
        keyed by ``schedules.nccl_order.link_comm``: one per direction of every link when receives are posted
        ahead; else one per link between adjacent stages, one per direction of a skip connection or of an
        interleaved pipeline's link."""
        mine = {}
        chunks = topology.num_stages // topology.positions
        for replica, lane in itertools.product(range(self.data_parallel), range(self.tensor_parallel)):
            for link in topology.links:
                ranks = sorted({self.rank_of(topology.position_of(link.src), replica, lane),
                                self.rank_of(topology.position_of(link.dst), replica, lane)})
                if len(ranks) < 2:
                    continue
                for comm in dict.fromkeys(link_comm(link.index, link.src, link.dst, kind, chunks, receive_ahead)
                                           for kind in (ACT, GRAD)):
                    group = self._group(ranks)
                    if (replica, lane) == (self.replica, self.lane):
                        mine[comm] = group
        return mine

    def tied_groups(self, topology: Topology, tied: list[list[tuple[int, str]]]) -> dict[int, object]:
        """A group per tied parameter whose copies live on several pipeline positions, for this replica and lane."""
        mine = {}
        for replica, lane in itertools.product(range(self.data_parallel), range(self.tensor_parallel)):
            for i, copies in enumerate(tied):
                ranks = sorted({self.rank_of(topology.position_of(stage), replica, lane) for stage, _ in copies})
                if len(ranks) < 2:
                    continue
                group = self._group(ranks)
                if (replica, lane) == (self.replica, self.lane) and self.rank in ranks:
                    mine[i] = group
        return mine

"""Plan: which node runs on which stage, what crosses each boundary, predicted times."""
from __future__ import annotations

import copy
import json
from typing import Any

import networkx as nx
import numpy as np
import torch.fx as fx
import torch.nn as nn

from .chain import Chain, stage_time
from .errors import PartitionError
from .graph import CostGraph
from .stage_builder import stage_graph_module

_FORMAT = "pipetrain-plan/1"


class Plan:
    """A split of a cost graph's topological order into contiguous stages.

    A value crossing a boundary goes straight from its producer stage to each consumer
    stage (skip connections skip the stages between). Model inputs live on stage 0, so
    stage 0 passes on the inputs later stages need.
    """

    def __init__(self, *, order: list[str], cuts: list[int], method: Any, bandwidth: float,
                 replicas: list[int], ops: list[str], inputs: list[list[str]],
                 outputs: list[list[str]], stage_times: list[float], compute_times: list[float],
                 comm_bytes: list[float], param_bytes: list[float], act_bytes: list[float],
                 tied: list[list[tuple[int, str]]] | None = None, graph: CostGraph | None = None,
                 stage_memory: list[float] | None = None, recompute: list[str] | None = None):
        self.order, self.cuts, self.method = order, cuts, method
        self.bandwidth, self.replicas, self.ops = bandwidth, replicas, ops
        self._inputs, self._outputs = inputs, outputs
        self.stage_times, self.compute_times, self.comm_bytes = stage_times, compute_times, comm_bytes
        self.param_bytes, self.act_bytes = param_bytes, act_bytes
        self.graph = graph
        self._tied = tied
        # Given by partition() when it has a MemoryModel: per stage, the predicted peak bytes and the
        # recomputation setting they assume.
        self.stage_memory = stage_memory
        self.recompute = recompute
        self._stage_of = {name: int(np.searchsorted(cuts, i, side="right")) - 1
                          for i, name in enumerate(order)}

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_cuts(cls, graph: CostGraph | nx.DiGraph, chain: Chain, cuts: list[int], *,
                  method: Any, bandwidth: float, replicas: list[int],
                  allreduce_bandwidth: float | None = None) -> "Plan":
        """Evaluate a split (cuts[k] = first position of stage k, cuts[-1] = n)."""
        p = len(cuts) - 1
        stage = np.searchsorted(cuts, np.arange(chain.n), side="right") - 1
        inputs: list[list[str]] = [[] for _ in range(p)]
        outputs: list[list[str]] = [[] for _ in range(p)]
        for v in range(chain.n):
            if chain.ops[v] in ("get_attr", "output"):
                continue
            later = sorted({int(stage[q]) for q in chain.consumers[v]} - {int(stage[v])})
            if later:
                outputs[stage[v]].append(chain.names[v])
            for k in later:
                inputs[k].append(chain.names[v])
        inputs[0] = [chain.names[v] for v in range(cuts[1]) if chain.ops[v] == "placeholder"]
        segs = [chain.segment(cuts[k], cuts[k + 1]) for k in range(p)]
        times = [stage_time(s, bandwidth, replicas[k], allreduce_bandwidth)
                 for k, s in enumerate(segs)]
        plan = cls(order=chain.names, cuts=list(map(int, cuts)), method=method,
                   bandwidth=bandwidth, replicas=list(replicas), ops=chain.ops,
                   inputs=inputs, outputs=outputs, stage_times=times,
                   compute_times=[s["compute"] for s in segs],
                   comm_bytes=[s["received"] + s["sent"] for s in segs],
                   param_bytes=[s["params"] for s in segs],
                   act_bytes=[float(chain.acts[cuts[k]:cuts[k + 1]].sum()) for k in range(p)],
                   graph=graph if isinstance(graph, CostGraph) else None)
        if plan.graph is not None:  # the stages' own parameters, each counted once
            return plan.replaced(param_bytes=[plan._stage_param_bytes(k) for k in range(p)])
        return plan

    def replaced(self, **changes: Any) -> Plan:
        """A copy of this plan with ``changes`` to the constructor's arguments (``graph=graph.on_meta()``,
        ``stage_memory=...``); the tied groups carry over where they were found already."""
        fields = dict(order=self.order, cuts=self.cuts, method=self.method, bandwidth=self.bandwidth,
                      replicas=self.replicas, ops=self.ops, inputs=self._inputs, outputs=self._outputs,
                      stage_times=self.stage_times, compute_times=self.compute_times, comm_bytes=self.comm_bytes,
                      param_bytes=self.param_bytes, act_bytes=self.act_bytes,
                      tied=self._tied, graph=self.graph,
                      stage_memory=self.stage_memory, recompute=self.recompute)
        return Plan(**{**fields, **changes})

    # -- the runtime's interface ------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.cuts) - 1

    @property
    def bottleneck(self) -> float:
        """Predicted seconds per micro-batch of the slowest stage."""
        return max(self.stage_times)

    def nodes(self, k: int) -> list[str]:
        """Node names of stage k in order."""
        return self.order[self.cuts[k]:self.cuts[k + 1]]

    def stage_inputs(self, k: int) -> list[str]:
        """Values stage k's forward takes, in order (stage 0: the model's inputs)."""
        return list(self._inputs[k])

    def stage_outputs(self, k: int) -> list[str]:
        """Values stage k returns (empty for the last stage, which returns the model output)."""
        return list(self._outputs[k])

    def producer(self, name: str) -> int:
        """Stage that computes value `name` (and sends it to its consumers)."""
        return self._stage_of[name]

    def consumers(self, name: str) -> list[int]:
        """Later stages that receive value `name`."""
        return [k for k in range(1, self.num_stages) if name in self._inputs[k]]

    def build_stage(self, k: int) -> nn.Module:
        """Stage k as an fx.GraphModule holding deep copies of its parameters and buffers
        under their original qualified names."""
        return copy.deepcopy(self._shared_stage(k))

    def tied_groups(self) -> list[list[tuple[int, str]]]:
        """For each parameter held by 2+ stages: (stage, name in that stage) per copy.
        The copies' gradients must be summed (and kept equal) by the runtime."""
        if self._tied is None:
            self._need_graph("tied_groups")
            where: dict[int, list[tuple[int, str]]] = {}
            for k in range(self.num_stages):
                for name, p in self._shared_stage(k).named_parameters():
                    where.setdefault(id(p), []).append((k, name))
            self._tied = [copies for copies in where.values() if len(copies) > 1]
        return [list(g) for g in self._tied]

    # -- helpers --------------------------------------------------------------------------
    def _need_graph(self, what: str) -> CostGraph:
        if self.graph is None:
            raise PartitionError(f"{what} needs the traced model: this plan was made from a plain "
                                 "graph or loaded without one; fix: partition a CostGraph from "
                                 "partitioners.trace(), or Plan.from_json(text, graph=cost_graph)")
        return self.graph

    def _shared_stage(self, k: int) -> fx.GraphModule:
        if not 0 <= k < self.num_stages:
            raise IndexError(f"stage {k} out of range: the plan has {self.num_stages} stages")
        cg = self._need_graph("build_stage")
        last = k == self.num_stages - 1
        return stage_graph_module(cg, set(self.nodes(k)), self._inputs[k],
                                  None if last else self._outputs[k], f"Stage{k}")

    def _stage_param_bytes(self, k: int) -> float:
        return float(sum(p.numel() * p.element_size()
                         for p in self._shared_stage(k).parameters()))

    # -- presentation -------------------------------------------------------------------
    def __str__(self) -> str:
        head = (f"{'stage':>5} {'nodes':>6} {'reps':>4} {'compute ms':>11} {'comm MB':>8} "
                f"{'time ms':>9} {'params MB':>9} {'acts MB':>8} {'in':>4} {'out':>4}")
        if self.stage_memory is not None:
            head += f" {'peak MB':>8} {'recompute':>11}"
        lines = [f"Plan: {self.num_stages} stages, method={self.method!r}, "
                 f"bandwidth={self.bandwidth:.3g} B/s", head]
        for k in range(self.num_stages):
            lines.append(
                f"{k:>5} {self.cuts[k + 1] - self.cuts[k]:>6} {self.replicas[k]:>4} "
                f"{self.compute_times[k] * 1e3:>11.3f} {self.comm_bytes[k] / 1e6:>8.3f} "
                f"{self.stage_times[k] * 1e3:>9.3f} {self.param_bytes[k] / 1e6:>9.3f} "
                f"{self.act_bytes[k] / 1e6:>8.3f} {len(self._inputs[k]):>4} "
                f"{len(self._outputs[k]):>4}"
                + (f" {self.stage_memory[k] / 1e6:>8.3f} {self.recompute[k]:>11}"
                   if self.stage_memory is not None else ""))
        k = int(np.argmax(self.stage_times))
        lines.append(f"bottleneck: stage {k}, {self.bottleneck * 1e3:.3f} ms per micro-batch")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Plan {self.num_stages} stages, method={self.method!r}, bottleneck={self.bottleneck:.3g}s>"

    def to_json(self) -> str:
        """The plan as JSON text (includes tied groups when the traced model is attached)."""
        tied = self.tied_groups() if (self._tied is not None or self.graph is not None) else None
        return json.dumps({
            "format": _FORMAT, "method": self.method, "order": self.order, "ops": self.ops,
            "cuts": self.cuts, "bandwidth": self.bandwidth, "replicas": self.replicas,
            "inputs": self._inputs, "outputs": self._outputs, "stage_times": self.stage_times,
            "compute_times": self.compute_times, "comm_bytes": self.comm_bytes,
            "param_bytes": self.param_bytes, "act_bytes": self.act_bytes,
            "tied": None if tied is None else [[list(c) for c in g] for g in tied],
            "stage_memory": self.stage_memory, "recompute": self.recompute})

    @classmethod
    def from_json(cls, text: str, graph: CostGraph | None = None) -> "Plan":
        """Load a plan; pass the CostGraph of the same model to build stages from it."""
        d = json.loads(text)
        if d.get("format") != _FORMAT:
            raise PartitionError(f"not a plan (format {d.get('format')!r}, expected {_FORMAT!r})")
        if graph is not None and graph.order != d["order"]:
            raise PartitionError("the graph's nodes differ from the plan's: the plan was made for "
                                 "another model or trace; fix: trace the same model and inputs")
        tied = d["tied"]
        return cls(order=d["order"], cuts=d["cuts"], method=d["method"],
                   bandwidth=d["bandwidth"], replicas=d["replicas"], ops=d["ops"],
                   inputs=d["inputs"], outputs=d["outputs"], stage_times=d["stage_times"],
                   compute_times=d["compute_times"], comm_bytes=d["comm_bytes"],
                   param_bytes=d["param_bytes"], act_bytes=d["act_bytes"],
                   tied=None if tied is None else [[(int(k), n) for k, n in g] for g in tied],
                   graph=graph, stage_memory=d.get("stage_memory"), recompute=d.get("recompute"))


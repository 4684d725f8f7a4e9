"""Who sends what to whom: the links between virtual stages and the pipeline position of each stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from schedules.placement import check_placement, location_of, virtual_stage_of

# The two directions of a link: activations src -> dst, their gradients dst -> src.
ACT, GRAD = "act", "grad"


@dataclass(frozen=True)
class Link:
    """The values stage ``src`` sends to stage ``dst`` for each micro-batch (activations one
    way, their gradients the other way). Skip connections are links between non-adjacent stages."""

    index: int
    src: int
    dst: int
    names: tuple[str, ...]


class Message(NamedTuple):
    """One message of a comm batch: the values to send on ``link``, or None to receive them.
    ``shape_key`` (the shapes of the micro-batch's inputs, Feed.shapes) tells the transport when
    boundary shapes may change."""

    link: Link
    kind: str
    micro_batch: int
    values: list | None
    shape_key: Any = None


class Topology:
    """Links of a partition plan placed on ``positions`` pipeline positions: which virtual stage each
    chunk of a position runs is the schedule's ``placement`` (``schedules.placement``: "loop", v =
    chunk * positions + position as in interleaved 1F1B, or "v", two chunks per position folded back)."""

    def __init__(self, plan: Any, positions: int, placement: str = "loop"):
        self.num_stages = plan.num_stages
        self.positions = positions
        self.placement = placement
        if self.num_stages % positions:
            raise ValueError(f"{self.num_stages} virtual stages do not divide over {positions} pipeline positions")
        check_placement(placement, self.num_stages // positions)
        pairs: dict[tuple[int, int], list[str]] = {}
        for src in range(self.num_stages - 1):
            for name in plan.stage_outputs(src):
                for dst in plan.consumers(name):
                    pairs.setdefault((src, dst), []).append(name)
        self.links = [Link(i, src, dst, tuple(names)) for i, ((src, dst), names) in enumerate(sorted(pairs.items()))]
        self.into = {v: [l for l in self.links if l.dst == v] for v in range(self.num_stages)}
        self.out_of = {v: [l for l in self.links if l.src == v] for v in range(self.num_stages)}
        self.inputs = {v: list(plan.stage_inputs(v)) for v in range(self.num_stages)}
        self.outputs = {v: list(plan.stage_outputs(v)) for v in range(self.num_stages)}
        self.input_index = {v: {n: i for i, n in enumerate(names)} for v, names in self.inputs.items()}
        # Per stage, its links to other positions (moved by SEND/RECV actions) and within its position
        # (handed over in memory): looked up for every message, split once.
        self.remote_into = {v: [l for l in ls if not self.same_position(l)] for v, ls in self.into.items()}
        self.remote_out_of = {v: [l for l in ls if not self.same_position(l)] for v, ls in self.out_of.items()}
        self.local_into = {v: [l for l in ls if self.same_position(l)] for v, ls in self.into.items()}
        self.local_out_of = {v: [l for l in ls if self.same_position(l)] for v, ls in self.out_of.items()}
        for v in range(1, self.num_stages):
            arriving = {n for l in self.into[v] for n in l.names}
            missing = [n for n in self.inputs[v] if n not in arriving]
            if missing:
                raise ValueError(f"plan error: stage {v} needs {missing} but no earlier stage sends them")

    def position_of(self, stage: int) -> int:
        """The pipeline position (0 .. positions - 1) that runs virtual stage ``stage``."""
        return location_of(stage, self.positions, self.placement)[0]

    def chunk_of(self, stage: int) -> int:
        """Which of its position's chunks virtual stage ``stage`` is."""
        return location_of(stage, self.positions, self.placement)[1]

    def stages_at(self, position: int) -> list[int]:
        """The virtual stages pipeline position ``position`` runs, in chunk order."""
        chunks = self.num_stages // self.positions
        return [virtual_stage_of(position, c, self.positions, self.placement) for c in range(chunks)]

    def same_position(self, link: Link) -> bool:
        """Whether both ends of ``link`` run on one pipeline position: its values are handed over in memory
        when they are made, never by a SEND or RECV action."""
        return self.position_of(link.src) == self.position_of(link.dst)

    def describe(self, position: int) -> str:
        """"stage 1" or "stages 1, 5": what position ``position`` runs, for messages."""
        stages = self.stages_at(position)
        return f"stage {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"

    def assemble(self, stage: int, received: dict[int, list[Any]]) -> tuple:
        """Stage inputs in the module's order from the values received on each incoming link."""
        by_name = {}
        for link in self.into[stage]:
            by_name.update(zip(link.names, received[link.index]))
        return tuple(by_name[n] for n in self.inputs[stage])

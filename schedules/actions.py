"""Pipeline actions: the small immutable records every schedule is made of.

A schedule is plain data: one list of actions per device. The runtime executes
the lists, the validator checks them and the simulator times them, so all three
read exactly the same thing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ActionKind(str, Enum):
    """What an action does; the value is its text prefix ("F", "SEND_ACT", ...)."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward, or its input-gradient part in zero-bubble schedules
    WEIGHT = "W"  # weight-gradient part of a split backward (zero-bubble only)
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    STEP = "STEP"  # optimizer step; micro_batch holds the mini-batch index
    REDUCE = "REDUCE"  # data-parallel gradient reduction; micro_batch = mini-batch index
    # marker, no work: the F (micro_batch, chunk) right after it runs overlapped with the next B
    # (dualpipev), the slot where a communication hook such as an MoE all-to-all would hide
    OVERLAP = "OVERLAP"


COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT})
COMM_KINDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
)

_BY_VALUE = {kind.value: kind for kind in ActionKind}
_TEXT = re.compile(r"([A-Z_]+)(\d+)(?::(\d+))?")


@dataclass(frozen=True, slots=True, init=False)
class Action:
    """One step of one device: `kind` applied to `micro_batch` of model chunk `chunk`.

    `position` is the device's place in the pipeline (0..stages-1), the index of the
    list that holds the action; its virtual stage is Schedule.virtual_stage(position, chunk).
    `micro_batch` is global across mini-batches (micro-batch g belongs to
    mini-batch g // micro_batches); for STEP and REDUCE it is the mini-batch.
    """

    position: int
    kind: ActionKind
    micro_batch: int
    chunk: int = 0

    def __init__(self, position: int, kind: ActionKind, micro_batch: int, chunk: int = 0) -> None:
        # The instance is frozen, so the fields are written through their slot descriptors.
        # That is what the generated __init__ does via object.__setattr__, only about a third
        # faster, and a big schedule creates hundreds of thousands of actions.
        _set_position(self, position)
        _set_kind(self, kind)
        _set_micro_batch(self, micro_batch)
        _set_chunk(self, chunk)

    def __str__(self) -> str:
        text = f"{self.kind.value}{self.micro_batch}"
        return f"{text}:{self.chunk}" if self.chunk else text

    def __repr__(self) -> str:
        return f"Action({self.position}, {str(self)!r})"

    @classmethod
    def parse(cls, text: str, position: int) -> "Action":
        """Parse the text form ("F3", "SEND_ACT3", "B3:1") of an action of device `position`."""
        match = _TEXT.fullmatch(text.strip())
        if match is None or match.group(1) not in _BY_VALUE:
            known = ", ".join(_BY_VALUE)
            raise ValueError(
                f"cannot parse action {text!r}: expected KIND<micro-batch>[:<chunk>] "
                f"with KIND one of {known}, e.g. 'F3' or 'B3:1'"
            )
        chunk = int(match.group(3)) if match.group(3) is not None else 0
        return cls(position, _BY_VALUE[match.group(1)], int(match.group(2)), chunk)


_set_position, _set_kind, _set_micro_batch, _set_chunk = (
    Action.__dict__[name].__set__ for name in ("position", "kind", "micro_batch", "chunk"))

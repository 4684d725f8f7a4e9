"""`Schedule`: the action list of every device plus the shape it was built for.

Text form (one header line, then one line per stage)::

    # schedule kind=1f1b stages=2 micro_batches=2 chunks=1 mini_batches=1
    0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 STEP0
    1: RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 STEP0

CSV form: the same header line, then rows `stage,index,kind,micro_batch,chunk`.
A schedule with V placement (schedules.placement) adds `placement=v` to the header; a header
without it means the default loop placement.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from schedules.actions import Action
from schedules.placement import check_placement, location_of, virtual_stage_of

_HEADER = "# schedule"
_CSV_COLUMNS = ["stage", "index", "kind", "micro_batch", "chunk"]


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message names the first offending action."""


@dataclass
class Schedule:
    """Per-device action lists for `stages` devices.

    `chunks` is the number of virtual stages (model chunks) per device, `placement`
    which virtual stage each is ("loop": device d chunk c is c*stages + d; "v": device d
    holds d and 2*stages-1-d; see schedules.placement and the methods virtual_stage and
    location); `mini_batches` the number of optimizer steps the lists cover.
    """

    kind: str
    stages: int
    micro_batches: int
    actions: list[list[Action]]
    chunks: int = 1
    mini_batches: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        for name in ("stages", "micro_batches", "chunks", "mini_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Schedule.{name} must be a positive int, got {value!r}")
        if len(self.actions) != self.stages:
            raise ValueError(
                f"Schedule has {len(self.actions)} action lists for {self.stages} stages; "
                "give exactly one list per stage"
            )
        check_placement(self.placement, self.chunks)

    @property
    def virtual_stages(self) -> int:
        """Number of model pieces in the pipeline (stages x chunks)."""
        return self.stages * self.chunks

    def virtual_stage(self, position: int, chunk: int) -> int:
        """The virtual stage of chunk `chunk` on device `position` under this placement."""
        return virtual_stage_of(position, chunk, self.stages, self.placement)

    def location(self, virtual_stage: int) -> tuple[int, int]:
        """(position, chunk) holding `virtual_stage`: the inverse of virtual_stage."""
        return location_of(virtual_stage, self.stages, self.placement)

    def remote_neighbour(self, position: int, chunk: int, step: int) -> int | None:
        """The device of virtual stage v+step (v: chunk `chunk` of device `position`; step +1
        downstream, -1 upstream), or None when no message goes there: v+step is outside the
        pipeline, or on the same device (V placement's hand-off stages-1 -> stages, done in memory)."""
        other = self.virtual_stage(position, chunk) + step
        if not 0 <= other < self.virtual_stages:
            return None
        device = self.location(other)[0]
        return None if device == position else device

    def _header(self) -> str:
        return (
            f"{_HEADER} kind={self.kind} stages={self.stages} "
            f"micro_batches={self.micro_batches} chunks={self.chunks} "
            f"mini_batches={self.mini_batches}"
            # written only when not the default, so loop schedules keep their text
            + (f" placement={self.placement}" if self.placement != "loop" else "")
        )

    def to_text(self) -> str:
        """Header line plus one `stage: actions...` line per stage."""
        lines = [self._header()]
        for stage, actions in enumerate(self.actions):
            lines.append(f"{stage}: " + " ".join(map(str, actions)))
        return "\n".join(lines) + "\n"

    __str__ = to_text

    @classmethod
    def from_text(cls, text: str) -> "Schedule":
        """Parse `to_text()` output (or a hand-written schedule in the same form)."""
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        meta = _parse_header(lines[0] if lines else "")
        actions: list[list[Action]] = []
        for line in lines[1:]:
            label, sep, body = line.partition(":")
            if not sep or not label.strip().isdigit() or int(label) != len(actions):
                raise ValueError(
                    f"schedule line {line!r}: expected '{len(actions)}: <actions>' "
                    "(stages listed in order 0, 1, ...)"
                )
            actions.append([Action.parse(tok, len(actions)) for tok in body.split()])
        return cls(actions=actions, **meta)

    def to_csv(self) -> str:
        """Header line plus one CSV row per action."""
        out = io.StringIO()
        out.write(self._header() + "\n")
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(_CSV_COLUMNS)
        for stage, actions in enumerate(self.actions):
            for index, a in enumerate(actions):
                writer.writerow([stage, index, a.kind.value, a.micro_batch, a.chunk])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        """Parse `to_csv()` output; rows are ordered by (stage, index)."""
        first, _, rest = text.partition("\n")
        meta = _parse_header(first)
        rows = list(csv.DictReader(io.StringIO(rest)))
        if rows and set(rows[0]) != set(_CSV_COLUMNS):
            raise ValueError(f"schedule CSV needs the columns {','.join(_CSV_COLUMNS)}")
        actions: list[list[tuple[int, Action]]] = [[] for _ in range(meta["stages"])]
        for row in rows:
            stage = int(row["stage"])
            if not 0 <= stage < meta["stages"]:
                raise ValueError(f"schedule CSV row {row}: stage out of range 0..{meta['stages'] - 1}")
            text_form = f"{row['kind']}{row['micro_batch']}:{row['chunk']}"
            actions[stage].append((int(row["index"]), Action.parse(text_form, stage)))
        ordered = [[a for _, a in sorted(rows_of_stage, key=lambda r: r[0])] for rows_of_stage in actions]
        return cls(actions=ordered, **meta)


def _parse_header(line: str) -> dict:
    if not line.startswith(_HEADER):
        raise ValueError(
            f"schedule text must start with a header like "
            f"'{_HEADER} kind=custom stages=2 micro_batches=4' (chunks, mini_batches, placement optional), "
            f"got {line!r}"
        )
    fields = dict(item.split("=", 1) for item in line[len(_HEADER):].split() if "=" in item)
    try:
        meta = {"kind": fields.pop("kind"), "stages": int(fields.pop("stages")),
                "micro_batches": int(fields.pop("micro_batches")),
                "chunks": int(fields.pop("chunks", 1)),
                "mini_batches": int(fields.pop("mini_batches", 1)),
                "placement": fields.pop("placement", "loop")}
    except (KeyError, ValueError) as exc:
        raise ValueError(f"bad schedule header {line!r}: needs kind=, stages=, micro_batches= ({exc})") from None
    if fields:
        raise ValueError(f"bad schedule header {line!r}: unknown fields {sorted(fields)}")
    return meta

"""`Schedule`: the action list of every device plus the shape it was built for.

Text form (one header line, then one line per stage)::

    # schedule kind=1f1b stages=2 micro_batches=2 chunks=1 mini_batches=1
    0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 STEP0
    1: RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 STEP0

CSV form: the same header line, then rows `stage,index,kind,micro_batch,chunk`.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from schedules.actions import Action

_HEADER = "# schedule"
_CSV_COLUMNS = ["stage", "index", "kind", "micro_batch", "chunk"]


class ScheduleError(ValueError):
    """A schedule that cannot run correctly; the message names the first offending action."""


@dataclass
class Schedule:
    """Per-device action lists for `stages` devices.

    `chunks` is the number of virtual stages (model chunks) per device
    (interleaved schedules; device d chunk c is virtual stage c*stages + d);
    `mini_batches` the number of optimizer steps the lists cover.
    """

    kind: str
    stages: int
    micro_batches: int
    actions: list[list[Action]]
    chunks: int = 1
    mini_batches: int = 1

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

    @property
    def virtual_stages(self) -> int:
        """Number of model pieces in the pipeline (stages x chunks)."""
        return self.stages * self.chunks

    def _header(self) -> str:
        return (
            f"{_HEADER} kind={self.kind} stages={self.stages} "
            f"micro_batches={self.micro_batches} chunks={self.chunks} "
            f"mini_batches={self.mini_batches}"
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
            f"'{_HEADER} kind=custom stages=2 micro_batches=4' (chunks, mini_batches optional), "
            f"got {line!r}"
        )
    fields = dict(item.split("=", 1) for item in line[len(_HEADER):].split() if "=" in item)
    try:
        meta = {"kind": fields.pop("kind"), "stages": int(fields.pop("stages")),
                "micro_batches": int(fields.pop("micro_batches")),
                "chunks": int(fields.pop("chunks", 1)),
                "mini_batches": int(fields.pop("mini_batches", 1))}
    except (KeyError, ValueError) as exc:
        raise ValueError(f"bad schedule header {line!r}: needs kind=, stages=, micro_batches= ({exc})") from None
    if fields:
        raise ValueError(f"bad schedule header {line!r}: unknown fields {sorted(fields)}")
    return meta

"""Export a SimResult as a Chrome trace (JSON) or a PNG timeline."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from schedules.actions import ActionKind, COMPUTE_KINDS

if TYPE_CHECKING:
    from schedules.simulate import SimResult

_COLOURS = {ActionKind.FORWARD: "#4c9be8", ActionKind.BACKWARD: "#5cb85c",
            ActionKind.WEIGHT: "#f0ad4e"}
_SECONDS_TO_US = 1e6


def chrome_trace_events(result: "SimResult") -> list[dict]:
    """Trace events: one slice per F/B/W, an instant per STEP/REDUCE, a flow arrow per message."""
    s = result.schedule
    events: list[dict] = []
    sent: dict[tuple[int, int, int], tuple[int, float]] = {}
    for d in range(s.stages):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                       "args": {"name": f"stage {d}"}})
    for d, actions in enumerate(s.actions):
        for a, t0, t1 in zip(actions, result.start[d], result.end[d]):
            v = s.virtual_stage(d, a.chunk)
            if a.kind in COMPUTE_KINDS:
                events.append({"name": str(a), "cat": a.kind.name, "ph": "X", "pid": 0, "tid": d,
                               "ts": t0 * _SECONDS_TO_US, "dur": (t1 - t0) * _SECONDS_TO_US,
                               "args": {"micro_batch": a.micro_batch, "chunk": a.chunk}})
            elif a.kind in (ActionKind.STEP, ActionKind.REDUCE):
                events.append({"name": str(a), "cat": a.kind.name, "ph": "i", "s": "t", "pid": 0,
                               "tid": d, "ts": t0 * _SECONDS_TO_US})
            elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
                grad = a.kind is ActionKind.SEND_GRAD
                sent[(int(grad), a.micro_batch, v - 1 if grad else v + 1)] = (d, t0)
    flow = 0
    for d, actions in enumerate(s.actions):
        for a, t0 in zip(actions, result.start[d]):
            v = s.virtual_stage(d, a.chunk)
            key = (int(a.kind is ActionKind.BACKWARD), a.micro_batch, v)
            if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD) and key in sent:
                src, ts = sent[key]
                name = "grad" if key[0] else "act"
                events.append({"name": name, "cat": "message", "ph": "s", "id": flow, "pid": 0,
                               "tid": src, "ts": ts * _SECONDS_TO_US})
                events.append({"name": name, "cat": "message", "ph": "f", "bp": "e", "id": flow,
                               "pid": 0, "tid": d, "ts": t0 * _SECONDS_TO_US})
                flow += 1
    return events


def write_chrome_trace(result: "SimResult", path: str) -> None:
    """Write the trace as {"traceEvents": [...]} JSON."""
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_trace_events(result), "displayTimeUnit": "ms"}, f)


def write_png(result: "SimResult", path: str) -> None:
    """Draw one row per stage, one bar per F/B/W, labelled with its micro-batch when it fits."""
    try:  # lazy: the package itself needs only the stdlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError("write_png draws with matplotlib, which pipetrain installs only with its examples "
                          "extra: pip install 'pipetrain[examples]' (or write_chrome_trace, which needs "
                          "nothing)") from error

    s = result.schedule
    fig = Figure(figsize=(min(4 + result.makespan / 2, 24), 1 + 0.5 * s.stages))
    ax = fig.add_subplot()
    label = sum(len(a) for a in s.actions) <= 600  # text stays legible only for small schedules
    for d, actions in enumerate(s.actions):
        for a, t0, t1 in zip(actions, result.start[d], result.end[d]):
            if a.kind not in COMPUTE_KINDS or t1 <= t0:
                continue
            ax.barh(d, t1 - t0, left=t0, height=0.8, color=_COLOURS[a.kind], edgecolor="black",
                    linewidth=0.3)
            if label:
                text = f"{a.micro_batch}:{a.chunk}" if a.chunk else str(a.micro_batch)
                ax.text((t0 + t1) / 2, d, text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(s.stages), [f"stage {d}" for d in range(s.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{s.kind}: makespan {result.makespan:g}, bubble {100 * result.bubble_fraction:.1f}%")
    present = {a.kind for actions in s.actions for a in actions}
    handles = [Patch(color=c, label=k.name.lower()) for k, c in _COLOURS.items() if k in present]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)

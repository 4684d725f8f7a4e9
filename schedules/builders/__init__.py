"""`build(kind, stages, micro_batches, **options)`: every schedule builder behind one name."""
from __future__ import annotations

import inspect
from typing import Callable

from schedules.builders.async_1f1b import async_1f1b, async_1f1b_actions
from schedules.builders.common import check_count
from schedules.builders.gpipe import gpipe
from schedules.builders.interleaved import interleaved_1f1b
from schedules.builders.one_f_one_b import one_f_one_b
from schedules.builders.reduce import stream_with_reductions, with_reductions
from schedules.builders.zero_bubble import zb_h1
from schedules.builders.zero_bubble_v import dualpipev, interleaved_zb, zbv
from schedules.gc_pause import gc_paused
from schedules.schedule import Schedule

BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "async-1f1b": async_1f1b,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "interleaved-zb": interleaved_zb,
}


@gc_paused()
def build(kind: str, stages: int, micro_batches: int, **options: object) -> Schedule:
    """Build the action lists of every stage for schedule `kind`.

    Options: chunks (interleaved-1f1b and interleaved-zb, default 2; gpipe, default 1); mini_batches
    (async-1f1b, default 4). The lists have no REDUCE: with_reductions adds them.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown schedule kind {kind!r}; choose one of {', '.join(BUILDERS)}")
    check_count("stages", stages)
    check_count("micro_batches", micro_batches)
    builder = BUILDERS[kind]
    accepted = [name for name, p in inspect.signature(builder).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        # REDUCE actions come from a pass over any kind, not from a builder option
        hint = "; for REDUCE before each STEP use with_reductions(build(...))" if "data_parallel" in unknown else ""
        raise TypeError(f"schedule {kind!r} does not take option(s) {unknown}; it accepts {accepted}{hint}")
    return builder(stages, micro_batches, **options)


__all__ = ["BUILDERS", "build", "async_1f1b_actions", "stream_with_reductions", "with_reductions"]

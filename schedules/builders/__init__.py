"""`build(kind, stages, micro_batches, **options)`: every schedule builder behind one name."""
from __future__ import annotations

import inspect
from typing import Callable

from schedules.builders.async_1f1b import async_1f1b, async_1f1b_actions
from schedules.builders.common import check_count
from schedules.builders.gpipe import gpipe
from schedules.builders.interleaved import interleaved_1f1b
from schedules.builders.one_f_one_b import one_f_one_b
from schedules.builders.zero_bubble import zb_h1
from schedules.gc_pause import gc_paused
from schedules.schedule import Schedule

BUILDERS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "async-1f1b": async_1f1b,
    "zb-h1": zb_h1,
}


@gc_paused()
def build(kind: str, stages: int, micro_batches: int, **options: object) -> Schedule:
    """Build the action lists of every stage for schedule `kind`.

    Options: data_parallel=True (all kinds) puts REDUCE t before each STEP t;
    chunks (interleaved-1f1b, default 2); mini_batches (async-1f1b, default 4).
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
        raise TypeError(f"schedule {kind!r} does not take option(s) {unknown}; it accepts {accepted}")
    return builder(stages, micro_batches, **options)


__all__ = ["BUILDERS", "build", "async_1f1b_actions"]

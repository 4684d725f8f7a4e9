"""Placement of model chunks on devices: which virtual stage (model piece) device d's chunk c is.

"loop" (interleaved 1F1B, Megatron-LM): virtual stage c*stages + d, so the pipeline loops
over the devices `chunks` times. "v" (ZB-V, DualPipeV): two chunks per device, device d holds
virtual stages d and 2*stages-1-d, so device 0 holds the first and the last piece and the
hand-off between the two chunks (virtual stage stages-1 -> stages) stays on device stages-1.
Every mapping between (position, chunk) and virtual stage goes through these two functions.
"""
from __future__ import annotations

PLACEMENTS = ("loop", "v")


def check_placement(placement: str, chunks: int) -> None:
    """Raise ValueError unless `placement` is known and fits `chunks` chunks per device."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    if placement == "v" and chunks != 2:
        raise ValueError(f"placement 'v' needs exactly 2 chunks per device, got {chunks}")


def virtual_stage_of(position: int, chunk: int, stages: int, placement: str = "loop") -> int:
    """The virtual stage of chunk `chunk` on device `position` of a `stages`-device pipeline."""
    if placement == "v" and chunk == 1:
        return 2 * stages - 1 - position
    return chunk * stages + position


def location_of(virtual_stage: int, stages: int, placement: str = "loop") -> tuple[int, int]:
    """(position, chunk) of virtual stage `virtual_stage`: the inverse of virtual_stage_of."""
    chunk, rest = divmod(virtual_stage, stages)
    if placement == "v" and chunk == 1:
        return stages - 1 - rest, 1
    return rest, chunk

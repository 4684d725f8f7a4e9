"""Interleaved 1F1B (Megatron-LM): each device holds `chunks` model chunks (virtual stages)."""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.common import check_count
from schedules.builders.send_recv import attach_comms
from schedules.schedule import Schedule


def _unit(k: int, stages: int, chunks: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a device's k-th forward (or backward) unit.

    Units go in groups of `stages` micro-batches per chunk, chunks ascending for
    forwards and descending for backwards, so that every device runs the same
    sequence and each group's outputs are ready when the next device needs them.
    """
    group = k // stages
    chunk = group % chunks
    micro_batch = (k // (stages * chunks)) * stages + k % stages
    return micro_batch, (chunks - 1 - chunk) if backward else chunk


def interleaved_1f1b(stages: int, micro_batches: int, *, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B.

    Needs stages >= 2, chunks >= 2 and micro_batches divisible by stages.
    Device d warms up with w = (p-d-1)*2 + (v-1)*p forward units; its peak
    in-flight (micro-batch, chunk) units is min(w+1, m*v). With unit costs the
    bubble is (p-1)/v forward+backward times, v times less than 1F1B's.
    """
    check_count("chunks", chunks, 2)
    if stages < 2:
        raise ValueError("interleaved-1f1b needs stages >= 2; with one stage use '1f1b'")
    if micro_batches % stages:
        raise ValueError(
            f"interleaved-1f1b needs micro_batches divisible by stages, got "
            f"{micro_batches} micro-batches for {stages} stages; use a multiple of {stages}"
        )
    total = micro_batches * chunks
    compute = []
    for d in range(stages):
        warmup = min((stages - d - 1) * 2 + (chunks - 1) * stages, total)
        order = [(ActionKind.FORWARD, k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [(ActionKind.FORWARD, warmup + i), (ActionKind.BACKWARD, i)]
        order += [(ActionKind.BACKWARD, k) for k in range(total - warmup, total)]
        actions = [Action(d, kind, *_unit(k, stages, chunks, kind is ActionKind.BACKWARD))
                   for kind, k in order]
        compute.append(actions + [Action(d, ActionKind.STEP, 0)])
    return Schedule("interleaved-1f1b", stages, micro_batches,
                    attach_comms(compute, stages, chunks), chunks=chunks)

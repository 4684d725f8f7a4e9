"""Zero-bubble schedules with two or more chunks per device: zbv, dualpipev, interleaved-zb.

All three split the backward into B (input gradient, on the critical path) and W (weight
gradient, run where a device would otherwise idle), like zb-h1. Their orders come from
list_schedule: a unit-cost run in which each idle device starts the ready unit its schedule
prefers, within a limit on the units it holds activations for (F started, W not yet).
"""
from __future__ import annotations

from schedules.actions import Action, ActionKind
from schedules.builders.common import check_count
from schedules.builders.list_scheduling import Unit, list_schedule
from schedules.builders.send_recv import attach_comms, receives_in_send_order
from schedules.schedule import Schedule

F, B, W, STEP, OVERLAP = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.STEP,
                          ActionKind.OVERLAP)


def _by_rank(rank: dict[ActionKind, int], limit: int):
    """Pick by `rank` of the kind, then the deeper virtual stage, then the older micro-batch;
    start no F while `limit` units are held."""
    def pick(device: int, ready: list[Unit], held: int, history: list[Unit]) -> Unit | None:
        allowed = [u for u in ready if u.kind is not F or held < limit]
        return min(allowed, key=lambda u: (rank[u.kind], -u.virtual_stage, u.micro_batch), default=None)
    return pick


def _critical_first(limit: int):
    """B before F before W: the critical path first, W's where nothing else is ready."""
    return _by_rank({B: 0, F: 1, W: 2}, limit)


def _finish(kind: str, stages: int, micro_batches: int, chunks: int, placement: str,
            compute: list[list[Action]]) -> Schedule:
    compute = [actions + [Action(d, STEP, 0)] for d, actions in enumerate(compute)]
    actions = receives_in_send_order(attach_comms(compute, stages, chunks, placement), stages, placement)
    return Schedule(kind, stages, micro_batches, actions, chunks=chunks, placement=placement)


def _check_v(kind: str, stages: int) -> None:
    if stages < 2:
        raise ValueError(f"{kind} needs stages >= 2 (two chunks on each of at least two devices); "
                         "with one stage use 'zb-h1' or '1f1b'")


def zbv(stages: int, micro_batches: int) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024).

    V placement: device d holds virtual stages d and 2p-1-d, so device 0 computes the first
    and the last chunk and the pipeline's turn (p-1 -> p) stays on device p-1. Each device
    holds activations for at most 2p chunk units (p micro-batches of its whole share, as 1F1B's
    first stage) from F to W. Any micro_batches >= 1 works; with F = B = W and m >= 2p the bubble is
    only the ramp of the first forward and the last backward through the V.
    """
    _check_v("zbv", stages)
    # forwards first while under the limit (ZB-V's warm-up fills the V), then B's, W's last;
    # at unit costs this beats B-first (4 stages x 8: 5.9% against 7.7%), and at B = 2F too
    compute = list_schedule(stages, micro_batches, 2, "v", _by_rank({F: 0, B: 1, W: 2}, 2 * stages))
    return _finish("zbv", stages, micro_batches, 2, "v", compute)


def dualpipev(stages: int, micro_batches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut to one direction, as torch's ScheduleDualPipeV).

    V placement as in zbv. Warm-up runs forwards; in the steady phase a device alternates one
    forward with one backward of another micro-batch and runs that backward's W right after it
    (a full backward), so each forward can overlap the backward next to it; the cool-down defers
    W's into the drain as zb-h1 does. Every steady-phase pair is marked in the data: an action
    OVERLAPm:c right before F m:c says that forward runs overlapped with the B that follows it,
    the slot where a communication hook (an MoE all-to-all dispatch/combine) hides behind the other
    micro-batch's compute. The marker takes no time: validate checks only that it names the next
    F and that a B of another micro-batch follows; simulate and the NCCL-order checker skip it.
    Activations held: at most 2p chunk units per device, as zbv.
    """
    _check_v("dualpipev", stages)
    limit = 2 * stages

    def pick(device: int, ready: list[Unit], held: int, history: list[Unit]) -> Unit | None:
        # steady phase: forwards are left (and, for the F -> B pairing, half the limit is held)
        if history and sum(u.kind is F for u in history) < 2 * micro_batches:
            last = history[-1]
            if last.kind is B:  # the backward finishes with its weight gradient (a full backward)
                own_w = [u for u in ready if u.kind is W and (u.micro_batch, u.chunk) == (last.micro_batch, last.chunk)]
                if own_w:
                    return own_w[0]
            if last.kind is F and held >= limit // 2:  # a forward, then a backward to overlap it with
                backward = [u for u in ready if u.kind is B]
                if backward:
                    return min(backward, key=lambda u: (-u.virtual_stage, u.micro_batch))
        return _critical_first(limit)(device, ready, held, history)

    compute = [_mark_overlaps(actions) for actions in list_schedule(stages, micro_batches, 2, "v", pick)]
    return _finish("dualpipev", stages, micro_batches, 2, "v", compute)


def _mark_overlaps(actions: list[Action]) -> list[Action]:
    """Put an OVERLAP marker before every F directly followed by a B of another micro-batch."""
    out: list[Action] = []
    for a, after in zip(actions, actions[1:] + [None]):
        if a.kind is F and after is not None and after.kind is B and after.micro_batch != a.micro_batch:
            out.append(Action(a.position, OVERLAP, a.micro_batch, a.chunk))
        out.append(a)
    return out


def interleaved_zb(stages: int, micro_batches: int, *, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B with the backward split into B and W (torch's ScheduleInterleavedZeroBubble).

    Loop placement (device d chunk c is virtual stage c*p + d) as interleaved-1f1b; W's are
    deferred to fill the warm-up and drain bubbles. Each device holds at most as many chunk
    units as interleaved-1f1b's first device, 2(p-1) + (v-1)p + 1, from F to W. Any micro_batches >= 1.
    """
    check_count("chunks", chunks, 2)
    if stages < 2:
        raise ValueError("interleaved-zb needs stages >= 2; with one stage use 'zb-h1'")
    limit = 2 * (stages - 1) + (chunks - 1) * stages + 1
    compute = list_schedule(stages, micro_batches, chunks, "loop", _critical_first(limit))
    return _finish("interleaved-zb", stages, micro_batches, chunks, "loop", compute)

"""`validate(schedule)`: reject schedules that cannot run correctly.

Checks, in this order, and reports the first offending action of the first
failing check: every action is well-formed (right stage, chunk and index in
range); sends and receives between each ordered pair of devices match one to
one and in the same order (FIFO); per stage, a backward follows its forward,
receives are posted before their consumer, sends follow what they send, and
each optimizer step (and reduction) comes after every gradient of its
mini-batch; finally the schedule runs to the end without any stage waiting
forever (deadlock).
"""
from __future__ import annotations

from collections import defaultdict

from schedules.actions import Action, ActionKind, COMM_KINDS
from schedules.execution import Timeline, execute
from schedules.schedule import Schedule, ScheduleError

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
STEP, REDUCE = ActionKind.STEP, ActionKind.REDUCE


def _where(stage: int, index: int, action: Action) -> str:
    return f"stage {stage} action {index} '{action}'"


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError naming the first offending action; return None if the schedule is sound."""
    check_structure(schedule)
    zero = {F: 0.0, B: 0.0, W: 0.0}
    no_delay = [[0.0] * schedule.stages for _ in range(schedule.stages)]
    raise_if_deadlocked(schedule, execute(schedule, [zero] * schedule.stages, no_delay))


def check_structure(schedule: Schedule) -> None:
    """Every check except deadlock (which needs an execution, see raise_if_deadlocked)."""
    _check_fields_and_messages(schedule)
    for stage in range(schedule.stages):
        _check_stage(schedule, stage)


def _message_text(is_grad: bool, send: bool, micro_batch: int, chunk: int) -> str:
    kind = ("SEND_" if send else "RECV_") + ("GRAD" if is_grad else "ACT")
    return f"{kind}{micro_batch}" + (f":{chunk}" if chunk else "")


def _check_fields_and_messages(s: Schedule) -> None:
    p, virtual, micro_total = s.stages, s.virtual_stages, s.micro_batches * s.mini_batches
    # (sender, receiver) -> [(action index, (is_grad, micro_batch, receiving virtual stage))]
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for stage, actions in enumerate(s.actions):
        for i, a in enumerate(actions):
            if type(a) is not Action or not isinstance(a.kind, ActionKind):
                raise ScheduleError(f"stage {stage} action {i} {a!r}: not an Action; build actions "
                                    "with schedules.Action or Action.parse")
            kind, chunk = a.kind, a.chunk
            if a.stage != stage:
                raise ScheduleError(f"{_where(stage, i, a)}: belongs to stage {a.stage} but sits in "
                                    f"stage {stage}'s list")
            if not 0 <= chunk < s.chunks:
                raise ScheduleError(f"{_where(stage, i, a)}: chunk {chunk} out of range, the "
                                    f"schedule has {s.chunks} chunk(s) per stage")
            whole_stage = kind is STEP or kind is REDUCE
            limit = s.mini_batches if whole_stage else micro_total
            if not 0 <= a.micro_batch < limit:
                what = "mini-batch" if whole_stage else "micro-batch"
                raise ScheduleError(f"{_where(stage, i, a)}: {what} {a.micro_batch} out of range "
                                    f"0..{limit - 1} ({s.micro_batches} micro-batches x "
                                    f"{s.mini_batches} mini-batches)")
            if whole_stage and chunk:
                raise ScheduleError(f"{_where(stage, i, a)}: {kind.name} applies to the whole "
                                    "stage; drop the chunk suffix")
            if kind in COMM_KINDS:
                v = chunk * p + stage
                is_grad = kind is SEND_GRAD or kind is RECV_GRAD
                is_send = kind is SEND_ACT or kind is SEND_GRAD
                other_v = v - 1 if is_grad == is_send else v + 1
                if not 0 <= other_v < virtual:
                    edge = "first" if other_v < 0 else "last"
                    raise ScheduleError(f"{_where(stage, i, a)}: the {edge} virtual stage has no "
                                        f"peer for {kind.name}; remove it")
                if is_send:
                    sends[(stage, other_v % p)].append((i, (is_grad, a.micro_batch, other_v)))
                else:
                    recvs[(other_v % p, stage)].append((i, (is_grad, a.micro_batch, v)))
    for pair in sorted(set(sends) | set(recvs)):
        src, dst = pair
        out, inc = sends.get(pair, []), recvs.get(pair, [])
        for j in range(max(len(out), len(inc))):
            if j >= len(inc):
                i, (is_grad, micro, v) = out[j]
                raise ScheduleError(f"{_where(src, i, s.actions[src][i])}: send has no matching "
                                    f"receive ({_message_text(is_grad, False, micro, v // p)} on "
                                    f"stage {dst})")
            if j >= len(out):
                i, (is_grad, micro, v) = inc[j]
                src_v = v + 1 if is_grad else v - 1
                raise ScheduleError(f"{_where(dst, i, s.actions[dst][i])}: receive has no matching "
                                    f"send ({_message_text(is_grad, True, micro, src_v // p)} on "
                                    f"stage {src})")
            if out[j][1] != inc[j][1]:
                si, ri = out[j][0], inc[j][0]
                raise ScheduleError(
                    f"{_where(dst, ri, s.actions[dst][ri])}: receives out of order: message {j} "
                    f"from stage {src} is '{s.actions[src][si]}' (action {si}); post receives "
                    "from one stage in the order it sends")


def _check_stage(s: Schedule, stage: int) -> None:
    actions = s.actions[stage]
    last = s.virtual_stages - 1
    split = any(a.kind is W for a in actions)
    seen: dict[ActionKind, dict[tuple[int, int], int]] = defaultdict(dict)
    stepped: set[int] = set()
    reduced: set[int] = set()
    uses_reduce = any(a.kind is REDUCE for a in actions)

    def fail(i: int, a: Action, why: str) -> None:
        raise ScheduleError(f"{_where(stage, i, a)}: {why}")

    for i, a in enumerate(actions):
        key = (a.micro_batch, a.chunk)
        kind, v = a.kind, a.chunk * s.stages + stage
        if key in seen[kind]:
            fail(i, a, f"duplicate of action {seen[kind][key]}")
        seen[kind][key] = i
        mini = a.micro_batch if kind in (STEP, REDUCE) else a.micro_batch // s.micro_batches
        if kind is F:
            if v > 0 and key not in seen[RECV_ACT]:
                fail(i, a, f"forward without a posted RECV_ACT{a.micro_batch} before it")
        elif kind is B or kind is W:
            if kind is B and key not in seen[F]:
                fail(i, a, "backward before its forward")
            if kind is W and key not in seen[B]:
                fail(i, a, "weight-gradient before its backward (B)")
            if kind is B and v < last and key not in seen[RECV_GRAD]:
                fail(i, a, f"backward without a posted RECV_GRAD{a.micro_batch} before it")
        elif kind is SEND_ACT and key not in seen[F]:
            fail(i, a, f"sends an activation before its forward F{a.micro_batch}")
        elif kind is SEND_GRAD and key not in seen[B]:
            fail(i, a, f"sends a gradient before its backward B{a.micro_batch}")
        elif kind is STEP or kind is REDUCE:
            missing = _missing(s, seen[W if split else B], mini)
            if missing:
                what = "optimizer step" if kind is STEP else "reduction"
                fail(i, a, f"{what} misses the gradient of {missing}")
            if kind is STEP and mini > 0 and mini - 1 not in stepped:
                fail(i, a, f"STEP{mini} before STEP{mini - 1}; steps go in mini-batch order")
            if kind is STEP and uses_reduce and mini not in reduced:
                fail(i, a, f"STEP{mini} before REDUCE{mini}; reduce gradients before the step")
            (stepped if kind is STEP else reduced).add(mini)
    for kind, follow in ((F, B), (B, W if split else None)):
        for key, i in seen[kind].items():
            if follow is not None and key not in seen[follow]:
                fail(i, actions[i], f"never gets its {'backward' if follow is B else 'weight-gradient'}"
                                    f" ({follow.value}{key[0]})")
    for mini in range(s.mini_batches):
        if mini not in stepped:
            raise ScheduleError(f"stage {stage}: no STEP{mini} (every stage steps once per "
                                f"mini-batch); append STEP{mini} after its last backward")


def _missing(s: Schedule, finished: dict[tuple[int, int], int], mini: int) -> str:
    """The first micro-batch (and chunk) of `mini` whose gradient is not finished yet, or ''."""
    for micro in range(mini * s.micro_batches, (mini + 1) * s.micro_batches):
        for chunk in range(s.chunks):
            if (micro, chunk) not in finished:
                where = f":{chunk}" if chunk else ""
                return f"micro-batch {micro}{where} (its backward has not run before this)"
    return ""


def raise_if_deadlocked(s: Schedule, timeline: Timeline) -> None:
    """Raise ScheduleError for the lowest stage that `timeline` left waiting forever."""
    if not timeline.blocked:
        return
    stage, i = timeline.blocked[0]
    a = s.actions[stage][i]
    is_grad, micro, v = timeline.waiting_for[stage]
    src_v = v + 1 if is_grad else v - 1
    src = src_v % s.stages
    send = _message_text(is_grad, True, micro, src_v // s.stages)
    # the message checks guarantee the sender's list holds this SEND, so the sender is stuck too
    src_pos = len(timeline.start[src])
    raise ScheduleError(f"{_where(stage, i, a)}: waits forever (deadlock) for {send} from stage "
                        f"{src}, which is itself waiting at action {src_pos} "
                        f"'{s.actions[src][src_pos]}'; reorder the actions so every wait can be met")

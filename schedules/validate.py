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
from itertools import islice
from operator import attrgetter

from schedules.actions import COMPUTE_KINDS, Action, ActionKind
from schedules.timeline import Timeline, execute
from schedules.gc_pause import gc_paused
from schedules.schedule import Schedule, ScheduleError

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
STEP, REDUCE, OVERLAP = ActionKind.STEP, ActionKind.REDUCE, ActionKind.OVERLAP
# communication kind -> (carries a gradient, is a send, virtual stage of the peer minus own)
_MESSAGE_ROLE = {SEND_ACT: (False, True, 1), RECV_ACT: (False, False, -1),
                 SEND_GRAD: (True, True, -1), RECV_GRAD: (True, False, 1)}


def _where(stage: int, index: int, action: Action) -> str:
    return f"stage {stage} action {index} '{action}'"


@gc_paused()
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
    chunks, virtual = s.chunks, s.virtual_stages
    micro_total, mini_batches = s.micro_batches * s.mini_batches, s.mini_batches
    # per ordered pair (sender, receiver): its messages in posting order, each as
    # (is_grad, micro_batch, receiving virtual stage), and their indices in the stage's list
    sent: dict[tuple[int, int], tuple[list, list[int]]] = defaultdict(lambda: ([], []))
    received: dict[tuple[int, int], tuple[list, list[int]]] = defaultdict(lambda: ([], []))
    for stage, actions in enumerate(s.actions):
        for i, a in enumerate(actions):
            if type(a) is not Action or not isinstance(a.kind, ActionKind):
                raise ScheduleError(f"stage {stage} action {i} {a!r}: not an Action; build actions "
                                    "with schedules.Action or Action.parse")
            kind, micro, chunk = a.kind, a.micro_batch, a.chunk
            if a.position != stage:
                raise ScheduleError(f"{_where(stage, i, a)}: belongs to stage {a.position} but sits in "
                                    f"stage {stage}'s list")
            if not 0 <= chunk < chunks:
                raise ScheduleError(f"{_where(stage, i, a)}: chunk {chunk} out of range, the "
                                    f"schedule has {chunks} chunk(s) per stage")
            whole_stage = kind is STEP or kind is REDUCE
            limit = mini_batches if whole_stage else micro_total
            if not 0 <= micro < limit:
                what = "mini-batch" if whole_stage else "micro-batch"
                raise ScheduleError(f"{_where(stage, i, a)}: {what} {micro} out of range "
                                    f"0..{limit - 1} ({s.micro_batches} micro-batches x "
                                    f"{mini_batches} mini-batches)")
            if whole_stage and chunk:
                raise ScheduleError(f"{_where(stage, i, a)}: {kind.name} applies to the whole "
                                    "stage; drop the chunk suffix")
            role = _MESSAGE_ROLE.get(kind)
            if role is not None:
                is_grad, is_send, step = role
                v = s.virtual_stage(stage, chunk)
                other_v = v + step
                if not 0 <= other_v < virtual:
                    edge = "first" if other_v < 0 else "last"
                    raise ScheduleError(f"{_where(stage, i, a)}: the {edge} virtual stage has no "
                                        f"peer for {kind.name}; remove it")
                peer = s.location(other_v)[0]
                if peer == stage:
                    raise ScheduleError(f"{_where(stage, i, a)}: virtual stages {v} and {other_v} are both "
                                        f"on stage {stage} and hand over in memory; remove it")
                if is_send:
                    messages, at = sent[(stage, peer)]
                    messages.append((is_grad, micro, other_v))
                else:
                    messages, at = received[(peer, stage)]
                    messages.append((is_grad, micro, v))
                at.append(i)
    no_messages: tuple[list, list[int]] = ([], [])
    for pair in sorted(set(sent) | set(received)):
        (out, out_at), (inc, inc_at) = sent.get(pair, no_messages), received.get(pair, no_messages)
        if out != inc:
            _raise_message_mismatch(s, pair, out, out_at, inc, inc_at)


def _raise_message_mismatch(s: Schedule, pair: tuple[int, int], out: list, out_at: list[int],
                            inc: list, inc_at: list[int]) -> None:
    """Name the first message of `pair` whose send and receive do not match one to one."""
    src, dst = pair
    j = next((j for j, (sent, received) in enumerate(zip(out, inc)) if sent != received),
             min(len(out), len(inc)))
    if j >= len(inc):
        i, (is_grad, micro, v) = out_at[j], out[j]
        raise ScheduleError(f"{_where(src, i, s.actions[src][i])}: send has no matching "
                            f"receive ({_message_text(is_grad, False, micro, s.location(v)[1])} on "
                            f"stage {dst})")
    if j >= len(out):
        i, (is_grad, micro, v) = inc_at[j], inc[j]
        src_v = v + 1 if is_grad else v - 1
        raise ScheduleError(f"{_where(dst, i, s.actions[dst][i])}: receive has no matching "
                            f"send ({_message_text(is_grad, True, micro, s.location(src_v)[1])} on "
                            f"stage {src})")
    si, ri = out_at[j], inc_at[j]
    raise ScheduleError(
        f"{_where(dst, ri, s.actions[dst][ri])}: receives out of order: message {j} "
        f"from stage {src} is '{s.actions[src][si]}' (action {si}); post receives "
        "from one stage in the order it sends")


def _check_stage(s: Schedule, stage: int) -> None:
    actions = s.actions[stage]
    # per chunk: the chunk of the same stage it hands over to in memory upstream / downstream
    # (V placement's virtual stages stages-1 -> stages), else None: a message or the pipeline's end
    upstream_here = {c: _local_chunk(s, stage, c, -1) for c in range(s.chunks)}
    downstream_here = {c: _local_chunk(s, stage, c, +1) for c in range(s.chunks)}
    first_here = {c: s.virtual_stage(stage, c) == 0 for c in range(s.chunks)}
    last_here = {c: s.virtual_stage(stage, c) == s.virtual_stages - 1 for c in range(s.chunks)}
    kinds = set(map(attrgetter("kind"), actions))
    split, uses_reduce = W in kinds, REDUCE in kinds
    # kind -> {(micro_batch, chunk): index of that action}
    seen: dict[ActionKind, dict[tuple[int, int], int]] = {kind: {} for kind in ActionKind}
    forwards, backwards = seen[F], seen[B]
    received_act, received_grad = seen[RECV_ACT], seen[RECV_GRAD]
    stepped: set[int] = set()
    reduced: set[int] = set()

    def fail(i: int, a: Action, why: str) -> None:
        raise ScheduleError(f"{_where(stage, i, a)}: {why}")

    for i, a in enumerate(actions):
        kind, micro, chunk = a.kind, a.micro_batch, a.chunk
        key = (micro, chunk)
        done = seen[kind]
        if key in done:
            fail(i, a, f"duplicate of action {done[key]}")
        done[key] = i
        if kind is F:
            before = upstream_here.get(chunk)
            if before is not None:
                if (micro, before) not in forwards:
                    fail(i, a, f"forward before the forward F{micro}:{before} it takes its input from")
            elif key not in received_act and not first_here.get(chunk, True):
                fail(i, a, f"forward without a posted RECV_ACT{micro} before it")
        elif kind is B:
            if key not in forwards:
                fail(i, a, "backward before its forward")
            after = downstream_here.get(chunk)
            if after is not None:
                if (micro, after) not in backwards:
                    fail(i, a, f"backward before the backward B{micro}" + (f":{after}" if after else "")
                         + " it takes its gradient from")
            elif key not in received_grad and not last_here.get(chunk, True):
                fail(i, a, f"backward without a posted RECV_GRAD{micro} before it")
        elif kind is W:
            if key not in backwards:
                fail(i, a, "weight-gradient before its backward (B)")
        elif kind is OVERLAP:
            _check_overlap(actions, i, a, fail)
        elif kind is SEND_ACT:
            if key not in forwards:
                fail(i, a, f"sends an activation before its forward F{micro}")
        elif kind is SEND_GRAD:
            if key not in backwards:
                fail(i, a, f"sends a gradient before its backward B{micro}")
        elif kind is STEP or kind is REDUCE:
            mini = micro  # STEP and REDUCE carry the mini-batch index
            missing = _missing(s, seen[W] if split else backwards, mini)
            if missing:
                what = "optimizer step" if kind is STEP else "reduction"
                fail(i, a, f"{what} misses the gradient of {missing}")
            if kind is STEP and mini > 0 and mini - 1 not in stepped:
                fail(i, a, f"STEP{mini} before STEP{mini - 1}; steps go in mini-batch order")
            if kind is STEP and uses_reduce and mini not in reduced:
                fail(i, a, f"STEP{mini} before REDUCE{mini}; reduce gradients before the step")
            (stepped if kind is STEP else reduced).add(mini)
    for earlier, later in ((F, B), (B, W)) if split else ((F, B),):
        never = seen[earlier].keys() - seen[later].keys()
        if never:
            i = min(seen[earlier][key] for key in never)
            fail(i, actions[i], f"never gets its {'backward' if later is B else 'weight-gradient'}"
                                f" ({later.value}{actions[i].micro_batch})")
    for mini in range(s.mini_batches):
        if mini not in stepped:
            raise ScheduleError(f"stage {stage}: no STEP{mini} (every stage steps once per "
                                f"mini-batch); append STEP{mini} after its last backward")


def _check_overlap(actions: list[Action], i: int, marker: Action, fail) -> None:
    """An OVERLAP marker names the F that follows it and pairs it with the next B of another micro-batch."""
    pair = list(islice((a for a in islice(actions, i + 1, None) if a.kind in COMPUTE_KINDS), 2))
    if not pair or (pair[0].kind, pair[0].micro_batch, pair[0].chunk) != (F, marker.micro_batch, marker.chunk):
        fail(i, marker, f"an OVERLAP marker must come right before the forward it names "
                        f"(F{marker.micro_batch}" + (f":{marker.chunk}" if marker.chunk else "") + ")")
    if len(pair) < 2 or pair[1].kind is not B or pair[1].micro_batch == marker.micro_batch:
        fail(i, marker, "an OVERLAP marker pairs its forward with the next computation, which must be "
                        "the backward (B) of another micro-batch")


def _local_chunk(s: Schedule, stage: int, chunk: int, step: int) -> int | None:
    """The chunk of `stage` holding virtual stage v+step (v: `chunk`'s), or None if on another stage or none."""
    other = s.virtual_stage(stage, chunk) + step
    if not 0 <= other < s.virtual_stages:
        return None
    position, other_chunk = s.location(other)
    return other_chunk if position == stage else None


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
    src, src_chunk = s.location(src_v)
    send = _message_text(is_grad, True, micro, src_chunk)
    # the message checks guarantee the sender's list holds this SEND, so the sender is stuck too
    src_pos = len(timeline.start[src])
    raise ScheduleError(f"{_where(stage, i, a)}: waits forever (deadlock) for {send} from stage "
                        f"{src}, which is itself waiting at action {src_pos} "
                        f"'{s.actions[src][src_pos]}'; reorder the actions so every wait can be met")

"""Hand-written invalid schedules are each rejected with a message naming the offending action."""
import pytest

from schedules import Action, ActionKind, Schedule, ScheduleError, validate


def sched(*lines, micro_batches=2, chunks=1, mini_batches=1):
    header = (f"# schedule kind=custom stages={len(lines)} micro_batches={micro_batches} "
              f"chunks={chunks} mini_batches={mini_batches}")
    return Schedule.from_text("\n".join([header] + [f"{k}: {line}" for k, line in enumerate(lines)]))


GOOD_0 = "F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 STEP0"
GOOD_1 = "RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 STEP0"


def test_hand_written_good_schedule_passes():
    validate(sched(GOOD_0, GOOD_1))


@pytest.mark.parametrize("lines,message", [
    # backward precedes its forward
    (("B0 F0 STEP0",), "stage 0 action 0 'B0': backward before its forward"),
    # a send with no matching receive
    (("F0 SEND_ACT0 RECV_GRAD0 B0 STEP0", "F0 B0 SEND_GRAD0 STEP0"),
     "stage 0 action 1 'SEND_ACT0': send has no matching receive \\(RECV_ACT0 on stage 1\\)"),
    # a receive with no matching send
    (("F0 RECV_GRAD0 B0 STEP0", "RECV_ACT0 F0 B0 SEND_GRAD0 STEP0"),
     "stage 1 action 0 'RECV_ACT0': receive has no matching send \\(SEND_ACT0 on stage 0\\)"),
    # receives posted in another order than the sends (FIFO between a pair)
    ((GOOD_0, "RECV_ACT1 RECV_ACT0 F0 B0 SEND_GRAD0 F1 B1 SEND_GRAD1 STEP0"),
     "stage 1 action 0 'RECV_ACT1': receives out of order: message 0 from stage 0 is 'SEND_ACT0'"),
    # deadlock: stage 1 wants micro-batch 1 before sending gradient 0, stage 0 the reverse
    (("F0 SEND_ACT0 RECV_GRAD0 B0 F1 SEND_ACT1 RECV_GRAD1 B1 STEP0",
      "RECV_ACT0 F0 RECV_ACT1 F1 B0 SEND_GRAD0 B1 SEND_GRAD1 STEP0"),
     "stage 0 action 3 'B0': waits forever \\(deadlock\\) for SEND_GRAD0 from stage 1, "
     "which is itself waiting at action 3 'F1'"),
    # optimizer step misses a gradient
    (("F0 F1 B0 STEP0 B1",),
     "stage 0 action 3 'STEP0': optimizer step misses the gradient of micro-batch 1"),
    # a forward consumes an activation it never posted a receive for
    ((GOOD_0, "F0 RECV_ACT0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 STEP0"),
     "stage 1 action 0 'F0': forward without a posted RECV_ACT0"),
    # weight gradient before its input gradient
    (("F0 F1 W0 B0 B1 W1 STEP0",), "stage 0 action 2 'W0': weight-gradient before its backward"),
    # split backward never finished
    (("F0 F1 B0 W0 B1 STEP0",), "stage 0 action 5 'STEP0': optimizer step misses the gradient of micro-batch 1"),
    # a stage without its step
    (("F0 F1 B0 B1",), "stage 0: no STEP0"),
    # a forward without backward (and so without its gradient)
    (("F0 F1 B0",), "stage 0 action 1 'F1': never gets its backward"),
    # duplicates
    (("F0 F0 F1 B0 B1 STEP0",), "stage 0 action 1 'F0': duplicate of action 0"),
    # out of range and misplaced actions
    (("F0 F1 F2 B0 B1 B2 STEP0",), "stage 0 action 2 'F2': micro-batch 2 out of range 0..1"),
    (("F0 F1 B0 B1 STEP0 STEP1",), "stage 0 action 5 'STEP1': mini-batch 1 out of range 0..0"),
    (("F0:1 F1 B0 B1 STEP0",), "stage 0 action 0 'F0:1': chunk 1 out of range"),
    (("F0 F1 B0 B1 STEP0 SEND_GRAD0",), "stage 0 action 5 'SEND_GRAD0': the first virtual stage has no peer"),
    # reductions
    (("F0 F1 B0 B1 STEP0 REDUCE0",), "stage 0 action 4 'STEP0': STEP0 before REDUCE0"),
    (("F0 F1 B0 REDUCE0 B1 STEP0",), "stage 0 action 3 'REDUCE0': reduction misses the gradient of micro-batch 1"),
])
def test_invalid_schedule_rejected_with_message(lines, message):
    with pytest.raises(ScheduleError, match=message):
        validate(sched(*lines))


def test_gradient_after_step_is_rejected():
    s = sched("F0 F1 B0 B1 STEP0 F2 B2 F3 STEP1 B3", mini_batches=2)
    with pytest.raises(ScheduleError, match="'STEP1': optimizer step misses the gradient of micro-batch 3"):
        validate(s)


def test_steps_must_go_in_order():
    s = sched("F0 F1 B0 B1 F2 F3 B2 B3 STEP1 STEP0", mini_batches=2)
    with pytest.raises(ScheduleError, match="'STEP1': STEP1 before STEP0"):
        validate(s)


def test_action_in_wrong_stage_list():
    s = sched("F0 F1 B0 B1 STEP0")
    s.actions[0][1] = Action(3, ActionKind.FORWARD, 1)
    with pytest.raises(ScheduleError, match="stage 0 action 1 'F1': belongs to stage 3"):
        validate(s)


def test_non_action_entry():
    s = sched("F0 F1 B0 B1 STEP0")
    s.actions[0][0] = "F0"
    with pytest.raises(ScheduleError, match="not an Action"):
        validate(s)


def test_interleaved_hand_written_wrap_around_is_checked():
    # 2 devices x 2 chunks, one micro-batch: device 1 chunk 0 feeds device 0 chunk 1
    ok = sched("F0 SEND_ACT0 RECV_ACT0:1 F0:1 SEND_ACT0:1 RECV_GRAD0:1 B0:1 SEND_GRAD0:1 RECV_GRAD0 B0 STEP0",
               "RECV_ACT0 F0 SEND_ACT0 RECV_ACT0:1 F0:1 B0:1 SEND_GRAD0:1 RECV_GRAD0 B0 SEND_GRAD0 STEP0",
               micro_batches=1, chunks=2)
    validate(ok)
    swapped = ok.to_text().replace("RECV_GRAD0:1 B0:1 SEND_GRAD0:1 RECV_GRAD0 B0",
                                   "RECV_GRAD0 B0 RECV_GRAD0:1 B0:1 SEND_GRAD0:1")
    with pytest.raises(ScheduleError, match="stage 0 action 6 'B0': backward without a posted|"
                                            "stage 0 action 5 'RECV_GRAD0': receives out of order"):
        validate(Schedule.from_text(swapped))

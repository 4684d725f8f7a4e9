"""Actions and schedules print, parse and round-trip through text and CSV."""
import dataclasses

import pytest

from schedules import Action, ActionKind, Schedule, build

KIND_OPTIONS = [("gpipe", {}), ("1f1b", {}), ("interleaved-1f1b", {"chunks": 3}),
                ("async-1f1b", {"mini_batches": 3}), ("zb-h1", {})]


@pytest.mark.parametrize("text,kind,micro,chunk", [
    ("F3", ActionKind.FORWARD, 3, 0), ("B3", ActionKind.BACKWARD, 3, 0),
    ("W12", ActionKind.WEIGHT, 12, 0), ("SEND_ACT3", ActionKind.SEND_ACT, 3, 0),
    ("RECV_ACT0:2", ActionKind.RECV_ACT, 0, 2), ("SEND_GRAD7:1", ActionKind.SEND_GRAD, 7, 1),
    ("RECV_GRAD3", ActionKind.RECV_GRAD, 3, 0), ("STEP0", ActionKind.STEP, 0, 0),
    ("REDUCE4", ActionKind.REDUCE, 4, 0), ("B3:1", ActionKind.BACKWARD, 3, 1),
])
def test_parse_and_print(text, kind, micro, chunk):
    action = Action.parse(text, position=2)
    assert action == Action(2, kind, micro, chunk)
    assert str(action) == text


def test_chunk_zero_prints_without_suffix():
    assert str(Action(0, ActionKind.FORWARD, 5, 0)) == "F5"
    assert Action.parse("F5:0", 0) == Action(0, ActionKind.FORWARD, 5)


def test_actions_are_immutable_and_hashable():
    a = Action(1, ActionKind.FORWARD, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.micro_batch = 3
    assert len({a, Action(1, ActionKind.FORWARD, 2)}) == 1


@pytest.mark.parametrize("bad", ["X3", "F", "3F", "SEND3", "F-1", "F3:", "f3"])
def test_parse_rejects_malformed_text(bad):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(bad, 0)


def test_text_of_small_1f1b_matches_hand_written():
    expected = (
        "# schedule kind=1f1b stages=2 micro_batches=2 chunks=1 mini_batches=1\n"
        "0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 STEP0\n"
        "1: RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 STEP0\n"
    )
    assert build("1f1b", 2, 2).to_text() == expected


@pytest.mark.parametrize("kind,options", KIND_OPTIONS)
def test_text_and_csv_round_trip(kind, options):
    schedule = build(kind, 3, 6, **options)
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_csv(schedule.to_csv()) == schedule


def test_csv_rows_are_one_per_action():
    schedule = build("gpipe", 2, 3)
    rows = schedule.to_csv().strip().splitlines()
    assert rows[1] == "stage,index,kind,micro_batch,chunk"
    assert len(rows) - 2 == sum(len(a) for a in schedule.actions)
    assert rows[2] == "0,0,F,0,0"


def test_from_text_needs_header():
    with pytest.raises(ValueError, match="header"):
        Schedule.from_text("0: F0 B0 STEP0\n")


def test_from_text_rejects_stages_out_of_order():
    text = "# schedule kind=custom stages=2 micro_batches=1\n1: F0\n0: F0\n"
    with pytest.raises(ValueError, match="expected '0: <actions>'"):
        Schedule.from_text(text)


def test_schedule_needs_one_list_per_stage():
    with pytest.raises(ValueError, match="one list per stage"):
        Schedule("custom", 2, 1, [[]])

"""The zero-bubble schedules with several chunks per device: zbv, dualpipev (V placement) and
interleaved-zb (loop placement), and the chunk placement they rest on."""
import dataclasses
from collections import Counter

import pytest

import pipetrain
from pipetrain.cli import main
from schedules import Action, ActionKind, Costs, Schedule, ScheduleError, build, simulate, validate
from schedules.nccl_order import posted_groups, replay
from schedules.placement import location_of, virtual_stage_of

NEW = ("zbv", "dualpipev", "interleaved-zb")
F, B, W, OVERLAP = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT, ActionKind.OVERLAP
UNIT = Costs(1.0, 1.0, 1.0, 0.0)
SHAPES = [(2, 1), (2, 3), (2, 4), (2, 8), (4, 1), (4, 2), (4, 3), (4, 8), (4, 16)]


@pytest.mark.parametrize("stages", [2, 3, 4, 5])
def test_v_placement_holds_the_first_and_last_chunk_on_device_0_and_round_trips(stages):
    seen = set()
    for d in range(stages):
        assert [virtual_stage_of(d, c, stages, "v") for c in (0, 1)] == [d, 2 * stages - 1 - d]
        for c in (0, 1):
            v = virtual_stage_of(d, c, stages, "v")
            assert location_of(v, stages, "v") == (d, c)
            seen.add(v)
            assert location_of(virtual_stage_of(d, c, stages), stages) == (d, c)  # loop, the default
    assert seen == set(range(2 * stages))


def test_a_v_schedule_needs_two_chunks_and_a_known_placement():
    with pytest.raises(ValueError, match="exactly 2 chunks"):
        Schedule("x", 2, 1, [[], []], chunks=3, placement="v")
    with pytest.raises(ValueError, match="unknown placement 'w'"):
        Schedule("x", 2, 1, [[], []], chunks=2, placement="w")


@pytest.mark.parametrize("kind", NEW)
@pytest.mark.parametrize("stages, micro_batches", SHAPES)
def test_new_schedules_are_sound(kind, stages, micro_batches):
    s = build(kind, stages, micro_batches)
    validate(s)
    assert s.placement == ("loop" if kind == "interleaved-zb" else "v") and s.chunks == 2
    # every (micro-batch, virtual stage) has exactly one F, one B and one W
    counts = Counter((a.kind, a.micro_batch, s.virtual_stage(d, a.chunk))
                     for d, actions in enumerate(s.actions) for a in actions if a.kind in (F, B, W))
    assert counts == Counter({(k, m, v): 1 for k in (F, B, W) for m in range(micro_batches)
                              for v in range(s.virtual_stages)})
    assert Schedule.from_text(s.to_text()) == s
    assert Schedule.from_csv(s.to_csv()) == s
    for receive_ahead in (True, False):
        assert replay(posted_groups(s, receive_ahead=receive_ahead)) is None
    # independent of validate: in the simulated run each unit starts after what it consumes ended
    r = simulate(s, Costs(1.0, 2.0, 1.0, 0.5))
    when = {}
    for d, actions in enumerate(s.actions):
        for a, t0, t1 in zip(actions, r.start[d], r.end[d]):
            if a.kind in (F, B, W):
                when[(a.kind, a.micro_batch, s.virtual_stage(d, a.chunk))] = (t0, t1)
    last = s.virtual_stages - 1
    for (kind_, m, v), (t0, _) in when.items():
        before = {F: [(F, m, v - 1)] if v else [], B: [(F, m, v)] + ([(B, m, v + 1)] if v < last else []),
                  W: [(B, m, v)]}[kind_]
        assert all(when[k][1] <= t0 for k in before), (kind_, m, v)


@pytest.mark.parametrize("kind", NEW)
@pytest.mark.parametrize("stages", [2, 4])
def test_bubble_below_zb_h1_at_equal_costs(kind, stages):
    for micro_batches in (2 * stages, 4 * stages):
        ours = simulate(build(kind, stages, micro_batches), UNIT).bubble_fraction
        zb_h1 = simulate(build("zb-h1", stages, micro_batches), UNIT).bubble_fraction
        assert ours < zb_h1, (micro_batches, ours, zb_h1)


def test_zbv_bubble_by_hand():
    # 2 devices, 1 micro-batch, F = B = W = 1 per device, so 0.5 per chunk. The micro-batch runs
    # down the V (F on v0 d0, v1 d1, v2 d1, v3 d0) and back (B on v3 d0, v2 d1, v1 d1, v0 d0): a chain
    # of 8 half-units, 4.0. Device 0 runs W of v3 while device 1 runs B of v2, so only its W of v0
    # (after B v0 ends at 4.0) is left; device 1 runs its W's of v2 and v1 from 3.5: makespan 4.5.
    # Each device computes 6 x 0.5 = 3, so the bubble is 1 - 6 / (2 x 4.5) = 1/3 (zb-h1: 0.4).
    r = simulate(build("zbv", 2, 1), UNIT)
    assert r.makespan == 4.5
    assert r.bubble_fraction == pytest.approx(1 / 3)


@pytest.mark.parametrize("kind", NEW)
def test_one_stage_is_refused(kind):
    with pytest.raises(ValueError, match="stages >= 2"):
        build(kind, 1, 4)


def test_interleaved_zb_takes_chunks():
    s = build("interleaved-zb", 2, 4, chunks=3)
    validate(s)
    assert s.chunks == 3 and s.virtual_stages == 6
    with pytest.raises(ValueError, match="chunks must be an int >= 2"):
        build("interleaved-zb", 2, 4, chunks=1)


def test_v_text_carries_the_placement_and_old_headers_mean_loop():
    s = build("zbv", 2, 2)
    assert s.to_text().splitlines()[0].endswith("placement=v")
    assert s.to_csv().splitlines()[0].endswith("placement=v")
    old = Schedule.from_text("# schedule kind=1f1b stages=1 micro_batches=1\n0: F0 B0 STEP0\n")
    assert old.placement == "loop"
    assert "placement" not in build("interleaved-1f1b", 2, 2).to_text()


def test_the_turn_of_the_v_is_handed_over_in_memory():
    s = build("zbv", 2, 2)
    last = s.actions[1]  # device 1 holds virtual stages 1 and 2
    turn = {("SEND_ACT", 0), ("RECV_ACT", 1), ("SEND_GRAD", 1), ("RECV_GRAD", 0)}  # messages v1 <-> v2
    assert not [a for a in last if (a.kind.name, a.chunk) in turn]
    assert {(a.kind.name, a.chunk) for a in last} >= {("RECV_ACT", 0), ("SEND_ACT", 1)}
    # a SEND across the turn is refused ...
    bad = dataclasses.replace(s, actions=[s.actions[0], [Action(1, ActionKind.SEND_ACT, 0)] + last])
    with pytest.raises(ScheduleError, match="hand over in memory"):
        validate(bad)
    # ... and so is running chunk 1 before the chunk 0 it takes its input from
    swapped = list(last)
    i, j = swapped.index(Action(1, F, 0, 0)), swapped.index(Action(1, F, 0, 1))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="forward before the forward F0:0"):
        validate(dataclasses.replace(s, actions=[s.actions[0], swapped]))


def test_dualpipev_marks_its_overlapped_pairs():
    s = build("dualpipev", 4, 8)
    marked = 0
    for actions in s.actions:
        compute = [a for a in actions if a.kind in (F, B, W, OVERLAP)]
        for k, a in enumerate(compute):
            if a.kind is OVERLAP:
                marked += 1
                f, b = compute[k + 1], compute[k + 2]
                assert (f.kind, f.micro_batch, f.chunk) == (F, a.micro_batch, a.chunk)
                assert b.kind is B and b.micro_batch != a.micro_batch
    assert marked >= s.stages
    assert "OVERLAP" in s.to_text() and Schedule.from_text(s.to_text()) == s
    # the marker is data only: without it the simulation is the same
    bare = dataclasses.replace(s, actions=[[a for a in actions if a.kind is not OVERLAP] for actions in s.actions])
    assert simulate(s, Costs(1.0, 2.0, 1.0, 0.3)).makespan == simulate(bare, Costs(1.0, 2.0, 1.0, 0.3)).makespan
    # a marker that does not sit before an F paired with another micro-batch's B is refused
    misplaced = [Action(0, OVERLAP, 0)] + s.actions[0]
    with pytest.raises(ScheduleError, match="OVERLAP marker"):
        validate(dataclasses.replace(s, actions=[misplaced] + s.actions[1:]))


def test_v_schedules_hold_at_most_what_1f1b_holds_on_its_first_stage():
    # peak in-flight counts chunk units; a V device's two chunks make its whole share of the model
    for kind in ("zbv", "dualpipev"):
        for stages, micro_batches in ((2, 8), (4, 8), (4, 16)):
            assert max(simulate(build(kind, stages, micro_batches), UNIT).peak_in_flight) <= 2 * stages


@pytest.mark.parametrize("kind", NEW)
def test_cli_simulate_prints_a_bubble_below_zb_h1(kind, capsys):
    def bubble(schedule):
        assert main(["simulate", "--schedule", schedule, "--stages", "4", "--micro-batches", "8"]) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if "bubble" in l)
        return float(line.split("bubble")[1].strip().rstrip("%"))
    assert bubble(kind) < bubble("zb-h1")


@pytest.mark.parametrize("kind", NEW)
def test_the_pipeline_runtime_takes_them_with_two_chunks_per_device(kind):
    # they run (tests/test_runtime_zero_bubble_v.py), each backward split in B and W
    options = pipetrain.PipelineOptions(schedule=kind, stages=3)
    assert options.splits_backward and options.virtual_stages == 6

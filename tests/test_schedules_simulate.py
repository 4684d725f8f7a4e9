"""Simulated timings against hand-computed references."""
import json
import types

import pytest

from schedules import ActionKind, Costs, Schedule, ScheduleError, build, simulate, write_chrome_trace, write_png

GRID = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 4, 7, 8, 32)]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("fwd,bwd", [(1, 1), (1, 2)])
def test_bubble_fraction_formula_for_gpipe_and_1f1b(kind, fwd, bwd):
    for p, m in GRID:
        result = simulate(build(kind, p, m), Costs(fwd, bwd))
        assert result.makespan == pytest.approx((m + p - 1) * (fwd + bwd))
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert result.utilisation == pytest.approx([m / (m + p - 1)] * p)


@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_interleaved_divides_the_bubble_by_the_virtual_stages(chunks):
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 4 * p):
            work = m * 2  # per device, forward = backward = 1
            plain = simulate(build("1f1b", p, m), Costs(1, 1)).makespan - work
            inter = simulate(build("interleaved-1f1b", p, m, chunks=chunks), Costs(1, 1))
            assert (inter.makespan - work) * chunks == pytest.approx(plain)
            assert inter.bubble_fraction == pytest.approx((p - 1) / (chunks * m + p - 1))


def test_async_has_no_bubble_in_steady_state():
    for p, m in ((4, 1), (4, 3), (8, 2)):
        spans = [simulate(build("async-1f1b", p, m, mini_batches=n), Costs(1, 2)).makespan
                 for n in (6, 7)]
        assert spans[1] - spans[0] == pytest.approx(m * 3)  # one more mini-batch costs only its work
        result = simulate(build("async-1f1b", p, m, mini_batches=6), Costs(1, 2))
        for k, actions in enumerate(result.schedule.actions):
            compute = [(a, s, e) for a, s, e in zip(actions, result.start[k], result.end[k])
                       if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
            first_b = next(i for i, (a, _, _) in enumerate(compute) if a.kind is ActionKind.BACKWARD)
            last_f = max(i for i, (a, _, _) in enumerate(compute) if a.kind is ActionKind.FORWARD)
            for (_, _, end), (_, start, _) in zip(compute[first_b:last_f], compute[first_b + 1:last_f + 1]):
                assert start == end, f"stage {k} idles in steady state"


def test_async_version_lag_is_p_minus_k_minus_1():
    p, n = 5, 12
    result = simulate(build("async-1f1b", p, 1, mini_batches=n), Costs(1, 1))
    for k in range(p):
        lags = dict(result.version_lag[k])
        assert sorted(lags) == list(range(n))
        # warm-up micro-batch j has seen only j steps; afterwards the lag is p-k-1
        assert [lags[j] for j in range(n)] == [min(j, p - k - 1) for j in range(n)]


def test_async_version_lag_with_gradient_accumulation():
    p, m, n = 4, 3, 5
    result = simulate(build("async-1f1b", p, m, mini_batches=n), Costs(1, 1))
    for k in range(p):
        w = p - k - 1
        for j, lag in result.version_lag[k]:
            # steps between F(j) and B(j): mini-batches whose last micro-batch is among B(j-w)..B(j-1)
            expected = sum(1 for t in range(n) if max(0, j - w) <= (t + 1) * m - 1 <= j - 1)
            assert lag == expected, (k, j)


def test_sync_schedules_have_no_version_lag():
    for kind in ("gpipe", "1f1b", "zb-h1"):
        result = simulate(build(kind, 3, 5), Costs(1, 1, 1))
        assert all(lag == 0 for lags in result.version_lag for _, lag in lags)


def test_zero_bubble_beats_1f1b():
    for p, m in GRID:
        zb = simulate(build("zb-h1", p, m), Costs(1, 1, 1))
        plain = simulate(build("1f1b", p, m), Costs(1, 1, 1))
        if p == 1:
            assert zb.makespan == plain.makespan == 3 * m
        else:
            assert zb.makespan < plain.makespan
        if m >= p:  # ZB-H1's bubble is (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W)
            assert zb.makespan == pytest.approx(3 * m + p - 1)


def test_hand_timed_communication():
    # p=2, m=1, F=1, B=2, 0.5 per message: F0 [0,1] -> 1.5 F0 [1.5,2.5] B0 [2.5,4.5] -> 5 B0 [5,7]
    result = simulate(build("1f1b", 2, 1), Costs(1, 2, comm=0.5))
    assert result.makespan == pytest.approx(7)
    assert result.bubble_fraction == pytest.approx(1 - 6 / 14)


def test_hand_timed_per_stage_costs():
    # gpipe p=2 m=2, stage 1 twice as slow: stage 1 F0 [1,3] F1 [3,5] B0 [5,7] B1 [7,9]; stage 0 B1 [9,10]
    result = simulate(build("gpipe", 2, 2), Costs([1, 2], [1, 2]))
    assert result.makespan == pytest.approx(10)
    assert result.utilisation == pytest.approx([0.4, 0.8])
    assert result.bubble_fraction == pytest.approx(0.4)


def test_costs_from_plan_like_object():
    plan = types.SimpleNamespace(stage_times=[3.0, 6.0])
    costs = Costs.from_plan(plan)
    assert costs.forward == pytest.approx([1.0, 2.0]) and costs.backward == pytest.approx([2.0, 4.0])
    with pytest.raises(TypeError, match="no stage_times"):
        Costs.from_plan(object())


def test_bad_costs_are_explained():
    with pytest.raises(ValueError, match="Costs.forward has 2 entries for 3 stages"):
        simulate(build("1f1b", 3, 3), Costs([1, 1], 1))
    with pytest.raises(ValueError, match="this schedule needs 4 \\(the last for the edge 3 -> 0\\)"):
        simulate(build("interleaved-1f1b", 4, 4), Costs(1, 1, comm=[1, 1, 1]))
    with pytest.raises(ValueError, match="non-negative"):
        simulate(build("1f1b", 2, 2), Costs(-1, 1))


def test_wrap_around_edge_cost_is_used():
    free = simulate(build("interleaved-1f1b", 3, 3), Costs(1, 1, comm=[0, 0, 0])).makespan
    slow = simulate(build("interleaved-1f1b", 3, 3), Costs(1, 1, comm=[0, 0, 5])).makespan
    assert slow > free


def test_simulate_rejects_deadlocked_schedule():
    s = Schedule.from_text(
        "# schedule kind=custom stages=2 micro_batches=2\n"
        "0: F0 SEND_ACT0 RECV_GRAD0 B0 F1 SEND_ACT1 RECV_GRAD1 B1 STEP0\n"
        "1: RECV_ACT0 F0 RECV_ACT1 F1 B0 SEND_GRAD0 B1 SEND_GRAD1 STEP0\n")
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s, Costs(1, 1))


def test_summary_lists_every_stage():
    text = simulate(build("1f1b", 4, 8), Costs(1, 1)).summary()
    assert "makespan 22" in text and "bubble 27.27%" in text
    assert len(text.splitlines()) == 4 + 4


def test_chrome_trace(tmp_path):
    result = simulate(build("interleaved-1f1b", 2, 2), Costs(1, 2))
    path = tmp_path / "trace.json"
    write_chrome_trace(result, str(path))
    events = json.loads(path.read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    actions = [(a, s, e) for k, acts in enumerate(result.schedule.actions)
               for a, s, e in zip(acts, result.start[k], result.end[k])
               if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
    assert len(slices) == len(actions)
    assert {(e["name"], e["tid"], e["ts"], e["dur"]) for e in slices} == {
        (str(a), a.position, s * 1e6, (e - s) * 1e6) for a, s, e in actions}
    sends = sum(a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
                for acts in result.schedule.actions for a in acts)
    assert sum(e["ph"] == "s" for e in events) == sum(e["ph"] == "f" for e in events) == sends
    assert sum(e["ph"] == "i" for e in events) == 2  # one STEP per device


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    write_png(simulate(build("zb-h1", 3, 4), Costs(1, 1, 1)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_edge_comm_list_of_stages_minus_one_for_a_chain():
    # A non-interleaved schedule has p-1 links; a list of that many costs must be accepted.
    sched = build("1f1b", 4, 4)
    free = simulate(sched, Costs(forward=1.0, backward=1.0))
    slow = simulate(sched, Costs(forward=1.0, backward=1.0, comm=[0.0, 0.5, 0.0]))
    assert slow.makespan > free.makespan

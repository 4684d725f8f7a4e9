"""Every builder gives valid schedules with the documented shape and memory."""
import pytest

from schedules import (Action, ActionKind, Costs, Schedule, ScheduleError, async_1f1b_actions,
                       build, simulate, validate)

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SYNC_KINDS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def defined(kind, p, m):
    return kind != "interleaved-1f1b" or (p >= 2 and m % p == 0)


@pytest.mark.parametrize("kind", SYNC_KINDS + ["async-1f1b"])
def test_every_builder_valid_for_stages_1_to_8_micro_batches_1_to_32(kind):
    options = {"mini_batches": 2} if kind == "async-1f1b" else {}
    checked = 0
    for p in range(1, 9):
        for m in range(1, 33):
            if not defined(kind, p, m):
                with pytest.raises(ValueError, match="interleaved-1f1b needs"):
                    build(kind, p, m)
                continue
            schedule = build(kind, p, m, **options)
            validate(schedule)
            for stage, actions in enumerate(schedule.actions):
                computed = [(a.micro_batch, a.chunk) for a in actions if a.kind is F]
                expected = [(i, c) for i in range(m * schedule.mini_batches)
                            for c in range(schedule.chunks)]
                assert sorted(computed) == expected, (kind, p, m, stage)
            checked += 1
    assert checked >= 8 * 32 // 8  # interleaved is defined on the multiples only


def test_interleaved_errors_name_the_fix():
    with pytest.raises(ValueError, match="divisible by stages.*multiple of 4"):
        build("interleaved-1f1b", 4, 6)
    with pytest.raises(ValueError, match="use '1f1b'"):
        build("interleaved-1f1b", 1, 4)
    with pytest.raises(ValueError, match="chunks must be an int >= 2"):
        build("interleaved-1f1b", 2, 4, chunks=1)


def test_build_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown schedule kind 'pipedream'.*gpipe"):
        build("pipedream", 2, 2)
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
        build("1f1b", 0, 2)
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
        build("1f1b", 2, 2.0)
    with pytest.raises(TypeError, match="does not take option.*chunks"):
        build("1f1b", 2, 2, chunks=2)


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_sync_schedules_end_with_one_step_and_no_reduce(kind):
    # REDUCE is with_reductions' business (tests/test_schedules_reductions.py)
    for actions in build(kind, 4, 8).actions:
        assert str(actions[-1]) == "STEP0"
        assert sum(a.kind in (ActionKind.STEP, ActionKind.REDUCE) for a in actions) == 1


@pytest.mark.parametrize("kind", SYNC_KINDS + ["async-1f1b"])
def test_send_directly_follows_its_producer(kind):
    schedule = build(kind, 4, 8)
    last = schedule.virtual_stages - 1
    for d, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            v = a.chunk * schedule.stages + d
            if a.kind is F and v < last:
                assert actions[i + 1] == Action(d, ActionKind.SEND_ACT, a.micro_batch, a.chunk)
            if a.kind is B and v > 0:
                assert actions[i + 1] == Action(d, ActionKind.SEND_GRAD, a.micro_batch, a.chunk)


def test_interleaved_wraps_from_last_device_to_next_chunk_of_first():
    schedule = build("interleaved-1f1b", 3, 3, chunks=2)
    sends = [str(a) for a in schedule.actions[2] if a.kind is ActionKind.SEND_ACT]
    recvs = [str(a) for a in schedule.actions[0] if a.kind is ActionKind.RECV_ACT]
    assert sends == ["SEND_ACT0", "SEND_ACT1", "SEND_ACT2"]
    assert recvs == ["RECV_ACT0:1", "RECV_ACT1:1", "RECV_ACT2:1"]


def test_receive_directly_precedes_its_consumer():
    schedule = build("interleaved-1f1b", 2, 4, chunks=2)
    for d, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                consumer = F if a.kind is ActionKind.RECV_ACT else B
                assert actions[i + 1] == Action(d, consumer, a.micro_batch, a.chunk)


def peak_reference(kind, p, m, k, chunks=2, mini_batches=1):
    """Peak in-flight units at stage k as each builder documents it."""
    if kind == "gpipe":
        return m
    if kind == "1f1b":
        return min(p - k, m)
    if kind == "zb-h1":  # counted until W, which runs up to k backwards late
        return min(p, m)
    if kind == "async-1f1b":
        return min(p - k, m * mini_batches)
    return min((p - k - 1) * 2 + (chunks - 1) * p + 1, m * chunks)


@pytest.mark.parametrize("kind", SYNC_KINDS + ["async-1f1b"])
def test_peak_in_flight_matches_documented_formula(kind):
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, 4, 5, 8, 16):
            if not defined(kind, p, m):
                continue
            result = simulate(build(kind, p, m), Costs(1, 1, 1))
            options = {"mini_batches": 4} if kind == "async-1f1b" else {}
            assert result.peak_in_flight == [peak_reference(kind, p, m, k, **options)
                                             for k in range(p)], (p, m)


def test_gpipe_and_1f1b_peaks_are_m_and_p_minus_k():
    assert simulate(build("gpipe", 4, 8), Costs(1, 1)).peak_in_flight == [8, 8, 8, 8]
    assert simulate(build("1f1b", 4, 8), Costs(1, 1)).peak_in_flight == [4, 3, 2, 1]


def test_looped_gpipe_is_valid_for_any_micro_batch_count_and_holds_m_times_chunks():
    for p in range(1, 6):
        for chunks in (2, 3):
            for m in range(1, 10):
                schedule = build("gpipe", p, m, chunks=chunks)
                validate(schedule)  # FIFO per device pair, no deadlock
                result = simulate(schedule, Costs(1, 1))
                assert result.peak_in_flight == [m * chunks] * p, (p, chunks, m)
                # every micro-batch crosses every virtual stage once, forward before backward
                for d, actions in enumerate(schedule.actions):
                    units = [(a.kind, a.micro_batch, a.chunk) for a in actions if a.kind in (F, B)]
                    assert sorted(units) == sorted((k, i, c) for k in (F, B) for i in range(m) for c in range(chunks))


def test_zb_h1_splits_every_backward():
    schedule = build("zb-h1", 4, 6)
    for actions in schedule.actions:
        assert sorted(a.micro_batch for a in actions if a.kind is W) == list(range(6))
        assert sorted(a.micro_batch for a in actions if a.kind is B) == list(range(6))


def test_async_steps_right_after_last_micro_batch_of_each_mini_batch():
    p, m, n = 3, 2, 4
    schedule = build("async-1f1b", p, m, mini_batches=n)
    for actions in schedule.actions:
        compute = [str(a) for a in actions if a.kind not in (ActionKind.SEND_GRAD, ActionKind.SEND_ACT,
                                                              ActionKind.RECV_ACT, ActionKind.RECV_GRAD)]
        for t in range(n):
            i = compute.index(f"STEP{t}")
            assert compute[i - 1] == f"B{(t + 1) * m - 1}"
        assert sum(c.startswith("STEP") for c in compute) == n


def test_async_build_equals_generator():
    schedule = build("async-1f1b", 4, 3, mini_batches=5)
    for k in range(4):
        assert list(async_1f1b_actions(k, 4, 3, lambda t: t < 5)) == schedule.actions[k]


def test_async_generator_asks_in_order_once_and_not_far_ahead():
    p, m, n = 4, 2, 6
    for k in range(p):
        asked, backwards = [], [0]

        def has_mini_batch(t):
            # only asked when mini-batch t's first micro-batch is the next forward,
            # at most p-k micro-batches past the oldest backward still pending
            assert t * m - backwards[0] <= p - k
            asked.append(t)
            return t < n

        for a in async_1f1b_actions(k, p, m, has_mini_batch):
            if a.kind is B:
                backwards[0] += 1
        assert asked == list(range(n + 1))


def test_async_generator_with_empty_stream_yields_nothing():
    assert list(async_1f1b_actions(0, 3, 2, lambda t: False)) == []


def test_async_generator_rejects_bad_stage():
    with pytest.raises(ValueError, match="stage must be in 0..2"):
        next(async_1f1b_actions(3, 3, 1, lambda t: True))


def test_validator_catches_a_corrupted_builder_output():
    schedule = build("1f1b", 3, 4)
    actions = schedule.actions[1]
    first_b = next(i for i, a in enumerate(actions) if a.kind is B)
    broken = actions[:]
    broken.insert(0, broken.pop(first_b))
    with pytest.raises(ScheduleError, match="stage 1 action 0 'B0': backward before its forward"):
        validate(Schedule("1f1b", 3, 4, [schedule.actions[0], broken, schedule.actions[2]]))

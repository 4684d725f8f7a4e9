"""The data-parallel pass: REDUCE t right before each STEP t, on schedules and on endless streams."""
import itertools

import pytest

from schedules import (Action, ActionKind, Schedule, async_1f1b_actions, build, stream_with_reductions, validate,
                       with_reductions)

STEP, REDUCE = ActionKind.STEP, ActionKind.REDUCE
KINDS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "async-1f1b"]

# What build(kind, 2, micro_batches, data_parallel=True, **_options(kind)) gave before the pass replaced that option.
BEFORE_THE_PASS = {
    ("gpipe", 2): """# schedule kind=gpipe stages=2 micro_batches=2 chunks=1 mini_batches=1
0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 REDUCE0 STEP0
1: RECV_ACT0 F0 RECV_ACT1 F1 B0 SEND_GRAD0 B1 SEND_GRAD1 REDUCE0 STEP0
""",
    ("1f1b", 2): """# schedule kind=1f1b stages=2 micro_batches=2 chunks=1 mini_batches=1
0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 RECV_GRAD1 B1 REDUCE0 STEP0
1: RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 REDUCE0 STEP0
""",
    ("zb-h1", 2): """# schedule kind=zb-h1 stages=2 micro_batches=2 chunks=1 mini_batches=1
0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 W0 RECV_GRAD1 B1 W1 REDUCE0 STEP0
1: RECV_ACT0 F0 B0 SEND_GRAD0 RECV_ACT1 F1 B1 SEND_GRAD1 W0 W1 REDUCE0 STEP0
""",
    ("interleaved-1f1b", 2): """# schedule kind=interleaved-1f1b stages=2 micro_batches=2 chunks=2 mini_batches=1
0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_ACT0:1 F0:1 SEND_ACT0:1 RECV_ACT1:1 F1:1 SEND_ACT1:1 """
    """RECV_GRAD0:1 B0:1 SEND_GRAD0:1 RECV_GRAD1:1 B1:1 SEND_GRAD1:1 RECV_GRAD0 B0 RECV_GRAD1 B1 REDUCE0 STEP0
1: RECV_ACT0 F0 SEND_ACT0 RECV_ACT1 F1 SEND_ACT1 RECV_ACT0:1 F0:1 B0:1 SEND_GRAD0:1 RECV_ACT1:1 F1:1 """
    """B1:1 SEND_GRAD1:1 RECV_GRAD0 B0 SEND_GRAD0 RECV_GRAD1 B1 SEND_GRAD1 REDUCE0 STEP0
""",
    ("async-1f1b", 1): """# schedule kind=async-1f1b stages=2 micro_batches=1 chunks=1 mini_batches=3
0: F0 SEND_ACT0 F1 SEND_ACT1 RECV_GRAD0 B0 REDUCE0 STEP0 F2 SEND_ACT2 RECV_GRAD1 B1 REDUCE1 STEP1 RECV_GRAD2 B2 REDUCE2 STEP2
1: RECV_ACT0 F0 B0 SEND_GRAD0 REDUCE0 STEP0 RECV_ACT1 F1 B1 SEND_GRAD1 REDUCE1 STEP1 RECV_ACT2 F2 B2 SEND_GRAD2 REDUCE2 STEP2
""",
}


def _options(kind):
    return {"mini_batches": 3} if kind == "async-1f1b" else {}


def _cases():
    for kind in KINDS:
        for p in range(1, 6):
            for m in range(1, 9):
                if kind == "interleaved-1f1b" and (p < 2 or m % p):
                    continue
                yield kind, p, m, _options(kind)


@pytest.mark.parametrize("kind,m", list(BEFORE_THE_PASS))
def test_equals_the_schedule_data_parallel_gave_before(kind, m):
    assert with_reductions(build(kind, 2, m, **_options(kind))).to_text() == BEFORE_THE_PASS[kind, m]


def test_reduce_right_before_every_step_and_nothing_else_changes():
    checked = 0
    for kind, p, m, options in _cases():
        plain = build(kind, p, m, **options)
        before = plain.to_text()
        reduced = with_reductions(plain)
        assert plain.to_text() == before  # the input is not modified
        assert (reduced.kind, reduced.stages, reduced.micro_batches, reduced.chunks, reduced.mini_batches) == \
            (plain.kind, plain.stages, plain.micro_batches, plain.chunks, plain.mini_batches)
        for d, (old, new) in enumerate(zip(plain.actions, reduced.actions)):
            assert [a for a in new if a.kind is not REDUCE] == old
            steps = [i for i, a in enumerate(new) if a.kind is STEP]
            assert [i for i, a in enumerate(new) if a.kind is REDUCE] == [i - 1 for i in steps]
            assert all(new[i - 1] == Action(d, REDUCE, new[i].micro_batch) for i in steps)
            assert len(steps) == plain.mini_batches
        validate(reduced)
        checked += 1
    assert checked > 150


def test_applying_it_twice_is_refused():
    reduced = with_reductions(build("1f1b", 2, 2))
    with pytest.raises(ValueError, match="already has REDUCE0"):
        with_reductions(reduced)


def test_build_no_longer_takes_data_parallel_and_names_the_pass():
    with pytest.raises(TypeError, match=r"data_parallel.*with_reductions\(build"):
        build("1f1b", 2, 2, data_parallel=True)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (3, 1), (4, 3)])
def test_stream_on_the_endless_async_generator_equals_the_list_form(p, m):
    # The endless and the n-mini-batch generator part only where the stage asks for mini-batch n,
    # after n * m forwards: their first n actions agree.
    n = prefix = 120
    finite = with_reductions(build("async-1f1b", p, m, mini_batches=n))
    for d in range(p):
        endless = async_1f1b_actions(d, p, m, lambda t: True)
        assert list(itertools.islice(stream_with_reductions(endless), prefix)) == finite.actions[d][:prefix]
        ending = async_1f1b_actions(d, p, m, lambda t: t < n)
        assert list(stream_with_reductions(ending)) == finite.actions[d]


def test_stream_reads_one_action_at_a_time():
    # An endless source: the pass must hand out actions without draining it, and keep the
    # generator's own look-ahead (it asks for mini-batches as it is consumed).
    pulled = []

    def source():
        for t in itertools.count():
            for a in (Action(0, ActionKind.FORWARD, t), Action(0, ActionKind.BACKWARD, t), Action(0, STEP, t)):
                pulled.append(a)
                yield a

    stream = stream_with_reductions(source())
    got = [next(stream) for _ in range(4)]
    assert [str(a) for a in got] == ["F0", "B0", "REDUCE0", "STEP0"]
    assert [str(a) for a in pulled] == ["F0", "B0", "STEP0"]  # REDUCE0 needed STEP0, nothing more
    assert str(next(stream)) == "F1" and len(pulled) == 4


def test_schedule_with_reductions_round_trips_through_text_and_csv():
    reduced = with_reductions(build("zb-h1", 3, 4))
    assert Schedule.from_text(reduced.to_text()) == reduced
    assert Schedule.from_csv(reduced.to_csv()) == reduced

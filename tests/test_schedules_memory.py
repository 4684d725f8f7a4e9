"""What a stage holds, read off the action lists: micro-batches in flight and which ones recompute."""
import pytest

import schedules
from schedules.held_activations import held_activations, in_flight, recomputed


@pytest.mark.parametrize("stages,m", [(4, 8), (3, 3)])
def test_in_flight_per_stage_is_what_each_schedule_is_known_for(stages, m):
    one_f_one_b = schedules.build("1f1b", stages, m)
    gpipe = schedules.build("gpipe", stages, m)
    assert [in_flight(a)[0] for a in one_f_one_b.actions] == [min(stages - k, m) for k in range(stages)]
    assert [in_flight(a)[0] for a in gpipe.actions] == [m] * stages
    # zb-h1 holds a micro-batch's graph from F to W: more than 1F1B's N-k on the later stages.
    zb = schedules.build("zb-h1", stages, m)
    zb_counts = [in_flight(a)[0] for a in zb.actions]
    assert all(z >= f for z, f in zip(zb_counts, (in_flight(a)[0] for a in one_f_one_b.actions)))


def test_except_last_keeps_whole_only_the_micro_batches_whose_backward_comes_next():
    gpipe = schedules.build("gpipe", 3, 4)
    assert recomputed(gpipe.actions[0], "except-last") == {(0, 0), (0, 1), (0, 2)}  # torchgpipe: all but the last
    assert recomputed(gpipe.actions[0], "always") == {(0, u) for u in range(4)}
    assert recomputed(gpipe.actions[0], "none") == set()
    one_f_one_b = schedules.build("1f1b", 3, 4)
    assert recomputed(one_f_one_b.actions[2], "except-last") == set()  # the last stage: F then its B at once
    assert recomputed(one_f_one_b.actions[0], "except-last") == {(0, 0), (0, 1), (0, 2)}
    with pytest.raises(ValueError, match="unknown recompute mode 'sometimes'"):
        recomputed(gpipe.actions[0], "sometimes")


def test_recomputing_holds_inputs_in_flight_and_one_micro_batch_whole():
    # 1F1B stage 0 of 3: three in flight; recomputing, at most one is whole (during its backward) while
    # the other two are held as inputs; gradients exist only from the first backward on.
    actions = schedules.build("1f1b", 3, 4).actions[0]
    moments = held_activations(actions, "always")[0]
    assert max(w for w, _, _ in moments) == 1
    assert (1, 2, 1) in moments and max(w + b for w, b, _ in moments) == 3
    whole = held_activations(actions, "none")[0]
    assert (3, 0, 0) in whole and (3, 0, 1) in whole  # the warm-up peak, before and after the first backward
    assert max(w for w, _, _ in whole) == 3

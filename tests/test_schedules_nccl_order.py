"""The NCCL-order checker: it finds stalls that gloo forgives, and every schedule's posting passes it,
with receives posted ahead (the default) and at use."""
import itertools

import pytest

from schedules import Action, build, with_reductions
from schedules.nccl_order import (CommBatch, Group, NcclOrderError, Op, Wait, check, comm_batches, posted_batches,
                                  posted_groups, replay)

KINDS = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "async-1f1b"]


def send(peer, message):
    return Op(True, peer, message)


def recv(peer, message):
    return Op(False, peer, message)


def test_both_ranks_receiving_before_sending_stalls():
    # Each rank posts the receive of the other's message before its own send, as separate groups:
    # both receive kernels run, neither send ever starts.
    programs = {0: [Group("L", (recv(1, "b"),)), Group("L", (send(1, "a"),)), Wait(("b",))],
                1: [Group("L", (recv(0, "a"),)), Group("L", (send(0, "b"),)), Wait(("a",))]}
    stall = replay(programs)
    assert stall is not None and (stall.rank, stall.message) == (0, "b")
    assert "queued behind its group at item 0 (recv a from rank 0)" in stall.reason
    with pytest.raises(NcclOrderError, match="would stall under NCCL: rank 0"):
        check(programs)


def test_the_same_messages_paired_into_groups_complete():
    programs = {0: [Group("L", (recv(1, "b"), send(1, "a"))), Wait(("b",))],
                1: [Group("L", (send(0, "b"), recv(0, "a"))), Wait(("a",))]}
    assert replay(programs) is None


def test_the_old_per_message_1f1b_order_stalls():
    # 1F1B on 2 stages as the runtime posted it before batching: one group per message. Stage 0 sends
    # activation 1 before receiving gradient 0; stage 1 sends gradient 0 before receiving activation 1.
    # Unbuffered, both sends run at once and neither receive ever starts (gloo buffers and goes on).
    stage0 = [Group(0, (send(1, "a0"),)), Group(0, (send(1, "a1"),)), Group(0, (recv(1, "g0"),)), Wait(("g0",))]
    stage1 = [Group(0, (recv(0, "a0"),)), Wait(("a0",)), Group(0, (send(0, "g0"),)), Group(0, (recv(0, "a1"),))]
    stall = replay({0: stage0, 1: stage1})
    assert stall is not None and (stall.rank, stall.message) == (0, "g0"), stall
    assert "queued behind this rank's group at item 1 (send a1 to rank 1)" in stall.reason


def test_a_group_completes_against_successive_groups_of_its_peer():
    programs = {0: [Group("L", (send(1, "x"), send(1, "y")))],
                1: [Group("L", (recv(0, "x"),)), Group("L", (recv(0, "y"),))]}
    assert replay(programs) is None


def test_messages_matched_out_of_order_are_a_mismatch():
    programs = {0: [Group("L", (send(1, "x"),)), Group("L", (send(1, "y"),))],
                1: [Group("L", (recv(0, "y"),)), Group("L", (recv(0, "x"),))]}
    stall = replay(programs)
    assert stall is not None and "another order" in stall.reason


def test_communicators_are_independent_and_waits_block_the_host():
    # Rank 1 waits for "a" before sending "b" on another communicator: fine. Rank 0 waiting for
    # "b" before sending "a" makes a cycle through the two hosts.
    ok = {0: [Group("A", (send(1, "a"),)), Group("B", (recv(1, "b"),)), Wait(("b",))],
          1: [Group("A", (recv(0, "a"),)), Wait(("a",)), Group("B", (send(0, "b"),))]}
    assert replay(ok) is None
    cycle = {0: [Group("B", (recv(1, "b"),)), Wait(("b",)), Group("A", (send(1, "a"),))],
             1: [Group("A", (recv(0, "a"),)), Wait(("a",)), Group("B", (send(0, "b"),))]}
    stall = replay(cycle)
    assert stall is not None and "its host is stuck" in stall.reason
    assert "never posted" in replay({0: [Wait(("z",))]}).reason


def test_a_wait_lasts_until_the_whole_group_completes():
    # NCCL returns one work per group: waiting for "y" also waits for the send of "x" in its group,
    # whose receive rank 1 posts only after it got "z", which rank 0 sends after that wait.
    programs = {0: [Group("L", (recv(1, "y"), send(1, "x"))), Wait(("y",)), Group("M", (send(1, "z"),))],
                1: [Group("L", (send(0, "y"),)), Group("M", (recv(0, "z"),)), Wait(("z",)), Group("L", (recv(0, "x"),))]}
    stall = replay(programs)
    assert stall is not None and (stall.rank, stall.message) == (0, "x"), stall
    programs[0] = [Group("L", (recv(1, "y"),)), Wait(("y",)), Group("M", (send(1, "z"),)), Group("L", (send(1, "x"),))]
    assert replay(programs) is None


def test_comm_batches_gathers_the_comm_actions_between_two_computations():
    text = "RECV_ACT0 F0 SEND_ACT0 W1 RECV_GRAD0 STEP0 B0 SEND_GRAD0".split()
    items = list(comm_batches(Action.parse(t, 0) for t in text))
    assert [tuple(map(str, i)) if isinstance(i, tuple) else str(i) for i in items] == [
        ("RECV_ACT0",), "F0", ("SEND_ACT0", "RECV_GRAD0"), "W1", "STEP0", "B0", ("SEND_GRAD0",)]


def _text(items):
    """posted_batches' output as text: a batch is "[posted now | posted ahead]"."""
    return [f"[{' '.join(map(str, i.actions))} | {' '.join(map(str, i.ahead))}]" if isinstance(i, CommBatch) else str(i)
            for i in items]


def test_receives_move_one_computation_ahead():
    # A middle stage. Each receive goes in the batch after the computation two before its own, except
    # RECV_GRAD2: B2 follows F2 directly, and a gradient is never received before its activation was sent.
    text = ("RECV_ACT0 F0 SEND_ACT0 RECV_ACT1 F1 SEND_ACT1 RECV_GRAD0 B0 SEND_GRAD0 W0 RECV_ACT2 F2 SEND_ACT2 "
            "RECV_GRAD2 B2 SEND_GRAD2 RECV_GRAD1 B1 SEND_GRAD1 STEP0").split()
    actions = [Action.parse(t, 1) for t in text]
    assert _text(posted_batches(actions)) == [
        "[RECV_ACT0 | RECV_ACT1]", "F0", "[SEND_ACT0 | RECV_GRAD0]", "F1", "[SEND_ACT1 | RECV_ACT2]", "B0",
        "[SEND_GRAD0 | ]", "W0", "F2", "[SEND_ACT2 RECV_GRAD2 | RECV_GRAD1]", "B2", "[SEND_GRAD2 | ]", "B1",
        "[SEND_GRAD1 | ]", "STEP0"]
    assert _text(posted_batches(actions, receive_ahead=False)) == [
        "[RECV_ACT0 | ]", "F0", "[SEND_ACT0 RECV_ACT1 | ]", "F1", "[SEND_ACT1 RECV_GRAD0 | ]", "B0",
        "[SEND_GRAD0 RECV_ACT2 | ]", "W0", "F2", "[SEND_ACT2 RECV_GRAD2 | ]", "B2", "[SEND_GRAD2 RECV_GRAD1 | ]", "B1",
        "[SEND_GRAD1 | ]", "STEP0"]


def test_a_batch_follows_every_batch_with_receives_ahead():
    # gpipe's last stage: nothing to send after F0, but the batch there is where the transport posts
    # RECV_ACT1 if it could not post it ahead (its shapes still to be read from a header).
    actions = [Action.parse(t, 1) for t in "RECV_ACT0 F0 RECV_ACT1 F1 B0 SEND_GRAD0 B1 SEND_GRAD1".split()]
    assert _text(posted_batches(actions)) == [
        "[RECV_ACT0 | RECV_ACT1]", "F0", "[ | ]", "F1", "B0", "[SEND_GRAD0 | ]", "B1", "[SEND_GRAD1 | ]"]


def test_receives_ahead_read_two_computations_ahead_of_an_endless_stream():
    pulled = []

    def stream():
        for g in itertools.count():
            for t in (f"RECV_ACT{g}", f"F{g}", f"B{g}", f"SEND_GRAD{g}"):
                pulled.append(t)
                yield Action.parse(t, 1)

    items = posted_batches(stream())
    # Each item and the last action read by then: the batch after a computation is complete once the
    # computation two after it is read (here B0 has no receive, F1 receives its activation).
    seen = [(_text([item])[0], pulled[-1]) for item in itertools.islice(items, 6)]
    assert seen == [("[RECV_ACT0 | ]", "B0"), ("F0", "B0"), ("[ | RECV_ACT1]", "F1"), ("B0", "F1"),
                    ("[SEND_GRAD0 | ]", "B1"), ("F1", "B1")]


def _cases():
    for kind in KINDS:
        for stages in range(2, 9):
            for micro_batches in range(1, 17):
                if kind == "interleaved-1f1b" and micro_batches % stages:
                    continue
                yield kind, stages, micro_batches


@pytest.mark.parametrize("receive_ahead", [True, False])
def test_every_schedule_posts_an_nccl_safe_order(receive_ahead):
    cases = 0
    for kind, stages, micro_batches in _cases():
        options = {"mini_batches": 3} if kind == "async-1f1b" else {}
        stall = replay(posted_groups(build(kind, stages, micro_batches, **options), receive_ahead=receive_ahead))
        assert stall is None, f"{kind} stages={stages} micro_batches={micro_batches}: {stall}"
        cases += 1
    assert cases == 4 * 7 * 16 + sum(16 // s for s in range(2, 9))


@pytest.mark.parametrize("receive_ahead", [True, False])
@pytest.mark.parametrize("kind,options", [("interleaved-1f1b", {"chunks": 3}), ("gpipe", {"chunks": 2})])
def test_more_chunks_post_an_nccl_safe_order(kind, options, receive_ahead):
    for stages in range(2, 6):
        for micro_batches in (stages, 2 * stages):
            schedule = build(kind, stages, micro_batches, **options)
            assert replay(posted_groups(schedule, receive_ahead=receive_ahead)) is None


@pytest.mark.parametrize("receive_ahead", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_reductions_post_an_nccl_safe_order(kind, receive_ahead):
    options = {"mini_batches": 3} if kind == "async-1f1b" else {}
    for stages in range(2, 6):
        for micro_batches in (stages, 2 * stages):
            schedule = with_reductions(build(kind, stages, micro_batches, **options))
            assert replay(posted_groups(schedule, receive_ahead=receive_ahead)) is None


@pytest.mark.parametrize("receive_ahead", [True, False])
@pytest.mark.parametrize("span", [2, 3])
def test_skip_connections_post_an_nccl_safe_order(span, receive_ahead):
    # Stage v also feeds stage v + span: each direction of that link has a communicator of its own.
    for kind in KINDS:
        for stages in (3, 4, 5):
            sched = build(kind, stages, 2 * stages)
            links = [(v, v + 1) for v in range(sched.virtual_stages - 1)]
            links += [(v, v + span) for v in range(sched.virtual_stages - span)]
            programs = posted_groups(sched, links, receive_ahead=receive_ahead)
            assert replay(programs) is None, (kind, stages)
            src, dst = links[-1]
            if dst - src == span and src % stages != dst % stages:
                posted = [g.comm for g in programs[dst % stages] if isinstance(g, Group)]
                assert (len(links) - 1, "act") in posted


def test_receives_ahead_on_one_communicator_per_link_stall():
    # Receives posted ahead, both directions of the link on one communicator: on rank 0 the group
    # [send act 0, recv grad 0] stays incomplete until rank 1's B0, and rank 1's [send grad 0] is queued
    # behind its early [recv act 1], whose send rank 0 queues behind that first group.
    programs = posted_groups(build("1f1b", 2, 4))
    assert replay(programs) is None  # a communicator per direction
    shared = {d: [Group(g.comm[0], g.ops) if isinstance(g, Group) else g for g in p] for d, p in programs.items()}
    stall = replay(shared)
    assert stall is not None and (stall.rank, stall.message) == (0, ("grad", 0, 0)), stall
    assert "queued behind its group at item 2 (recv ('act', 0, 1) from rank 0)" in stall.reason


def test_receiving_at_use_pairs_each_send_with_the_peers_receive():
    programs = posted_groups(build("1f1b", 2, 3), receive_ahead=False)
    groups = lambda d: [sorted(map(str, g.ops)) for g in programs[d] if isinstance(g, Group)]  # noqa: E731
    assert groups(0) == [["send ('act', 0, 0) to rank 1"],
                         ["recv ('grad', 0, 0) from rank 1", "send ('act', 0, 1) to rank 1"],
                         ["recv ('grad', 0, 1) from rank 1", "send ('act', 0, 2) to rank 1"],
                         ["recv ('grad', 0, 2) from rank 1"]]
    assert groups(1) == [["recv ('act', 0, 0) from rank 0"],
                         ["recv ('act', 0, 1) from rank 0", "send ('grad', 0, 0) to rank 0"],
                         ["recv ('act', 0, 2) from rank 0", "send ('grad', 0, 1) to rank 0"],
                         ["send ('grad', 0, 2) to rank 0"]]


def test_receiving_ahead_posts_each_receive_one_computation_early():
    # Stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2: each receive goes out right after the
    # computation two before the one that consumes it, on a communicator per direction.
    programs = posted_groups(build("1f1b", 2, 3))
    items = lambda d: [" ".join(map(str, i.ops)) if isinstance(i, Group) else f"wait {i.messages[0]}"  # noqa: E731
                       for i in programs[d]]
    assert items(0) == ["send ('act', 0, 0) to rank 1", "recv ('grad', 0, 0) from rank 1",
                        "send ('act', 0, 1) to rank 1", "wait ('grad', 0, 0)", "recv ('grad', 0, 1) from rank 1",
                        "send ('act', 0, 2) to rank 1", "recv ('grad', 0, 2) from rank 1", "wait ('grad', 0, 1)",
                        "wait ('grad', 0, 2)"]
    assert items(1) == ["recv ('act', 0, 0) from rank 0", "wait ('act', 0, 0)", "recv ('act', 0, 1) from rank 0",
                        "send ('grad', 0, 0) to rank 0", "wait ('act', 0, 1)", "recv ('act', 0, 2) from rank 0",
                        "send ('grad', 0, 1) to rank 0", "wait ('act', 0, 2)", "send ('grad', 0, 2) to rank 0"]
    assert {g.comm for p in programs.values() for g in p if isinstance(g, Group)} == {(0, "act"), (0, "grad")}

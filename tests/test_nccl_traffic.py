"""What the distributed engine really posts (recorded on gloo) replays without a stall under NCCL's model.

Every rank records its groups and waits (pipetrain.comm.recording) while it trains and predicts;
the test gathers all ranks' programs of a case and replays them (schedules.nccl_order). Cases:
2, 3 and 4 ranks; sync and async schedules, interleaving, zb-h1, skip connections, tied weights,
a shorter last batch (shape headers again), dynamic shapes, and hybrid mode (2 stages x 2 replicas);
receives posted ahead (the default) and, in one case, at use.
"""
from collections import Counter

import pytest

from dist_harness import run_world
from pipetrain.comm.recording import recording
from pipetrain.runtime import host_sync
from runtime_models import data, loss_fn, make, sgd
from schedules.nccl_order import Group, Wait, replay
from helpers import batches, wrap_unprofiled

# (model, schedule, staleness, micro_batches, extra wrap options)
CASES = {
    2: [("skip", "1f1b", "none", 4, {}), ("skip", "gpipe", "none", 4, {}),
        ("skip", "interleaved-1f1b", "none", 4, {}), ("skip", "zb-h1", "none", 4, {}),
        ("tied", "async-1f1b", "stash", 2, {}), ("mlp", "async-1f1b", "vanilla", 1, {}),
        ("mlp", "1f1b", "none", 2, {"dynamic_shapes": True}), ("mlp", "1f1b", "none", 4, {"receive_ahead": False})],
    3: [("skip", "1f1b", "none", 4, {}), ("skip", "interleaved-1f1b", "none", 3, {}),
        ("tied", "zb-h1", "none", 4, {}), ("skip", "async-1f1b", "spectrain", 1, {}),
        ("tied", "async-1f1b", "stash", 2, {})],
    4: [("skip", "1f1b", "none", 4, {}), ("tied", "gpipe", "none", 4, {}),
        ("mlp", "interleaved-1f1b", "none", 4, {}), ("convbn", "zb-h1", "none", 4, {}),
        ("skip", "async-1f1b", "vanilla", 2, {}), ("tied", "async-1f1b", "stash", 1, {}),
        ("mlp", "1f1b", "none", 2, {"data_parallel": 2}), ("mlp", "async-1f1b", "stash", 1, {"data_parallel": 2}),
        ("tied", "interleaved-1f1b", "none", 2, {"data_parallel": 2})],
}


def record(rank, world, cases):
    """This rank's recorded program and host synchronisations for each case (training three
    mini-batches, then one predict)."""
    programs = []
    for name, schedule, staleness, micro_batches, extra in cases:
        bs = batches(name, size=12, last=7)
        stages = world // extra.get("data_parallel", 1)
        with recording() as recorder:
            pipe = wrap_unprofiled(make(name), bs[0][0][:2], stages=stages, micro_batches=micro_batches,
                                   schedule=schedule, staleness=staleness, loss_fn=loss_fn(name), optimizer=sgd,
                                   partitioner="uniform", engine="distributed", **extra)
            with host_sync.counting() as syncs:
                for _ in pipe.train(bs):
                    pass
            pipe.predict(data(name, 6, seed=9)[0])
        programs.append((recorder.program, syncs))
    return programs


def point_to_point(item) -> bool:
    return isinstance(item, Group) and item.ops[0].message[0] in ("act", "grad", "header")  # not a collective


def posts_receives_ahead(program) -> bool:
    """Whether a receive goes out before a later group of sends that precedes its wait. Received at use
    over adjacent links (one communicator each), a comm batch is one group per link, sends and receives
    together, so that never happens; posted ahead, the receive waits out the sends of a computation."""
    waiting: set = set()  # payload receives posted and not yet waited for
    for item in program:
        if isinstance(item, Wait):
            waiting.difference_update(item.messages)
        elif point_to_point(item):
            if waiting and any(op.send for op in item.ops):
                return True
            waiting.update(op.message for op in item.ops if not op.send and op.message[0] != "header")
    return False


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_recorded_traffic_replays_under_nccl(tmp_path, world, one_thread):
    per_rank = run_world(world, "test_nccl_traffic", "record", tmp_path, CASES[world])
    for i, case in enumerate(CASES[world]):
        programs = {rank: per_rank[rank][i][0] for rank in range(world)}
        assert all(any(isinstance(g, Group) for g in p) for p in programs.values()), case
        stall = replay(programs)
        assert stall is None, f"{case}: {stall}"
        ahead = case[4].get("receive_ahead", True)
        assert any(posts_receives_ahead(p) for p in programs.values()) == ahead, case
        if ahead:  # every direction of every link on a communicator of its own
            assert all(isinstance(g.comm, tuple) for p in programs.values() for g in p if point_to_point(g)), case
        # Per step one read of the decision and one of the report (one read of the exchange carrying both in
        # a sync step; a stream's report travels on its own), and one loss read on a last stage.
        reads = ({"skip-or-step decision": 3, "step report": 3} if case[1] == "async-1f1b" else
                 {"skip-or-step decision and step report": 3})
        for rank in range(world):
            syncs = per_rank[rank][i][1]
            headers = syncs.pop("shape header", 0)
            assert syncs in (reads, reads | {"loss report": 3}), (case, rank, syncs)
            per_link = Counter(g.comm for g in programs[rank] if isinstance(g, Group)
                               for op in g.ops if not op.send and op.message[0] == "header")
            assert headers <= sum(per_link.values()), (case, rank)  # the program also holds predict()
            if not case[4].get("dynamic_shapes"):
                # Once per link and micro-batch size: here at most 3 sizes, the 12-sample batches' and
                # the two a 7-sample batch (or a replica's shard of it) splits into.
                assert max(per_link.values(), default=0) <= 3, (case, rank, per_link)
        if case[0] == "tied":  # the tied gradients' all-reduce is in the replay
            assert any(isinstance(g, Group) and isinstance(g.comm, tuple) and g.comm[0] == "tied"
                       for p in programs.values() for g in p), case

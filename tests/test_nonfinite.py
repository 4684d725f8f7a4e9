"""Non-finite losses and gradients: nonfinite="raise" stops every rank naming step, stage and parameter;
nonfinite="skip" skips the update on every stage and replica alike (local engine, 2 ranks; the 2x2
hybrid case lives in test_hybrid.py, which shares its 4-process start-up)."""
import gc
import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipetrain
from pipetrain.assembly.schedule_book import ScheduleBook
from pipetrain.comm.consensus import default_store
from pipetrain.runtime.staleness import VersionStore
from dist_harness import run_world
from runtime_models import data, make, sgd
from schedules import ActionKind
from helpers import batches, wrap_unprofiled

NAN = float("nan")


def poison(pipe, stage, when):
    """Make the gradient of the stage's SECOND parameter NaN after each backward where ``when(micro_batch)``
    and the parameter has one (a hook on the policy works for every staleness policy; those that backward
    through weight copies hand the gradients over at the mini-batch's last backward).
    Returns that parameter's original-model name."""
    rt = pipe.held_stages[stage]
    name, param = list(rt.module.named_parameters())[1]
    original = rt.policy.after_backward

    def after_backward(micro_batch, last):
        original(micro_batch, last)
        if when(micro_batch) and param.grad is not None:
            param.grad.fill_(NAN)

    rt.policy.after_backward = after_backward
    return name


def wrap(engine="local", stages=3, **kw):
    kw = dict(dict(micro_batches=2, optimizer=sgd, partitioner="uniform"), **kw)
    return wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=stages, engine=engine, **kw)


def snapshot(pipe):
    params = {k: v.clone() for k, v in pipe.state_dict().items()}
    optim = [{k: v.clone() for k, v in st.items()} for rt in pipe.held_stages.values() if rt.optimizer is not None
             for st in rt.optimizer.state.values()]
    return params, optim


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_raise_names_step_stage_and_parameter(precision):
    pipe = wrap(precision=precision)
    name = poison(pipe, 1, lambda g: pipe.updates == 1)
    bs = batches("mlp", 4)
    pipe.step(*bs[0])
    before, _ = snapshot(pipe)
    with pytest.raises(pipetrain.NonFiniteError) as error:
        pipe.step(*bs[1])
    message = str(error.value)
    assert "optimizer step 2" in message and f"stage 1, parameter {name!r}" in message, message
    assert "lower the learning rate" in message and "nonfinite='skip'" in message, message
    assert ("bf16 has fp32's range" in message) == (precision == "bf16"), message
    assert same(before, snapshot(pipe)[0])  # nothing applied anywhere
    assert all(p.grad is None for rt in pipe.held_stages.values() for p in rt.module.parameters())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_skip_leaves_every_stage_alone_and_equals_never_seeing_the_update(precision):
    bs = batches("mlp", 4)
    pipe = wrap(precision=precision, nonfinite="skip")
    poison(pipe, 1, lambda g: pipe.updates == 1)
    results = [pipe.train([bs[0]]).__next__()]
    before = snapshot(pipe)
    results.append(next(pipe.train([bs[1]])))
    after = snapshot(pipe)
    assert same(before[0], after[0]) and len(before[1]) == len(after[1]) > 0
    assert all(same(a, b) for a, b in zip(before[1], after[1]))  # momentum buffers untouched too
    results += list(pipe.train(bs[2:]))
    assert [r.skipped for r in results] == [False, True, False, False]
    assert [r.skipped_total for r in results] == [0, 1, 1, 1]
    # Training went on exactly as if mini-batch 1 had never been seen (bit for bit).
    reference = wrap(precision=precision, nonfinite="skip")
    losses = [r.loss for r in reference.train([bs[0], bs[2], bs[3]])]
    assert same(pipe.state_dict(), reference.state_dict())
    assert [results[i].loss for i in (0, 2, 3)] == losses


def poison_parameter(pipe, stage, update):
    """Make the gradient of the stage's second parameter NaN whenever autograd computes it during the
    step that makes update ``update + 1`` (a tensor hook: it also runs in zero-bubble W passes)."""
    name, param = list(pipe.held_stages[stage].module.named_parameters())[1]
    param.register_hook(lambda g: g * NAN if pipe.updates == update else g)
    return name


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "interleaved-1f1b"])
def test_every_sync_schedule_raises_or_skips(schedule):
    bs = batches("mlp", 4, 12)
    pipe = wrap(stages=3, schedule=schedule, micro_batches=3)
    name = poison_parameter(pipe, 1, 1)
    pipe.step(*bs[0])
    before = snapshot(pipe)
    with pytest.raises(pipetrain.NonFiniteError, match=rf"optimizer step 2: stage 1, parameter '{name}'"):
        pipe.step(*bs[1])
    after = snapshot(pipe)
    assert same(before[0], after[0]) and all(same(a, b) for a, b in zip(before[1], after[1]))
    pipe = wrap(stages=3, schedule=schedule, micro_batches=3, nonfinite="skip")
    poison_parameter(pipe, 1, 1)
    assert [r.skipped for r in pipe.train(bs)] == [False, True, False, False]
    reference = wrap(stages=3, schedule=schedule, micro_batches=3)
    list(reference.train([bs[0], bs[2], bs[3]]))
    assert same(pipe.state_dict(), reference.state_dict())


def test_fp16_nonfinite_loss_raises_but_overflow_only_skips():
    bs = batches("mlp", 4)
    pipe = wrap(precision="fp16")
    poison(pipe, 1, lambda g: pipe.updates == 1)  # a gradient overflow: the loss scaler's business
    assert [r.skipped for r in pipe.train(bs[:3])] == [False, True, False]
    pipe = wrap(precision="fp16")
    x, y = bs[1][0].clone(), bs[1][1]
    x[3, 2] = NAN  # bad data: the loss itself is NaN, which no loss scale explains
    pipe.step(*bs[0])
    with pytest.raises(pipetrain.NonFiniteError, match=r"the loss is NaN or infinite at optimizer step 2, "
                                                        r"computed by pipeline position 2 \(stage 2\).*precision='bf16'"):
        pipe.step(x, y)


def async_stash(engine, stages, nonfinite="skip", staleness="stash", precision="fp32"):
    """An async stream of 6 mini-batches with stage 1's gradient poisoned in mini-batch 2."""
    bs = batches("mlp", 6)
    pipe = wrap(engine, stages=stages, schedule="async-1f1b", staleness=staleness, nonfinite=nonfinite,
                precision=precision)
    m = pipe.options.micro_batches
    stage = 1 if engine == "local" else next(iter(pipe.held_stages))
    steps = []
    for rt in pipe.held_stages.values():
        original = rt.optimizer.step
        rt.optimizer.step = lambda original=original, rt=rt: (steps.append(rt.index), original())[1]
    if engine == "local" or stage == 1:
        poison(pipe, 1, lambda g: g // m == 2)
    results = list(pipe.train(bs))
    stores = {v: [s for s in vars(rt.policy).values() if isinstance(s, VersionStore)] for v, rt in pipe.held_stages.items()}
    policies = {v: (rt.policy.updates, [dict(s) for s in stores[v]], [dict(s.key_of) for s in stores[v]])
                for v, rt in pipe.held_stages.items()}
    return ([r.skipped for r in results], [r.loss for r in results], pipe.state_dict(), steps, policies,
            [r.version_lag for r in results])


@pytest.mark.parametrize("staleness", ["stash", "vanilla", "spectrain", "2bw", "nesterov"])
def test_async_skip_keeps_every_policy_s_bookkeeping(staleness):
    # Each policy keys its weight versions by the updates it has seen: a skipped update must not
    # leave a later micro-batch asking for a version that never came (2bw did).
    skipped, losses, state, steps, policies, lags = async_stash("local", 3, staleness=staleness)
    assert skipped == [False, False, True, False, False, False]
    assert sorted(steps) == sorted(list(range(3)) * 5)  # every stage stepped 5 times, none at mini-batch 2
    for v, (updates, versions, of_micro_batch) in policies.items():
        assert updates == 5 and all(s == {} for s in versions + of_micro_batch), v  # drained, nothing leaked
    assert all(torch.isfinite(t).all() for t in state.values())
    assert all(x == x for x in losses)


def test_every_policy_step_is_counted_when_none_is_skipped():
    # The same stream without poison: the bookkeeping the test above relies on.
    pipe = wrap(schedule="async-1f1b", staleness="stash", nonfinite="skip")
    assert not any(r.skipped for r in pipe.train(batches("mlp", 3)))
    assert all(rt.policy.updates == 3 for rt in pipe.held_stages.values())


# ----- two ranks ---------------------------------------------------------------------------------

def sync_run(engine, stages, nonfinite):
    """1f1b over 4 mini-batches with stage 1's gradient poisoned at step 2; a raise is returned as text."""
    pipe = wrap(engine, stages=stages, nonfinite=nonfinite)
    name = None
    if 1 in pipe.held_stages:
        name = poison(pipe, 1, lambda g: pipe.updates == 1)
    results, error = [], None
    try:
        for r in pipe.train(batches("mlp", 4)):
            results.append((r.skipped, r.skipped_total, r.loss))
    except pipetrain.NonFiniteError as e:
        error = str(e)
    return results, error, name, pipe.state_dict()


def async_raise(engine, stages):
    """A stash stream with stage 1's gradient poisoned in mini-batch 2 and nonfinite="raise"."""
    pipe = wrap(engine, stages=stages, schedule="async-1f1b", staleness="stash")
    m = pipe.options.micro_batches
    name = poison(pipe, 1, lambda g: g // m == 2) if 1 in pipe.held_stages else None
    try:
        results = [r.step for r in pipe.train(batches("mlp", 6))]
        error = None
    except pipetrain.NonFiniteError as e:
        results, error = None, str(e)
    finite = all(torch.isfinite(t).all() for t in pipe.state_dict().values())
    return results, error, name, finite, {v: rt.policy.updates for v, rt in pipe.held_stages.items()}


def async_raise_then_drop(world):
    """async_raise on 2 ranks where rank 1 drops its pipeline as soon as it raised, before rank 0 even posted
    its receive of the gradients of micro-batch 7 it still needs to reach the STEP where it raises too: rank
    0's forward of micro-batch 8 (which comes first) waits until rank 1 either dropped the pipeline or began
    to deliver what its peer still takes. Returns the error as text (a PeerFailure too) and the (kind,
    micro-batch) of the sends pending when the rank raised and of those it left undelivered."""
    store = default_store()
    released = "test_nonfinite/rank-1-released"
    pipe = wrap("distributed", stages=world, schedule="async-1f1b", staleness="stash")
    m = pipe.options.micro_batches
    rank = dist.get_rank()
    if rank == 0:
        forwards = itertools.count()

        def hold(module, args):
            if next(forwards) == 4 * m:
                store.wait([released], timedelta(seconds=120))
        pipe.held_stages[0].module.register_forward_pre_hook(hold)
    else:
        poison(pipe, 1, lambda g: g // m == 2)
    transport = pipe._parts.connections.transport
    deliver, sends = transport.deliver, {}

    def recorded(taken):
        if rank == 1:
            store.set(released, "delivering")
        sends["pending"] = {e[3][1:] for e in transport.pending_sends}
        deliver(taken)
        sends["left"] = {e[3][1:] for e in transport.pending_sends}
    transport.deliver = recorded
    try:
        results, error = [r.step for r in pipe.train(batches("mlp", 6))], None
    except (pipetrain.NonFiniteError, pipetrain.PeerFailure) as e:
        results, error = None, f"{type(e).__name__}: {e}"
    finally:
        if rank == 1:
            del pipe, transport
            gc.collect()
            store.set(released, "dropped")
    return results, error, sends


def loss_raise(engine, stages):
    """A NaN in one sample of mini-batch 1 (bad data): the loss itself is NaN at step 2."""
    pipe = wrap(engine, stages=stages)
    bs = batches("mlp", 4)
    pipe.step(*bs[0])
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    x = bs[1][0].clone()
    x[5, 1] = NAN
    try:
        pipe.step(x, bs[1][1])
        error = None
    except pipetrain.NonFiniteError as e:
        error = str(e)
    return error, pipe.state_dict(), same(before, pipe.state_dict())


def world2(rank, world):
    return {"skip": sync_run("distributed", world, "skip"), "raise": sync_run("distributed", world, "raise"),
            "async": async_stash("distributed", world), "async-raise": async_raise("distributed", world),
            "async-raise-then-drop": async_raise_then_drop(world),
            "async-bf16": async_stash("distributed", world, precision="bf16"),
            "loss-raise": loss_raise("distributed", world)}


# The tests on two_ranks take one_thread: the local engine runs the ranks' thread count, for equal bits.
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_world(2, "test_nonfinite", "world2", tmp_path_factory.mktemp("nonfinite"))


@pytest.mark.slow
def test_two_ranks_skip_the_same_step_as_the_local_engine(two_ranks, one_thread):
    local_results, _, _, local_state = sync_run("local", 2, "skip")
    assert [r[0] for r in local_results] == [False, True, False, False]
    merged = {}
    for rank in range(2):
        results, error, _, state = two_ranks[rank]["skip"]
        assert error is None and results == local_results, rank
        merged.update(state)
    assert same(merged, local_state)


@pytest.mark.slow
def test_two_ranks_raise_together_and_name_the_parameter(two_ranks, one_thread):
    _, _, name, _ = two_ranks[1]["raise"]
    _, _, _, local_state = sync_run("local", 2, "raise")  # after step 1: the local test shows nothing moved
    merged = {}
    for rank in range(2):
        results, error, _, state = two_ranks[rank]["raise"]
        assert len(results) == 1 and error is not None, rank
        assert "optimizer step 2" in error, error
        merged.update(state)
    assert same(merged, local_state)  # no rank applied the bad step
    assert f"stage 1, parameter {name!r}" in two_ranks[1]["raise"][1]
    assert "found by rank 1 (stage 1, replica 0), whose error names the parameter" in two_ranks[0]["raise"][1]


@pytest.mark.slow
def test_two_ranks_async_stash_skip_equals_the_local_engine(two_ranks, one_thread):
    skipped, losses, state, steps, policies, lags = async_stash("local", 2)
    assert skipped == [False, False, True, False, False, False]
    merged = {}
    for rank in range(2):
        r_skipped, r_losses, r_state, r_steps, r_policies, r_lags = two_ranks[rank]["async"]
        assert (r_skipped, r_losses, r_lags) == (skipped, losses, lags), rank
        assert r_steps == [rank] * 5 and r_policies == {rank: policies[rank]}, rank
        merged.update(r_state)
    assert same(merged, state)


@pytest.mark.slow
def test_two_ranks_async_bf16_skip_equals_the_local_engine(two_ranks, one_thread):
    skipped, losses, state, _, policies, _ = async_stash("local", 2, precision="bf16")
    assert skipped == [False, False, True, False, False, False]
    merged = {}
    for rank in range(2):
        r_skipped, r_losses, r_state, r_steps, r_policies, _ = two_ranks[rank]["async-bf16"]
        assert (r_skipped, r_losses, r_steps) == (skipped, losses, [rank] * 5), rank
        assert r_policies == {rank: policies[rank]}, rank
        merged.update(r_state)
    assert same(merged, state)


@pytest.mark.slow
def test_two_ranks_nan_loss_raises_on_both_naming_the_last_stage(two_ranks, one_thread):
    local_error, local_state, untouched = loss_raise("local", 2)
    assert "the loss is NaN or infinite at optimizer step 2, computed by pipeline position 1" in local_error
    assert untouched
    merged = {}
    for rank in range(2):
        error, state, untouched = two_ranks[rank]["loss-raise"]
        assert error is not None and "the loss is NaN or infinite at optimizer step 2, computed by rank 1 " \
            "(stage 1, replica 0)" in error, (rank, error)
        assert untouched, rank
        merged.update(state)
    assert same(merged, local_state)  # after step 1 on every rank: the bad step was applied nowhere


@pytest.mark.slow
def test_async_stream_raises_on_every_rank_without_waiting_at_each_step(two_ranks, one_thread):
    # Across processes an async stream's STEP t does not wait for the other ranks' verdict (that would
    # hold each stage until stage 0 finished the mini-batch's backward); STEP t + 1 reads it. Both ranks
    # raise naming the poisoned step; the poisoned stage never applied it, the clean stage did.
    _, _, name, _, _ = two_ranks[1]["async-raise"]
    for rank in range(2):
        results, error, _, finite, updates = two_ranks[rank]["async-raise"]
        assert results is None and error is not None, rank
        assert "optimizer step 3 (mini-batch 2 of this train() stream)" in error, error
        assert "an async stream learns of it one step later" in error, error
        assert finite, rank
        assert updates == {rank: 2 if rank == 1 else 3}, (rank, updates)
    assert f"stage 1, parameter {name!r}" in two_ranks[1]["async-raise"][1]
    assert "found by rank 1 (stage 1, replica 0)" in two_ranks[0]["async-raise"][1]


@pytest.mark.slow
def test_an_async_raise_reaches_every_rank_when_the_first_to_raise_drops_its_pipeline(two_ranks, one_thread):
    # Rank 1 raises at its STEP 3 once it sent micro-batch 7's gradients; rank 0 needs them to reach its own
    # STEP 3. On gloo a send whose work is dropped before the receive is posted is lost, so rank 1 must see
    # them delivered before it lets the caller drop the pipeline (or end the process).
    # What each rank delivers is what its peer takes before its own STEP 3: rank 1 every gradient up to
    # micro-batch 7; rank 0 the activations up to micro-batch 7, not 8's (rank 1 runs F8 after STEP 3).
    for rank in range(2):
        results, error, _ = two_ranks[rank]["async-raise-then-drop"]
        assert results is None and error.startswith("NonFiniteError: "), (rank, error)
        assert "optimizer step 3 (mini-batch 2 of this train() stream)" in error, error
    rank0, rank1 = two_ranks[0]["async-raise-then-drop"][2], two_ranks[1]["async-raise-then-drop"][2]
    assert ("act", 7) in rank0["pending"] and rank0["left"] == {("act", 8)}, rank0
    assert ("grad", 7) in rank1["pending"] and rank1["left"] == set(), rank1


def test_a_stream_position_computes_before_its_step_what_1f1b_counts():
    # The messages a raising rank still delivers: position k of p runs the forwards up to L + p - k - 1 and
    # the backwards up to L before its STEP t, L being mini-batch t's last micro-batch.
    p, m = 4, 2
    book = ScheduleBook("async-1f1b", p, m, 1, data_parallel=False)
    for k in range(p):
        for t in range(4):
            last = (t + 1) * m - 1
            expected = {(ActionKind.FORWARD, g) for g in range(last + p - k)} | {
                (ActionKind.BACKWARD, g) for g in range(last + 1)}
            assert book.stream_work_before_step(k, t) == expected, (k, t)


def test_async_stream_in_one_process_raises_before_any_stage_applies_the_step():
    results, error, _, finite, updates = async_raise("local", 3)
    assert results is None and "optimizer step 3" in error and "was not applied on any stage" in error
    assert finite and updates == {0: 2, 1: 2, 2: 2}

"""Hybrid mode (pipelines replicated for data parallelism) and mixed precision in the runtime."""
import pytest
import torch

import pipetrain
from dist_harness import run_world
from pipetrain.allreduce.hierarchy import Hierarchy
from pipetrain.comm.replicas import bucket_choice
from runtime_models import data, make, sgd
from schedules.cluster import load_cluster
from schedules.cluster.reductions import Group, prefers_hierarchical
from test_nonfinite import poison
from helpers import batches, wrap_unprofiled

# Samples a mini-batch: replica shards of 7 and 6, micro-batches of uneven sizes inside each.
SIZE = 13

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)


CORRECTED = dict(staleness="nesterov", spike_compensation=True, dc_lambda=0.5, stage_lr_warmup=3, stage_momentum=True,
                 error_feedback=True, optimizer=sgd, partitioner="uniform")


def hybrid_scenarios(rank, world):
    out = {}
    for key, kw in {
        "1f1b-hybrid": dict(schedule="1f1b", allreduce="hybrid", hierarchy=(2, 1)),
        # A cluster model that prices every bucket flat (gloo-local4: one slow shared host).
        "1f1b-hybrid-priced": dict(schedule="1f1b", allreduce="hybrid", hierarchy=(2, 1), cluster="gloo-local4"),
        "gpipe-flat-no-overlap": dict(schedule="gpipe", allreduce="flat", overlap=False),
        "interleaved-hierarchical": dict(schedule="interleaved-1f1b", allreduce="hierarchical", hierarchy=(1, 2)),
        "1f1b-per-tensor-bf16-compressed": dict(schedule="1f1b", allreduce="per-tensor", compress="bf16"),
        "zb-h1-flat": dict(schedule="zb-h1", allreduce="flat"),
    }.items():
        pipe = wrap_unprofiled(make("convbn"), data("convbn", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                               optimizer=sgd, partitioner="uniform", engine="distributed", **kw)
        losses = [r.loss for r in pipe.train(batches("convbn", size=SIZE))]
        reducer = pipe.gradient_reducer
        out[key] = (losses, pipe.state_dict(), pipe.last_result.comm_bytes, pipe.predict(data("convbn", 6, seed=5)[0]),
                    [(b.buffer.numel() * b.buffer.element_size(), b.hierarchical) for b in reducer.buckets])
    # async-1f1b with stash, replicated: each update averages the replicas' stashed gradients.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=1, data_parallel=2,
                           schedule="async-1f1b", staleness="stash", optimizer=sgd, partitioner="uniform",
                           engine="distributed")
    out["async-stash"] = ([r.loss for r in pipe.train(batches("mlp", 5, size=SIZE))], pipe.state_dict(), None, None)
    # The delay corrections act on the reduced gradient: replicated, they equal one process on the whole batch.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=1, data_parallel=2,
                           schedule="async-1f1b", engine="distributed", **CORRECTED)
    out["async-corrected"] = ([r.loss for r in pipe.train(batches("mlp", 5, size=SIZE))], pipe.state_dict(), None, None)
    # fp16: an overflow injected on replica 1's last stage only must make every rank skip the same step.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                           precision="fp16", optimizer=sgd, partitioner="uniform",
                           engine="distributed")
    if rank == 3:
        param = next(iter(pipe.held_stages[1].module.parameters()))
        param.register_hook(lambda g: g * float("inf") if pipe.updates == 1 else g)
    scales, unchanged, skipped = [], [], []
    for i, (x, y) in enumerate(batches("mlp", 2, size=SIZE)):
        before = [p.detach().clone() for rt in pipe.held_stages.values() for p in rt.module.parameters()]
        pipe.step(x, y)
        scales.append(pipe.loss_scale)
        skipped += [i] if pipe.last_result.skipped else []
        unchanged.append(all(torch.equal(p, b) for p, b in zip(
            (p for rt in pipe.held_stages.values() for p in rt.module.parameters()), before)))
    out["fp16"] = (skipped, scales, unchanged)
    # Non-finite gradient on rank 3 only (replica 1's stage 1) at step 2, fp32.
    for mode in ("skip", "raise"):
        pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                               optimizer=sgd, partitioner="uniform", engine="distributed",
                               nonfinite=mode)
        if rank == 3:
            poison(pipe, 1, lambda g, pipe=pipe: pipe.updates == 1)
        results, error, last = [], None, None
        try:
            for r in pipe.train(batches("mlp", 3, size=SIZE)):
                results.append(r.skipped)
                last = {k: v.clone() for k, v in pipe.state_dict().items()}
        except pipetrain.NonFiniteError as e:
            error = str(e)
        out[f"nonfinite-{mode}"] = (results, error, pipe.state_dict(), last)
    # async-1f1b (stash) replicated, NaN on rank 3 in mini-batch 2: every rank skips that update.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                           schedule="async-1f1b", staleness="stash", optimizer=sgd, partitioner="uniform",
                           engine="distributed", nonfinite="skip")
    if rank == 3:
        poison(pipe, 1, lambda g: g // 2 == 2)
    out["nonfinite-async-skip"] = ([r.skipped for r in pipe.train(batches("mlp", 5, size=SIZE))], None, pipe.state_dict())
    # What "skip" must equal: the same ranks never seeing step 2's update.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=2, data_parallel=2,
                           optimizer=sgd, partitioner="uniform", engine="distributed")
    bs = batches("mlp", 3, size=SIZE)
    out["nonfinite-reference"] = ([r.skipped for r in pipe.train([bs[0], bs[2]])], None, pipe.state_dict())
    return out


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return run_world(4, "test_hybrid", "hybrid_scenarios", tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("key", ["1f1b-hybrid", "1f1b-hybrid-priced", "gpipe-flat-no-overlap", "interleaved-hierarchical",
                                 "1f1b-per-tensor-bf16-compressed", "zb-h1-flat"])
def test_pipeline_x_data_parallel_equals_one_process_on_the_global_batch(hybrid, key):
    bs = batches("convbn", size=SIZE)
    for replica in range(2):
        merged = {}
        for rank in (2 * replica, 2 * replica + 1):
            merged.update(hybrid[rank][key][1])
        losses = hybrid[2 * replica][key][0]
        # The global mean of each replica's 2 micro-batches: the reference accumulates the same 4 shards.
        ref = reference_global(bs)
        tolerance = 5e-3 if "bf16" in key else 1e-5  # bf16 gradient transfer keeps 8 bits of mantissa
        for name, value in ref.state_dict().items():
            if name.endswith("running_mean") or name.endswith("running_var") or name.endswith("num_batches_tracked"):
                continue  # batch statistics are per replica, as in DDP
            torch.testing.assert_close(merged[name], value, atol=tolerance, rtol=0, msg=f"{key} {name}")
        assert losses == hybrid[0][key][0]  # every rank reports the same global loss


def test_hybrid_takes_per_bucket_what_the_cluster_model_prices_cheaper(hybrid):
    # Without a cluster every bucket crossing nodes goes hierarchically; with one, each bucket takes
    # the algorithm schedules.cluster.reductions prices cheaper (the same call `pipetrain plan` makes).
    cluster = load_cluster("gloo-local4")
    for rank in range(4):
        default, priced = hybrid[rank]["1f1b-hybrid"][4], hybrid[rank]["1f1b-hybrid-priced"][4]
        assert default and all(hierarchical for _, hierarchical in default), rank
        assert priced and [h for _, h in priced] == [prefers_hierarchical(n, Group(2, 1), cluster) for n, _ in priced]
    # The decision itself, per bucket size: small buckets hierarchical, large ones flat on jia-p40.
    choose = bucket_choice("jia-p40", Hierarchy(2, 2, 0, 0, None, None, None))
    assert [choose(n) for n in (10 ** 3, 10 ** 5, 10 ** 7, 10 ** 9)] == [True, True, False, False]
    assert bucket_choice(None, Hierarchy(2, 2, 0, 0, None, None, None)) is None


def test_delay_corrections_replicated_equal_one_process_on_the_whole_batch(hybrid):
    local = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, micro_batches=1, schedule="async-1f1b",
                            engine="local", **CORRECTED)
    losses = [r.loss for r in local.train(batches("mlp", 5, size=SIZE))]
    merged = {**hybrid[0]["async-corrected"][1], **hybrid[1]["async-corrected"][1]}
    # The replicas' shards (7 and 6 samples) reduce to the whole batch's gradient up to float32 rounding.
    for name, value in local.state_dict().items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=0, msg=name)
    assert hybrid[0]["async-corrected"][0] == pytest.approx(losses, rel=1e-5)


def reference_global(bs, replicas=2):
    """One process, whole global batch, gradient accumulation over the replicas' micro-batches."""
    model = make("convbn")
    opt = sgd(model.parameters())
    for x, y in bs:
        opt.zero_grad()
        for xr, yr in zip(x.tensor_split(replicas), y.tensor_split(replicas)):
            for xb, yb in zip(xr.tensor_split(2), yr.tensor_split(2)):
                (torch.nn.functional.cross_entropy(model(xb), yb) * len(xb) / len(x)).backward()
        opt.step()
    return model


def test_replicas_stay_identical_and_reduction_is_counted(hybrid):
    for key in ("1f1b-hybrid", "async-stash", "async-corrected"):
        for stage_rank in (0, 1):
            a, b = hybrid[stage_rank][key][1], hybrid[stage_rank + 2][key][1]
            assert all(torch.equal(a[k], b[k]) for k in a if "running" not in k and "num_batches" not in k), key
    comm = hybrid[0]["1f1b-hybrid"][2]
    # predict() under data parallelism: every rank gets replica 0's output (eval mode: replicas agree).
    assert all(torch.equal(hybrid[r]["1f1b-hybrid"][3], hybrid[0]["1f1b-hybrid"][3]) for r in range(4))
    assert all(b > 0 for b in comm["data_parallel"]) and all(b > 0 for b in comm["activations"][:1])


def test_fp16_overflow_on_one_rank_skips_the_same_step_everywhere(hybrid):
    # The inf is injected on rank 3 during the second step (pipe.updates == 1): every rank skips
    # exactly that step, leaves its parameters untouched there, and halves its scale there only.
    for rank in range(4):
        skipped, scales, unchanged = hybrid[rank]["fp16"]
        assert skipped == [1], f"rank {rank} skipped steps {skipped}"
        assert scales == [2.0 ** 16, 2.0 ** 15], f"rank {rank} scales {scales}"
        assert unchanged == [False, True], f"rank {rank}: parameters unchanged per step {unchanged}"


def test_nan_on_one_replica_skips_the_same_step_on_every_rank(hybrid):
    for rank in range(4):
        skipped, error, state, _ = hybrid[rank]["nonfinite-skip"]
        reference = hybrid[rank]["nonfinite-reference"][2]
        assert error is None and skipped == [False, True, False], rank
        assert state.keys() == reference.keys() and all(torch.equal(state[k], reference[k]) for k in state), rank


def test_nan_on_one_replica_skips_the_same_async_update_on_every_rank(hybrid):
    for rank in range(4):
        skipped, _, state = hybrid[rank]["nonfinite-async-skip"]
        assert skipped == [False, False, True, False, False], rank
        assert all(torch.isfinite(v).all() for v in state.values()), rank
    for stage_rank in (0, 1):  # the replicas of each stage stay equal
        a, b = hybrid[stage_rank]["nonfinite-async-skip"][2], hybrid[stage_rank + 2]["nonfinite-async-skip"][2]
        assert all(torch.equal(a[k], b[k]) for k in a), stage_rank


def test_nan_on_one_replica_raises_on_every_rank(hybrid):
    for rank in range(4):
        results, error, state, before = hybrid[rank]["nonfinite-raise"]
        assert results == [False] and error is not None and "optimizer step 2" in error, (rank, error)
        assert all(torch.equal(state[k], before[k]) for k in state), rank  # nothing applied on any rank
        # The data-parallel reduction averages rank 3's NaN into rank 1's copy of stage 1 before the
        # check, so both stage-1 ranks name the parameter and the stage-0 ranks name the first of them.
        if rank in (1, 3):
            assert "stage 1, parameter" in error, error
        else:
            assert "found by rank 1 (stage 1, replica 0)" in error, error


def test_bf16_sends_half_the_bytes_and_trains():
    x, y = data("convbn", 12)
    sent = {}
    for precision in ("fp32", "bf16"):
        pipe = wrap_unprofiled(make("convbn"), x[:2], stages=2, micro_batches=3, precision=precision,
                               optimizer=sgd, partitioner="uniform", engine="local")
        losses = [pipe.step(x, y) for _ in range(3)]
        sent[precision] = pipe.last_result.comm_bytes
        assert losses[-1] < losses[0]
    assert sent["bf16"]["activations"][0] * 2 == sent["fp32"]["activations"][0]
    assert sent["bf16"]["activation_grads"][1] * 2 == sent["fp32"]["activation_grads"][1]


def test_fp16_local_engine_skips_overflowing_step_on_every_stage():
    x, y = data("mlp", 8)
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=3, micro_batches=2, precision="fp16", optimizer=sgd,
                           partitioner="uniform", engine="local")
    param = next(iter(pipe.held_stages[2].module.parameters()))
    param.register_hook(lambda g: g * float("inf") if pipe.updates == 1 else g)
    pipe.step(x, y)
    assert not pipe.last_result.skipped
    before = pipe.state_dict()
    pipe.step(x, y)  # overflow on the last stage only
    after = pipe.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "weight" in k or "bias" in k)
    assert pipe.last_result.skipped and pipe.skipped_steps == 1 and pipe.loss_scale == 2.0 ** 15


def test_local_engine_rejects_data_parallel_with_the_launch_command():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 4"):
        wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, data_parallel=2, engine="local")

"""ZeRO-1 and ZeRO-2 in hybrid mode: sharded optimizer state (and gradients) train exactly like zero=0.

The reference of every case is the same pipeline with zero=0 on the same gloo world, which
test_hybrid checks against one process on the global batch. An elementwise optimizer steps even slices
of the replicas' ranges (LARS whole tensors), each element with the same arithmetic as unsharded, and
each gradient is summed over the same replicas, so the parameters agree to float rounding of a differently
ordered sum (1e-6 is ~10 ulps of weights of order 1; most cases agree bit for bit).
"""
from __future__ import annotations

import gc
from unittest import mock

import pytest
import torch

import pipetrain
from dist_harness import run_world
from pipetrain.optim import LARS, linear_warmup
from runtime_models import data, lm_loss, make, sgd
from test_nonfinite import poison
from helpers import batches, wrap_unprofiled

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

TOL = 1e-6
SIZE = 13  # samples a mini-batch: uneven replica shards and micro-batches


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def lars(params):
    return LARS(params, lr=0.1, weight_decay=1e-4)


def adagrad(params):
    return torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1)  # state made at construction


def grouped(params):
    """Two groups with their own lr and weight decay, chosen by shape (a slice is flat: the groups must be the
    factory's, not re-chosen on slices)."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() <= 1], "lr": 0.03, "weight_decay": 0.0}],
                             lr=0.01)


OPTIMIZERS = {"sgd": sgd, "adam": adam, "adamw": adamw, "lars": lars, "adagrad": adagrad}
EVEN = ("sgd", "adam", "adamw", "adagrad", "grouped")  # elementwise: even slices (LARS: whole tensors)


ASYNC = {"stash": sgd, "2bw": sgd, "vanilla": sgd, "spectrain": adam, "nesterov": sgd}


def wrap(world, zero, **kw):
    options = dict(stages=2, micro_batches=2, data_parallel=world // 2, optimizer=adam, partitioner="uniform",
                   engine="distributed", zero=zero)
    options.update(kw)
    return wrap_unprofiled(make("mlp"), data("mlp", 2)[0], **options)


def state_bytes(pipe) -> int:
    return sum(t.numel() * t.element_size() for rt in pipe.held_stages.values() if rt.optimizer is not None
               for s in rt.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def written_bytes() -> int:
    """Bytes this process passed to write-like system calls: gloo sends with write/writev, so this counts
    what the rank put on the wire (and nothing else here: the ranks print nothing)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def measured(pipe, steps) -> dict:
    """Parameters after ``steps``, with what the rank held and sent doing it."""
    reducer = pipe.gradient_reducer
    sent_before, written = getattr(reducer, "sent_bytes", 0), written_bytes()
    for x, y in steps:
        pipe.step(x, y)
    measures = {"state": pipe.state_dict(), "wire": written_bytes() - written, "optimizer_bytes": state_bytes(pipe), "grad_bytes": reducer.gradient_bytes,
            "sent": getattr(reducer, "sent_bytes", 0) - sent_before, "payload": sum(
                p.numel() * p.element_size() for rt in pipe.held_stages.values() for p in rt.module.parameters()),
            "largest": max(p.numel() * p.element_size() for rt in pipe.held_stages.values()
                           for p in rt.module.parameters()),
            "padding": reducer.padding_bytes() if hasattr(reducer, "padding_bytes") else 0,
            "predicted": list(pipe.plan.stage_memory), "param_bytes": list(pipe.plan.param_bytes)}
    del reducer  # it holds the replicas' group
    # its groups' threads would otherwise poll until the world ends (the worlds make dozens)
    measures["close collected"] = closed(pipe)
    return measures


def closed(pipe) -> int:
    """Close ``pipe``: the garbage collections its close() ran to free its process groups (their threads), none
    where nothing of the pipeline holds a group in a reference cycle (a full collection takes ~0.5 s of CPU in
    a process holding a model's captured graphs)."""
    with mock.patch.object(gc, "collect", return_value=0) as collect:
        pipe.close()
    if collect.call_count:
        gc.collect()  # what the patched call did not free
    return collect.call_count


def training_cases(world) -> dict[str, dict]:
    """Case name -> wrap options: every optimizer, every sync schedule, bf16, the hierarchical reduction.
    Each case runs zero=0 and one sharded level (`LEVELS`; both for Adam on 1f1b), to keep the world short."""
    cases = {f"{name}-1f1b": dict(optimizer=opt) for name, opt in OPTIMIZERS.items()}
    cases.update({f"adam-{s}": dict(schedule=s) for s in ("gpipe", "interleaved-1f1b", "zb-h1")})
    cases.update({"adam-bf16": dict(precision="bf16"), "sgd-gpipe-bf16": dict(optimizer=sgd, schedule="gpipe",
                                                                               precision="bf16")})
    cases["adam-hierarchical"] = dict(allreduce="hierarchical", hierarchy=(world // 4, 2) if world >= 4 else None)
    cases["adamw-compressed-no-overlap"] = dict(optimizer=adamw, compress="bf16", overlap=False)
    # Per-group lr and weight decay survive the slicing; the global norm counts every element once.
    cases["grouped-clipped"] = dict(optimizer=grouped, max_grad_norm=0.05)
    return cases


def transformer(rank, world, zero):
    """bench_zero's Transformer classifier, small: 3 steps of 13 samples; parameters and counted bytes."""
    from pipetrain.apps.models import TransformerClassifier

    torch.manual_seed(0)
    model = TransformerClassifier(num_classes=10, in_features=4, width=64, depth=2, heads=2, max_len=8)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(39, 8, 4, generator=g), torch.randint(0, 10, (39,), generator=g)
    # Adam's eps well above rounding noise: the key bias of attention has a gradient of exactly 0 in real
    # arithmetic (softmax ignores it), which eps=1e-8 would divide by its own rounding noise, stepping it by
    # +-lr on the order of a 4-replica sum; eps=1e-3 keeps each update within ~lr * noise / eps.
    pipe = wrap_unprofiled(model, x[:2], stages=2, micro_batches=2, data_parallel=world // 2,
                           optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3), partitioner="params",
                           engine="distributed", zero=zero)
    return measured(pipe, [(x[13 * i:13 * (i + 1)], y[13 * i:13 * (i + 1)]) for i in range(3)])


def levels(case: str) -> tuple[int, ...]:
    """The sharded levels a training case runs besides zero=0."""
    if case == "adam-1f1b":
        return (1, 2)
    return (1 + list(training_cases(4)).index(case) % 2,)


def zero_scenarios(rank, world, checkpoint_dir):
    out = {}
    for case, kw in training_cases(world).items():
        for zero in (0, *levels(case)):
            out[(case, zero)] = measured(wrap(world, zero, **kw), batches("mlp", size=SIZE))
    for zero in (0, 1, 2):
        out[("transformer", zero)] = transformer(rank, world, zero)
    # A learning-rate schedule on each stage's optimizer (what a replica owns) follows zero=0's.
    for zero in (0, 2):
        pipe = wrap(world, zero)
        schedulers = [linear_warmup(rt.optimizer, 3, 0.1) for rt in pipe.held_stages.values() if rt.optimizer]
        for x, y in batches("mlp", size=SIZE):
            pipe.step(x, y)
            for s in schedulers:
                s.step()
        out[("warmup", zero)] = {"state": pipe.state_dict()}
        pipe.close()
    # fp16: an overflow on one rank skips the same step everywhere and halves the scale everywhere.
    for zero in (0, 1):
        pipe = wrap(world, zero, precision="fp16")
        if rank == world - 1:
            param = next(iter(pipe.held_stages[1].module.parameters()))
            param.register_hook(lambda g, pipe=pipe: g * float("inf") if pipe.updates == 1 else g)
        skipped = []
        for x, y in batches("mlp", size=SIZE):
            pipe.step(x, y)
            skipped.append(pipe.last_result.skipped)
        out[("fp16", zero)] = {"state": pipe.state_dict(), "skipped": skipped, "scale": pipe.loss_scale}
        pipe.close()
    # A NaN on one replica's last stage: skipped everywhere, or raised everywhere before anything moves.
    for zero, mode in ((0, "skip"), (2, "skip"), (1, "raise")):
        pipe = wrap(world, zero, nonfinite=mode)
        if rank == world - 1:
            poison(pipe, 1, lambda g, pipe=pipe: pipe.updates == 1)
        skipped, error, before = [], None, None
        try:
            for r in pipe.train(batches("mlp", size=SIZE)):
                skipped.append(r.skipped)
                before = pipe.state_dict()
        except pipetrain.NonFiniteError as e:
            error = str(e)
        out[(f"nonfinite-{mode}", zero)] = {"state": pipe.state_dict(), "skipped": skipped, "error": error,
                                            "before": before}
        pipe.close()
    # A weight tied across the two stages (embedding and output projection).
    for zero in (0, 1, 2):
        x, y = data("tied", 39)
        pipe = wrap_unprofiled(make("tied"), x[:2], stages=2, micro_batches=2, data_parallel=world // 2,
                               optimizer=adam, loss_fn=lm_loss, partitioner="uniform",
                               engine="distributed", zero=zero)
        for i in range(3):
            pipe.step(x[13 * i:13 * (i + 1)], y[13 * i:13 * (i + 1)])
        out[("tied", zero)] = {"state": pipe.state_dict(), "tied": pipe.plan.tied_groups()}
        pipe.close()
    # async-1f1b with every policy, replicated and sharded (the predicting ones read v all-gathered).
    for staleness, opt in ASYNC.items():
        for zero in (0, 1 + (staleness in ("2bw", "nesterov"))):
            pipe = wrap(world, zero, optimizer=opt, schedule="async-1f1b", staleness=staleness)
            losses = [r.loss for r in pipe.train(batches("mlp", 5, size=SIZE))]
            out[(f"async-{staleness}", zero)] = {"state": pipe.state_dict(), "losses": losses}
            pipe.close()
    if checkpoint_dir is not None:
        out.update(checkpoint_scenarios(world, checkpoint_dir))
    return out


def checkpoint_scenarios(world, root) -> dict:
    """Save after 2 steps at one zero level, resume at another, take the 3rd step: equals 3 steps straight."""
    out = {}
    bs = batches("mlp", size=SIZE)
    for saved_zero, loaded_zero in ((1, 0), (0, 2)):
        path = f"{root}/z{saved_zero}-d{world // 2}"
        pipe = wrap(world, saved_zero)
        for x, y in bs[:2]:
            pipe.step(x, y)
        pipe.save(path)
        pipe.close()
        resumed = wrap(world, loaded_zero)
        resumed.load(path)
        resumed.step(*bs[2])
        out[("resume", saved_zero, loaded_zero)] = {"state": resumed.state_dict(), "updates": resumed.updates}
        resumed.close()
    # SpecTrain predicts from the first mini-batch after a load: the resumed replicas need v at once.
    stream = batches("mlp", 4, size=SIZE)
    for zero in (0, 1):
        path = f"{root}/spectrain-z{zero}-d{world // 2}"
        pipe = wrap(world, zero, schedule="async-1f1b", staleness="spectrain")
        list(pipe.train(stream[:2]))
        pipe.save(path)
        pipe.close()
        resumed = wrap(world, zero, schedule="async-1f1b", staleness="spectrain")
        resumed.load(path)
        list(resumed.train(stream[2:]))
        out[("resume-spectrain", zero)] = {"state": resumed.state_dict()}
        resumed.close()
    return out


def four_replicas(rank, world, root):
    """A checkpoint saved by 2 replicas per stage (zero=1) resumed by 4 (zero=2), and by 4 with zero=0; and
    both levels of the hierarchical reduction (2 nodes x 2 replicas) sharded and not."""
    out = {}
    for zero in (2, 0):
        pipe = wrap(world, zero)
        pipe.load(f"{root}/z1-d2")
        pipe.step(*batches("mlp", size=SIZE)[2])
        out[zero] = pipe.state_dict()
        pipe.close()
    for zero in (0, 1):
        pipe = wrap(world, zero, allreduce="hierarchical", hierarchy=(2, 2))
        out[("hierarchical", zero)] = measured(pipe, batches("mlp", size=SIZE))
        out[("transformer", zero)] = transformer(rank, world, zero)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("zero-checkpoints")


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory, checkpoints):
    return run_world(4, "test_zero", "zero_scenarios", tmp_path_factory.mktemp("zero2x2"), str(checkpoints))


def assert_same(state, reference, tolerance=TOL, what=""):
    assert state.keys() == reference.keys(), what
    for k in reference:
        torch.testing.assert_close(state[k], reference[k], atol=tolerance, rtol=0, msg=f"{what} {k}")


@pytest.mark.parametrize("case", list(training_cases(4)))
def test_zero_trains_exactly_like_zero_0(two_replicas, case):
    for rank, out in enumerate(two_replicas):
        for zero in levels(case):
            assert_same(out[(case, zero)]["state"], out[(case, 0)]["state"], what=f"rank {rank} zero={zero}")


def test_tied_weights_on_two_stages_train_like_zero_0(two_replicas):
    for rank, out in enumerate(two_replicas):
        assert out[("tied", 0)]["tied"], "the split must put the tied copies on both stages"
        for zero in (1, 2):
            assert_same(out[("tied", zero)]["state"], out[("tied", 0)]["state"], what=f"rank {rank} zero={zero}")


def test_zero_moves_the_parameters(two_replicas):
    # Guards the comparison above: after 3 steps the weights are far from where they started.
    initial = make("mlp").state_dict()
    for out in two_replicas:
        state = out[("adam-1f1b", 1)]["state"]
        assert all((state[k] - initial[k]).abs().max() > 1e-3 for k in state)


def within_even_share(mine: dict, full: dict, D: int) -> bool:
    """An elementwise optimizer's state on one replica is its even range's: at most 1/D of the stage's
    (payload plus the buckets' padding, under one element per replica and bucket), at the stage's state per
    parameter byte (Adam: 2)."""
    return 0 < mine["optimizer_bytes"] <= full["optimizer_bytes"] / full["payload"] * (mine["payload"]
                                                                                     + mine["padding"]) / D


def test_optimizer_state_and_gradients_are_sharded(two_replicas):
    D = 2
    for rank, out in enumerate(two_replicas):
        full = out[("adam-1f1b", 0)]
        for zero in (1, 2):
            assert within_even_share(out[("adam-1f1b", zero)], full, D), (rank, zero)
        assert full["grad_bytes"] == full["payload"]
        assert out[("adam-1f1b", 1)]["grad_bytes"] == full["payload"]  # ZeRO-1 keeps the (unreduced) rest
        sharded = out[("adam-1f1b", 2)]
        assert 0 < sharded["grad_bytes"] <= (full["payload"] + sharded["padding"]) / D
    # Every elementwise optimizer and schedule, interleaved-1f1b's two chunks per device included, and bf16.
    cases = [c for c in training_cases(4) if c.split("-")[0] in EVEN and c != "adam-1f1b"]
    for case in cases:
        for rank, out in enumerate(two_replicas):
            assert within_even_share(out[(case, levels(case)[0])], out[(case, 0)], D), (case, rank)
    # LARS reads whole tensors: a replica owns whole ones, balanced to within one tensor's state (2x: momentum).
    for rank, out in enumerate(two_replicas):
        mine, full = out[("lars-1f1b", levels("lars-1f1b")[0])], out[("lars-1f1b", 0)]
        assert 0 < mine["optimizer_bytes"] <= full["optimizer_bytes"] / D + 2 * mine["largest"], rank
    # The replicas of a stage own disjoint ranges that cover the stage: their shares add up to zero=0's.
    for stage_rank in (0, 1):
        for case in ("adam-1f1b", "lars-1f1b"):
            shares = [two_replicas[stage_rank + 2 * r][(case, levels(case)[0])]["optimizer_bytes"] for r in range(D)]
            assert sum(shares) == two_replicas[stage_rank][(case, 0)]["optimizer_bytes"], case
        grads = [two_replicas[stage_rank + 2 * r][("adam-1f1b", 2)]["grad_bytes"] for r in range(D)]
        assert sum(grads) == two_replicas[stage_rank][("adam-1f1b", 0)]["payload"]


def test_transformer_stage_keeps_a_dth_of_the_optimizer_state(two_replicas, four):
    # bench_zero's Transformer (small): Adam's state counted on each replica is at most (1/D + 5%) of its
    # stage's at D = 2 and 4, and training is zero=0's; ZeRO-2 keeps as little of the reduced gradients.
    for D, world in ((2, two_replicas), (4, four)):
        for rank, out in enumerate(world):
            full = out[("transformer", 0)]
            for zero in ((1, 2) if D == 2 else (1,)):
                mine = out[("transformer", zero)]
                assert_same(mine["state"], full["state"], what=f"D={D} rank {rank} zero={zero}")
                assert 0 < mine["optimizer_bytes"] <= (1 / D + 0.05) * full["optimizer_bytes"], (D, rank, zero)
                assert within_even_share(mine, full, D), (D, rank, zero)
        for stage_rank in (0, 1):
            shares = [world[stage_rank + 2 * r][("transformer", 1)]["optimizer_bytes"] for r in range(D)]
            assert sum(shares) == world[stage_rank][("transformer", 0)]["optimizer_bytes"]
    for rank, out in enumerate(two_replicas):
        sharded = out[("transformer", 2)]
        assert 0 < sharded["grad_bytes"] <= (1 / 2 + 0.05) * out[("transformer", 0)]["grad_bytes"], rank


def test_planned_stage_memory_counts_the_optimizer_shard(two_replicas):
    # Adam keeps 2 bytes of state per parameter byte; with 2 replicas sharing it each holds half.
    for zero in (1, 2):
        full, sharded = two_replicas[0][("adam-1f1b", 0)], two_replicas[0][("adam-1f1b", zero)]
        for k, params in enumerate(full["param_bytes"]):
            assert full["predicted"][k] - sharded["predicted"][k] == pytest.approx(2 * params / 2), (zero, k)


def test_bytes_on_the_wire_equal_a_ring_all_reduce(two_replicas):
    # Reduce-scatter + all-gather send (D-1) N each over the group: 2 (D-1) N per step, a ring all-reduce's.
    D, steps = 2, 3
    for stage_rank in (0, 1):
        for case in ("adam-1f1b", "adam-hierarchical"):
            for zero in levels(case):
                sent = sum(two_replicas[stage_rank + 2 * r][(case, zero)]["sent"] for r in range(D))
                padded = two_replicas[stage_rank][(case, 0)]["payload"] + two_replicas[stage_rank][(case, zero)]["padding"]
                assert sent == steps * 2 * (D - 1) * padded, (case, zero)


@pytest.mark.parametrize("staleness", list(ASYNC))
def test_async_policies_train_like_zero_0(two_replicas, staleness):
    for rank, out in enumerate(two_replicas):
        zero = 1 + (staleness in ("2bw", "nesterov"))
        sharded, full = out[(f"async-{staleness}", zero)], out[(f"async-{staleness}", 0)]
        assert_same(sharded["state"], full["state"], what=f"rank {rank}")
        assert sharded["losses"] == pytest.approx(full["losses"], abs=TOL)


def test_wire_bytes_measured_per_rank_equal_zero_0(two_replicas):
    # Everything the ranks wrote to their sockets over 3 steps (activations and reports included, the same at
    # every level): reduce-scatter + all-gather put on the wire what gloo's all-reduce does, up to gloo's
    # per-message headers (~1.5% of these 2.4 kB buckets; 0.01% for bench_zero's 100 MB stages).
    for case in ("adam-1f1b", "sgd-1f1b"):
        for zero in levels(case):
            sharded = sum(out[(case, zero)]["wire"] for out in two_replicas)
            full = sum(out[(case, 0)]["wire"] for out in two_replicas)
            assert sharded == pytest.approx(full, rel=0.03), (case, zero, sharded, full)


def test_a_closed_pipeline_frees_its_process_groups_without_a_garbage_collection(two_replicas):
    # Every case: sgd, adam, LARS (whole tensors), schedules, bf16, the hierarchical and compressed reductions, at
    # zero 0 and a sharded level. The reducer's steps close over it and its buckets (a cycle close() breaks).
    for out in two_replicas:
        collected = {key: m["close collected"] for key, m in out.items() if isinstance(m, dict) and "close collected" in m}
        assert len(collected) >= 20 and not any(collected.values()), collected


def test_learning_rate_schedule_follows_zero_0(two_replicas):
    for out in two_replicas:
        assert_same(out[("warmup", 2)]["state"], out[("warmup", 0)]["state"])
        # ... and the schedule did act: the weights differ from training at the constant rate.
        warm, constant = out[("warmup", 2)]["state"], out[("adam-1f1b", 2)]["state"]
        assert all((warm[k] - constant[k]).abs().max() > 1e-4 for k in warm)


def test_fp16_overflow_on_one_rank_skips_the_same_step_everywhere(two_replicas):
    for rank, out in enumerate(two_replicas):
        assert out[("fp16", 1)]["skipped"] == [False, True, False], rank
        assert out[("fp16", 1)]["scale"] == out[("fp16", 0)]["scale"] == 2.0 ** 15
        assert_same(out[("fp16", 1)]["state"], out[("fp16", 0)]["state"], what=f"rank {rank}")


def test_nonfinite_gradient_on_one_replica_is_agreed_by_every_rank(two_replicas):
    for rank, out in enumerate(two_replicas):
        assert out[("nonfinite-skip", 2)]["skipped"] == [False, True, False], rank
        assert_same(out[("nonfinite-skip", 2)]["state"], out[("nonfinite-skip", 0)]["state"], what=f"rank {rank}")
        raised = out[("nonfinite-raise", 1)]
        assert raised["skipped"] == [False] and "optimizer step 2" in raised["error"], (rank, raised["error"])
        assert_same(raised["state"], raised["before"], tolerance=0.0, what=f"rank {rank}")  # nothing applied


def test_checkpoints_resume_at_another_zero_level(two_replicas):
    for rank, out in enumerate(two_replicas):
        straight = {0: out[("adam-1f1b", 0)]["state"], 1: out[("adam-1f1b", 1)]["state"],
                    2: out[("adam-1f1b", 2)]["state"]}
        for saved, loaded in ((1, 0), (0, 2)):
            resumed = out[("resume", saved, loaded)]
            assert resumed["updates"] == 3
            assert_same(resumed["state"], straight[0], what=f"rank {rank} saved zero={saved} loaded zero={loaded}")


@pytest.fixture(scope="module")
def four(two_replicas, checkpoints, tmp_path_factory):
    return run_world(8, "test_zero", "four_replicas", tmp_path_factory.mktemp("zero2x4"), str(checkpoints))


def test_spectrain_resumes_with_the_owners_v(two_replicas):
    for rank, out in enumerate(two_replicas):
        assert_same(out[("resume-spectrain", 1)]["state"], out[("resume-spectrain", 0)]["state"], what=f"rank {rank}")


def test_checkpoint_resumes_with_another_replica_count(two_replicas, four):
    for rank, out in enumerate(four):
        reference = two_replicas[rank % 2][("adam-1f1b", 0)]["state"]  # 3 straight steps, 2 replicas
        for zero in (2, 0):
            assert_same(out[zero], reference, what=f"rank {rank} zero={zero}")


def test_two_level_hierarchy_with_four_replicas(two_replicas, four):
    # Reduce-scatter inside each (emulated) node, then across the two; all-gather back the same way.
    for rank, out in enumerate(four):
        sharded, full = out[("hierarchical", 1)], out[("hierarchical", 0)]
        assert_same(sharded["state"], full["state"], what=f"rank {rank}")
        assert_same(full["state"], two_replicas[rank % 2][("adam-1f1b", 0)]["state"], what=f"rank {rank}")
        assert within_even_share(sharded, full, 4)
    for stage_rank in (0, 1):
        sent = sum(four[stage_rank + 2 * r][("hierarchical", 1)]["sent"] for r in range(4))
        padded = four[stage_rank][("hierarchical", 0)]["payload"] + four[stage_rank][("hierarchical", 1)]["padding"]
        assert sent == 3 * 2 * (4 - 1) * padded


@pytest.mark.parametrize("options, reason", [
    (dict(engine="local", data_parallel=2), "engine='local' runs no replicas"),
    (dict(engine="local", data_parallel=1), "data_parallel=1 has none"),
    (dict(zero=4), "zero must be 0"),
])
def test_zero_is_refused_where_there_is_nothing_to_shard(options, reason):
    options = {"zero": 1, **options}
    with pytest.raises(ValueError, match=reason):
        wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=2, **options)


def test_layout_planner_takes_zero_where_it_makes_a_layout_fit():
    from partitioners.planners.layout import evaluate_layout, search_layouts
    from schedules.cluster import Cluster
    from test_layout_planner import CLUSTER, chain_graph

    g = chain_graph(5, 7)
    # One stage: its cuts are the only ones, so the search below holds this very layout for its shape.
    kw = dict(replicas=2, micro_batches=2, schedule="1f1b", batch_size=32, profiled_batch=4)
    plain, sharded = evaluate_layout(g, CLUSTER, [0, 5], **kw), evaluate_layout(g, CLUSTER, [0, 5], zero=1, **kw)
    for a, b in zip(plain.stage_memory, sharded.stage_memory):
        # Adam's 2 state copies (param_memory_factor 4) are halved over 2 replicas; the rest is unchanged.
        assert b.optimizer == pytest.approx(a.optimizer / 2) and b.gradients == a.gradients
    assert sharded.step_time == plain.step_time
    free = search_layouts(g, CLUSTER, batch_size=32, profiled_batch=4, zeros=(0, 1))
    assert free[0].zero == 0  # as fast either way: zero=0 ranks first
    # A device memory between the two peaks: this shape fits only sharded, and the search finds it so.
    between = Cluster(**{**CLUSTER.__dict__, "memory": (max(plain.result.memory) + max(sharded.result.memory)) / 2})
    shape = lambda lay: (lay.cuts, lay.replicas, lay.micro_batches, lay.schedule)  # noqa: E731
    unsharded = [lay for lay in search_layouts(g, between, batch_size=32, profiled_batch=4) if shape(lay) == shape(plain)]
    both = [lay for lay in search_layouts(g, between, batch_size=32, profiled_batch=4, zeros=(0, 1))
            if shape(lay) == shape(plain) and lay.fits]
    assert unsharded and not unsharded[0].fits
    assert [lay.zero for lay in both] == [1]
    with pytest.raises(ValueError, match="ZeRO levels"):
        search_layouts(g, CLUSTER, batch_size=32, profiled_batch=4, zeros=(4,))


def test_owners_are_balanced_whole_tensors_around_fixed_ones():
    from pipetrain.allreduce.sharding import shard_owners

    tensors = [torch.zeros(n) for n in (10, 40, 30, 20, 5)]
    # Largest first to the least loaded: 40 -> 0, 30 -> 1, 20 -> 1, 10 -> 0, 5 -> 0 (50 and 55 bytes / 4).
    assert shard_owners(tensors, 2) == [0, 0, 1, 1, 0]
    # 30 on 0 first: 40 -> 1, 20 -> 0 (30 < 40), 10 -> 1 (40 < 50), 5 -> 0 (a tie at 50: the lower index).
    assert shard_owners(tensors, 2, {2: 0}) == [1, 1, 0, 0, 0]
    assert shard_owners(tensors, 1) == [0] * 5
    with pytest.raises(ValueError, match="fixed owners"):
        shard_owners(tensors, 2, {0: 2})


def replica_slices(params: list[torch.nn.Parameter], D: int, r: int) -> dict[int, torch.Tensor]:
    """Replica ``r``'s slices of ``params`` laid end to end in one bucket split evenly over ``D`` (the layout of
    pipetrain.allreduce.sharded)."""
    from pipetrain.allreduce.slices import slice_of

    total = sum(p.numel() for p in params)
    share = -(-total // D)
    lo, hi, out, offset = r * share, (r + 1) * share, {}, 0
    for p in params:
        if offset < hi and offset + p.numel() > lo:
            out[id(p)] = slice_of(p, max(lo - offset, 0), min(hi - offset, p.numel()))
        offset += p.numel()
    return out


ELEMENTWISE_FACTORIES = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.01),
    "adamw-groups": grouped,
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "adagrad": adagrad, "adamax": lambda ps: torch.optim.Adamax(ps, lr=0.01),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=0.01), "radam": lambda ps: torch.optim.RAdam(ps, lr=0.01),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE_FACTORIES))
def test_elementwise_optimizers_step_slices_exactly_like_whole_tensors(name):
    # 3 replicas' even slices (cutting tensors, the groups the factory chose on whole tensors) step like the
    # whole tensors, and their state, saved by name and merged, is the whole tensors'; loaded again it is cut
    # back into the same slices.
    from pipetrain.allreduce.slices import shards_evenly, source_of, step_slices
    from pipetrain.checkpoint.optimizer_state import (load_optimizer_state, merge_optimizer_shares,
                                                      optimizer_state_by_name)

    factory, D = ELEMENTWISE_FACTORIES[name], 3
    assert shards_evenly(factory)
    shapes = [(5, 7), (7,), (3, 5), (3,), (11,)]
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    models = [[torch.nn.Parameter(w.clone()) for w in initial] for _ in range(D + 1)]  # D replicas, the reference
    optimizers = [factory(ps) for ps in models]
    slices = [replica_slices(models[r], D, r) for r in range(D)]
    for r in range(D):
        step_slices(optimizers[r], slices[r])
    for step in grads:
        for ps, opt in zip(models, optimizers):
            for p, g in zip(ps, step):
                p.grad = g.clone()
        for r in range(D):  # a slice's gradient is its range of the parameter's
            for t in slices[r].values():
                source, start = source_of(t)
                t.grad = source.grad.view(-1)[start:start + t.numel()]
        for opt in optimizers:
            opt.step()
    for r in range(D):  # each replica's own range moved as the whole tensors did
        for t in slices[r].values():
            source, start = source_of(t)
            whole = models[D][[id(p) for p in models[r]].index(id(source))].detach().view(-1)
            torch.testing.assert_close(t, whole[start:start + t.numel()], atol=0, rtol=0)
    names = [{id(p): f"w{i}" for i, p in enumerate(ps)} for ps in models]
    merged = merge_optimizer_shares([optimizer_state_by_name(optimizers[r], names[r]) for r in range(D)])
    expected = optimizer_state_by_name(optimizers[D], names[D])
    assert merged["groups"] == expected["groups"] and merged["state"].keys() == expected["state"].keys()
    for n, state in expected["state"].items():
        assert merged["state"][n].keys() == state.keys()
        for k, v in state.items():
            torch.testing.assert_close(torch.as_tensor(merged["state"][n][k]), torch.as_tensor(v), atol=0, rtol=0)
    fresh = [torch.nn.Parameter(w.clone()) for w in initial]
    resumed = factory(fresh)
    step_slices(resumed, replica_slices(fresh, D, 1))
    load_optimizer_state(resumed, merged["state"], merged["groups"], {id(p): f"w{i}" for i, p in enumerate(fresh)})
    for group, saved in zip(resumed.param_groups, optimizers[1].param_groups):
        for t, u in zip(group["params"], saved["params"]):
            for k, v in optimizers[1].state[u].items():
                torch.testing.assert_close(torch.as_tensor(resumed.state[t][k]), torch.as_tensor(v), atol=0, rtol=0)


def test_optimizers_reading_whole_tensors_keep_whole_tensor_ownership():
    from pipetrain.allreduce.slices import shards_evenly

    class ClippedAdam(torch.optim.Adam):  # a subclass may step by another rule: not taken for elementwise
        pass

    assert shards_evenly(adam) and shards_evenly(sgd)
    assert not shards_evenly(lars)
    assert not shards_evenly(lambda ps: ClippedAdam(ps, lr=0.01))
    assert not shards_evenly(lambda ps: torch.optim.LBFGS(ps))

"""ZeRO-3 on torch's FSDP2 in hybrid mode: parameters, gradients and optimizer state sharded over a stage's
replicas, training exactly like the unsplit model.

The reference is the unsplit model trained in this process on the same global mini-batches, accumulated over
the same sample groups (2 replicas x 2 micro-batches of 13 samples: 4, 3, 3, 3; `reference_training` with 4
micro-batches). A gloo reduce-scatter that summed instead of averaging would double every update, far
outside the tolerance: 1e-5 covers the float32 rounding of sums taken in another order (weights of order 1,
three steps). bf16 and fp16 compare with zero=0 on the same world, whose own exactness test_hybrid checks.
"""
from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pipetrain
from dist_harness import run_world
from helpers import batches, optimizer_collectives, wrap_unprofiled
import third_party_models
from runtime_models import data, loss_fn, make, reference_training, sgd
from pipetrain.runtime.local_shards import gathered_bytes, local_bytes
from test_meta_models import on_meta, save_checkpoint, trained_reference
from test_third_party_models import MICRO, assert_same_state
from test_third_party_models import sgd as meta_sgd

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

SIZE = 13
TOL = 1e-5
MAX_NORM = 0.05  # below the first steps' gradient norms (~0.3): every step clips
PREDICTED = data("mlp", SIZE, seed=5)  # predicted after three steps, then a fourth step's mini-batch


# Adam and LAMB divide by sqrt(v) + eps: a gradient of ~0 whose float32 rounding d (~1e-7 of its terms' scale, the
# replicas' reduce-scatter summing in another order than the reference) differs by kernel would move a weight by up to
# lr * d / eps. eps = 1e-3 bounds that by 1e-2 * 1e-7 / 1e-3 = 1e-6 a step, 3e-6 over three steps: within TOL on any
# CPU's kernels (at torch's eps, 1e-8, the bound is a whole lr step; see docs/exactness.md).
ROUNDING_EPS = 1e-3


def adam(params):
    return torch.optim.Adam(params, lr=0.01, eps=ROUNDING_EPS)


def lars(params):
    """LARS with a trust coefficient that makes each step move weights by ~1e-2 of their norm: a trust ratio taken
    from a replica's shard alone (its norms ~1/sqrt(2) of the whole tensor's) would be off by far more than TOL."""
    return pipetrain.optim.LARS(params, lr=1.0, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.01)


def lamb(params):
    """LAMB reads whole tensors too (its trust ratio ||w|| / ||r||); each step moves a weight by ~lr of its norm."""
    return pipetrain.optim.LAMB(params, lr=0.01, weight_decay=0.01, eps=ROUNDING_EPS)


CASES = {  # name -> (model, wrap options); every case: 2 stages x 2 replicas, zero=3, SGD with momentum (Adam,
    # nearly invariant to the gradient's scale, would hide a reduction that sums instead of averaging)
    "1f1b": ("mlp", dict(schedule="1f1b")),
    "1f1b-adam": ("mlp", dict(schedule="1f1b", optimizer=adam)),
    # LARS reads whole tensors (its trust ratio): each replica steps its shard of every tensor, norms over the whole
    "1f1b-lars": ("mlp", dict(schedule="1f1b", optimizer=lars)),
    "1f1b-lamb": ("mlp", dict(schedule="1f1b", optimizer=lamb)),
    "interleaved-1f1b": ("mlp", dict(schedule="interleaved-1f1b")),
    "zb-h1": ("mlp", dict(schedule="zb-h1")),
    **{s: ("mlp", dict(schedule=s)) for s in ("zbv", "dualpipev", "interleaved-zb")},  # split backward, 2 chunks
    "1f1b-reshard-after-forward": ("mlp", dict(schedule="1f1b", reshard_after_forward=True)),
    "zb-h1-reshard-after-forward-recompute": ("mlp", dict(schedule="zb-h1", reshard_after_forward=True,
                                                          recompute="always")),
    "gpipe-clipped": ("mlp", dict(schedule="gpipe", max_grad_norm=MAX_NORM)),
    "1f1b-tied": ("tied", dict(schedule="1f1b")),
}
LOW_PRECISION = ("bf16", "fp16")


class PeakBytes(TorchDispatchMode):
    """The largest number of bytes that storages of floating tensors made under this mode held at once (a storage's
    Python object lives exactly as long as the storage, so a weak reference to it sees it freed). A DTensor's
    local shard is counted, not its global size."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, DTensor):  # a wrapper: its local shard holds the bytes (made out of this mode's sight)
                t = t.to_local()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    weakref.finalize(storage, self.live.pop, key, None)
                    self.peak = max(self.peak, sum(self.live.values()))
        return out


def wrap(model: str, world_replicas: int = 2, stages: int = 2, **kw) -> pipetrain.Pipeline:
    options = dict(stages=stages, micro_batches=2, data_parallel=world_replicas, optimizer=sgd, partitioner="uniform",
                   engine="distributed", loss_fn=loss_fn(model), zero=3)
    options.update(kw)
    return wrap_unprofiled(make(model), data(model, 2)[0], **options)


def held_now(pipe: pipetrain.Pipeline) -> dict:
    """Bytes this rank holds now of its stage's parameters (its shards, and the whole tensors FSDP2 gathered and
    did not free) and optimizer state, against the whole stage's."""
    stages = list(pipe.held_stages.values())
    params = [p for rt in stages for p in rt.params]
    states = [t for rt in stages for s in rt.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"parameters": sum(p.to_local().nbytes for p in params), "whole parameters": sum(p.nbytes for p in params),
            "gathered": sum(gathered_bytes(rt.module) for rt in stages),
            "optimizer": sum(t.to_local().nbytes for t in states), "whole optimizer": sum(t.nbytes for t in states)}


def held_bytes(pipe: pipetrain.Pipeline, steps) -> dict:
    """`held_now` after ``steps``, with the gradients the optimizer stepped at the last one."""
    seen: dict[str, int] = {}

    def at_step(optimizer, args, kwargs) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen["gradients"] = seen.get("gradients", 0) + sum(g.to_local().nbytes for g in grads)
        seen["whole gradients"] = seen.get("whole gradients", 0) + sum(g.nbytes for g in grads)

    stages = list(pipe.held_stages.values())
    for rt in stages:
        rt.optimizer.register_step_pre_hook(at_step)
    for x, y in steps:
        seen.clear()
        pipe.step(x, y)
    return {**held_now(pipe), **seen}


def zero3_scenarios(rank: int, world: int, root: str, llama_weights: str) -> dict:
    out = {}
    steps = batches("mlp", size=SIZE)
    for case, (model, kw) in CASES.items():
        pipe = wrap(model, **kw)
        collectives = optimizer_collectives(pipe)
        out[case] = [r.loss for r in pipe.train(batches(model, size=SIZE))], pipe.state_dict()
        out["collectives", case] = collectives
        # Closed, its groups' threads end. The next pipeline's meshes span the same ranks: their DTensors must
        # not run on the destroyed groups (DeviceMesh equality ignores groups; see fully_sharded._dim_name).
        pipe.close()
    for precision in LOW_PRECISION:
        for zero in (0, 3):
            for name, optimizer in (("sgd", sgd), ("lars", lars)):
                pipe = wrap("mlp", precision=precision, zero=zero, optimizer=optimizer)
                out[(precision, zero, name)] = [r.loss for r in pipe.train(steps)], pipe.state_dict()
                pipe.close()
    # A NaN in one sample of replica 1's half of mini-batch 1: every rank raises (or skips) that step, then trains on.
    bad = steps[1][0].clone(), steps[1][1]
    bad[0][SIZE - 2] = float("nan")
    for mode in ("raise", "skip"):
        pipe = wrap("mlp", nonfinite=mode)
        pipe.step(*steps[0])
        try:
            pipe.step(*bad)
            outcome = "skipped" if pipe.last_result.skipped else "stepped"
        except pipetrain.NonFiniteError:
            outcome = "raised"
        pipe.step(*steps[2])
        out["nonfinite", mode] = outcome, pipe.state_dict()
        pipe.close()
    # Memory: 2 stages x 2 replicas, and 1 stage x 4 replicas; then a predict, after which each replica must hold
    # its share only, as after a step, and one more step, which must train as the unsplit model does.
    x, y = PREDICTED
    for replicas, stages in ((2, 2), (4, 1)):
        pipe = wrap("mlp", world_replicas=replicas, stages=stages, optimizer=adam)
        out["bytes", replicas] = held_bytes(pipe, steps)
        prediction = pipe.predict(x)
        out["predict", replicas] = held_now(pipe), prediction
        pipe.step(x, y)
        out["after predict", replicas] = pipe.state_dict()
        pipe.close()
    # HSDP: 4 replicas on 2 nodes of 2 (sharded inside a node, replicated across), clipped by the global norm.
    pipe = wrap("mlp", world_replicas=4, stages=1, hierarchy=(2, 2), max_grad_norm=MAX_NORM)
    out["hsdp"] = [r.loss for r in pipe.train(steps)], pipe.state_dict(), [
        tuple(p.to_local().shape) for rt in pipe.held_stages.values() for p in rt.params]
    pipe.close()
    # A Llama on the meta device read from a checkpoint, 1 stage x 4 replicas: each rank makes its own shards only.
    case = third_party_models.CASES["llama"]
    with PeakBytes() as counter:
        pipe = pipetrain.wrap(on_meta("llama"), case.batch(2, 0)[0], stages=1, micro_batches=MICRO, data_parallel=4,
                              loss_fn=case.loss_fn, optimizer=meta_sgd, engine="distributed", zero=3,
                              weights=llama_weights)
    (stage,) = pipe.held_stages.values()
    tensors = [*stage.params, *stage.module.buffers()]
    made = {"peak": counter.peak, "own": sum(local_bytes(t) for t in tensors),
            "largest": max(t.numel() * t.element_size() for t in tensors),
            "whole": sum(t.numel() * t.element_size() for t in tensors)}
    for seed in (1, 2):
        pipe.step(*case.batch(8, seed))
    out["meta"] = made, pipe.state_dict()
    pipe.close()
    # A checkpoint saved at 2 stages x 2 replicas resumes at 1 stage x 4 replicas.
    pipe = wrap("mlp", optimizer=adam)
    list(pipe.train(steps[:2]))
    pipe.save(Path(root) / "ckpt")
    pipe.close()
    resumed = wrap("mlp", world_replicas=4, stages=1, optimizer=adam)
    resumed.load(Path(root) / "ckpt")
    list(resumed.train(steps[2:]))
    out["resumed"] = resumed.state_dict()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("zero3")
    llama_weights = save_checkpoint("llama", "sharded", root / "llama")
    return run_world(4, "test_zero3", "zero3_scenarios", root, str(root), str(llama_weights))


def merged(ranks: list[dict], key) -> dict[str, torch.Tensor]:
    """Replica 0's state, both stages (ranks 0 and 1), after checking every replica holds the same."""
    for stage in (0, 1):
        for name, value in ranks[stage][key][1].items():
            assert torch.equal(value, ranks[2 + stage][key][1][name]), (key, name)
    return {**ranks[0][key][1], **ranks[1][key][1]}


def reference(model: str, kw: dict) -> torch.nn.Module:
    optimizer = kw.get("optimizer", sgd)
    if "max_grad_norm" not in kw:
        return reference_training(model, batches(model, size=SIZE), 4, optimizer)
    ref = make(model)
    opt = optimizer(ref.parameters())
    for x, y in batches(model, size=SIZE):
        opt.zero_grad()
        for xb, yb in zip(x.tensor_split(4), y.tensor_split(4)):
            (loss_fn(model)(ref(xb), yb) * (len(xb) / len(x))).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), kw["max_grad_norm"])
        opt.step()
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_zero3_trains_like_the_unsplit_model(ranks: list[dict], case: str) -> None:
    model, kw = CASES[case]
    state = merged(ranks, case)
    ref = reference(model, kw).state_dict()
    assert state.keys() >= ref.keys()
    for name, value in ref.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=f"{case} {name}")
    before = make(model).state_dict()
    assert all((state[n] - before[n]).abs().max() > 10 * TOL for n in before)  # every tensor trained, beyond TOL


@pytest.mark.parametrize("case", ["1f1b-lars", "1f1b-lamb"])
def test_trust_ratios_read_whole_tensors_with_one_all_reduce_per_step(ranks: list[dict], case: str) -> None:
    # Each stage's optimizer holds FSDP2 shards of its weights (2-D, with a trust ratio) and biases (1-D, without):
    # the weights' and their gradients' (LAMB: updates') squared norms, summed over the 2 replicas in one all-reduce
    # per step, where DTensor's own norms would take one per tensor and norm. Trained exactly: the test above.
    steps = len(batches("mlp", size=SIZE))
    assert [rank["collectives", case] for rank in ranks] == [[1] * steps] * len(ranks)


@pytest.mark.parametrize("optimizer", ["sgd", "lars"])
@pytest.mark.parametrize("precision", LOW_PRECISION)
def test_zero3_in_low_precision_trains_like_zero0(ranks: list[dict], precision: str, optimizer: str) -> None:
    # LARS: the recipe's mixed precision over FSDP2 shards, its trust ratios from the shards' norms.
    state, reference_state = merged(ranks, (precision, 3, optimizer)), merged(ranks, (precision, 0, optimizer))
    for name, value in reference_state.items():
        # The same autocast computation on the same weights; only the reduction's summation order differs (and
        # LARS's norms': a trust ratio off by float32 rounding, ~1e-7 of it, moves a weight by ~1e-9 here).
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0, msg=name)
    losses = ranks[0][(precision, 3, optimizer)][0]
    assert losses == pytest.approx(ranks[0][(precision, 0, optimizer)][0], rel=1e-6)


@pytest.mark.parametrize("mode, outcome", [("raise", "raised"), ("skip", "skipped")])
def test_a_nan_on_one_replica_stops_the_step_everywhere_and_training_goes_on(ranks: list[dict], mode: str,
                                                                             outcome: str) -> None:
    steps = batches("mlp", size=SIZE)
    ref = reference_training("mlp", [steps[0], steps[2]], 4, sgd).state_dict()  # the bad step never happened
    for rank in (0, 1):
        assert ranks[rank]["nonfinite", mode][0] == ranks[rank + 2]["nonfinite", mode][0] == outcome, rank
    state = {**ranks[0]["nonfinite", mode][1], **ranks[1]["nonfinite", mode][1]}
    for name, value in ref.items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=f"{mode} {name}")


@pytest.mark.parametrize("replicas", [2, 4])
def test_each_replica_holds_a_quarter_or_half_of_its_stage(ranks: list[dict], replicas: int) -> None:
    for rank, r in enumerate(ranks):
        held = r["bytes", replicas]
        mine = held["parameters"] + held["gradients"] + held["optimizer"]
        whole = held["whole parameters"] + held["whole gradients"] + held["whole optimizer"]
        assert held["whole optimizer"] == 2 * held["whole parameters"] > 0  # Adam's two moments of every tensor
        assert held["whole gradients"] == held["whole parameters"]  # every tensor has its gradient at the step
        assert mine <= (1 / replicas + 0.05) * whole, (rank, held)
        assert held["optimizer"] <= (1 / replicas + 0.05) * held["whole optimizer"], (rank, held)


@pytest.mark.parametrize("replicas", [2, 4])
def test_after_predict_each_replica_holds_its_share_and_the_next_step_trains_exactly(ranks: list[dict],
                                                                                     replicas: int) -> None:
    steps = batches("mlp", size=SIZE)
    trained = reference_training("mlp", steps, 4, adam).eval()
    with torch.no_grad():
        expected = trained(PREDICTED[0])
    ref = reference_training("mlp", [*steps, PREDICTED], 4, adam).state_dict()
    seen = set()
    for rank, r in enumerate(ranks):
        held, prediction = r["predict", replicas]
        # What the forward gathered is freed: the shards and optimizer state are all a replica keeps.
        mine = held["parameters"] + held["gathered"] + held["optimizer"]
        assert mine <= (1 / replicas + 0.05) * (held["whole parameters"] + held["whole optimizer"]), (rank, held)
        torch.testing.assert_close(prediction, expected, atol=TOL, rtol=0, msg=f"rank {rank}")
        for name, value in r["after predict", replicas].items():
            torch.testing.assert_close(value, ref[name], atol=TOL, rtol=0, msg=f"rank {rank} {name}")
            seen.add(name)
    assert seen == ref.keys()


def test_hsdp_shards_inside_a_node_and_trains_like_the_unsplit_model(ranks: list[dict]) -> None:
    ref = reference("mlp", dict(max_grad_norm=MAX_NORM))
    for rank, r in enumerate(ranks):
        losses, state, shards = r["hsdp"]
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=f"rank {rank} {name}")
        # Each tensor cut in 2 (the replicas of a node), not 4: the other node holds the same shards.
        whole = [tuple(p.shape) for p in make("mlp").parameters()]
        assert shards == [((n + 1) // 2, *rest) if rank % 2 == 0 else (n // 2, *rest) for n, *rest in whole], rank


def test_a_meta_model_makes_only_each_ranks_shards_and_trains_like_the_unsplit_model(ranks: list[dict]) -> None:
    for rank, r in enumerate(ranks):
        made, state = r["meta"]
        # Its shards and buffers, twice while FSDP2 pads them in to_empty, plus one whole tensor being cut and
        # small temporaries: at 4 replicas that is about half the whole stage, which the old path held at once.
        bound = 2 * made["own"] + made["largest"] + 1024
        assert made["own"] <= made["peak"] <= bound < made["whole"], (rank, made)
        assert_same_state(state, trained_reference("llama"), exact=False)


def test_a_zero3_checkpoint_resumes_at_another_stage_and_replica_count(ranks: list[dict]) -> None:
    state = {**ranks[0]["resumed"]}
    for r in ranks[1:]:
        for name, value in r["resumed"].items():
            assert torch.equal(value, state[name]), name
    for name, value in reference_training("mlp", batches("mlp", size=SIZE), 4, adam).state_dict().items():
        torch.testing.assert_close(state[name], value, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("options, message", [
    (dict(schedule="async-1f1b", staleness="stash"), "zero=3 with schedule='async-1f1b'"),
    (dict(compile=True), "zero=3 with compile"),
])
def test_what_zero3_does_not_run_is_refused_with_the_fix(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipetrain.wrap(make("mlp"), data("mlp", 2)[0], stages=2, data_parallel=2, zero=3, **options)


def test_reshard_after_forward_needs_zero3() -> None:
    with pytest.raises(ValueError, match="use zero=3"):
        pipetrain.wrap(make("mlp"), data("mlp", 2)[0], stages=2, data_parallel=2, zero=1, reshard_after_forward=True)

"""Sequence parallelism (a tp_plan naming modules 'sequence_parallel') trains exactly like the unsplit model, and
keeps what runs between the row- and column-parallel layers on each rank's slice of the sequence.

The same two models and references as `test_tensor_parallel` (the tiny Llama with grouped-query attention, its own
plan plus its norms named 'sequence_parallel'; the plain MLP, its pairs named by hand, where the "sequence" is the
micro-batch's rows), at 2 stages x T=2 on 4 gloo ranks, three AdamW steps, in float64 with its TOL, as there (its
docstring derives it): the ranks' partial sums are reduce-scattered instead of all-reduced, the same sums in another
order. A slice's gradient not summed over
the ranks (a norm's weight), or a reduce-scatter whose backward did not gather, is off by a factor of 2 or leaves
whole slices' gradients at zero, far outside it.
"""
from __future__ import annotations

import pytest
import torch

from dist_harness import run_world
from pipetrain.tensor_parallel.collectives import ColumnsFromSlices, GatherToLanes, ScatterSumOverLanes
from test_tensor_parallel import (EXACT, LOW, SEQUENCE_NORMS, STEPS, TOL, assert_close_states,
                                  assert_trained_like_the_unsplit_model, gathered, llama, reference, sgd, steps_in,
                                  wrap)

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

PLANS = {  # name -> tp_plan with sequence parallelism
    "llama": {**llama().tp_plan, **SEQUENCE_NORMS},
    # 8 -> 16 -> 16 (colwise, rowwise), Tanh on the rows' slices, 16 -> 16 -> 16 (colwise, rowwise), 16 -> 4 whole
    "mlp": {"0": "colwise", "2": "rowwise", "3": "sequence_parallel", "4": "colwise", "6": "rowwise"},
}

# The Llama under the split backward (B then W: the fused colwise call's backward, gathering its slices again, runs
# for each), with recomputation, and under bf16 autocast (its matmuls and their backward in bf16).
VARIANTS = {"zb-h1": dict(schedule="zb-h1"), "zb-h1-recompute": dict(schedule="zb-h1", recompute="always"),
            "bf16": dict(precision="bf16", optimizer=sgd, dtype=LOW)}


def saved_bytes(pipe, x, y) -> int:
    """Bytes of the storages autograd saves tensors in during one step on this rank, each counted once (they are
    kept alive until the end, so no address is reused by a later micro-batch's)."""
    seen: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pipe.step(x, y)
    return sum(t.untyped_storage().nbytes() for t in seen.values())


def scenarios(rank: int, world: int) -> dict:
    out: dict = {}
    for name, plan in PLANS.items():
        steps = steps_in(name)
        pipe = wrap(name, tp_plan=plan)
        out[name, "collectives"] = sorted({type(m).__name__ for rt in pipe.held_stages.values()
                                           for m in rt.module.modules()
                                           if isinstance(m, (ScatterSumOverLanes, GatherToLanes, ColumnsFromSlices))})
        out[name, "losses"] = [pipe.step(x, y) for x, y in steps[:STEPS]]
        out[name, "state"] = {k: v.clone() for k, v in pipe.state_dict().items()}  # before one more step
        out[name, "saved", "sequence"] = saved_bytes(pipe, *steps[STEPS])
        pipe.close()
        pipe = wrap(name, tp_plan={k: v for k, v in plan.items() if v != "sequence_parallel"})
        for x, y in steps[:STEPS]:  # the same step of the same training, without sequence parallelism
            pipe.step(x, y)
        out[name, "saved", "whole"] = saved_bytes(pipe, *steps[STEPS])
        pipe.close()
    for variant, options in VARIANTS.items():
        pipe = wrap("llama", tp_plan=PLANS["llama"], **options)
        for x, y in steps_in("llama", options.get("dtype", EXACT))[:STEPS]:
            pipe.step(x, y)
        out[variant] = pipe.state_dict()
        pipe.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(4, "test_sequence_parallel", "scenarios", tmp_path_factory.mktemp("sequence_parallel"))


@pytest.mark.parametrize("name", PLANS)
def test_three_adamw_steps_equal_the_unsplit_model(ranks, name):
    assert_trained_like_the_unsplit_model(ranks, name)


def test_row_parallel_outputs_are_reduce_scattered_and_gathered_for_the_next_column_parallel_layers(ranks):
    for result in ranks:
        # every stage: q/k/v and gate/up each read their slices gathered, together
        assert result["llama", "collectives"] == ["ColumnsFromSlices", "ScatterSumOverLanes"]
        # the MLP's stages each end a pair; the second starts at a column-parallel layer, its input arriving whole
        assert result["mlp", "collectives"] == ["ScatterSumOverLanes"]


@pytest.mark.parametrize("name", PLANS)
def test_what_runs_on_the_slices_saves_less_for_backward(ranks, name):
    for result in ranks:
        assert result[name, "saved", "sequence"] < result[name, "saved", "whole"]


@pytest.mark.parametrize("variant", ["zb-h1", "zb-h1-recompute"])
def test_the_split_backward_and_recomputation(ranks, variant):
    want, _, _ = reference("llama", STEPS)
    assert_close_states(gathered(ranks, variant), want)


def test_bf16_errs_no_more_than_the_unsplit_model_does(ranks):
    """As test_tensor_parallel's check: within twice the unsplit autocast model's own distance from float32."""
    exact, _, _ = reference("llama", STEPS, optimizer=sgd, dtype=LOW)
    rounded, _, _ = reference("llama", STEPS, autocast=torch.bfloat16, optimizer=sgd, dtype=LOW)
    got = gathered(ranks, "bf16")
    own = max((rounded[k] - exact[k]).abs().max().item() for k in exact if k in got)
    split = max((got[k] - exact[k]).abs().max().item() for k in exact if k in got)
    assert 0 < split <= 2 * own + TOL, (split, own)

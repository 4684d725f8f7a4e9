"""Tensor parallelism's plan without ranks: which layers a plan names, how a stage graph's splits are placed or
refused, and stage boundaries kept off split values. The split graphs' training is checked against the unsplit
model on gloo ranks in test_tensor_parallel.py."""
from __future__ import annotations

import networkx as nx
import pytest
import torch
import transformers as hf
from torch import nn

import partitioners
import pipetrain
from helpers import wrap_unprofiled
from pipetrain.assembly.tensor_split import keep_split_values_in_stages
from pipetrain.tensor_parallel import Lanes, TensorParallelError, TensorParallelPlan
from pipetrain.tensor_parallel.automatic import linear_pairs
from pipetrain.tensor_parallel.placement import split_stage
from pipetrain.tensor_parallel.shapes import whole_shapes

UNRUN = Lanes(None, 2, 0)  # the walk builds the collectives; these tests never run them


def test_patterns_match_a_name_or_its_suffix_with_star_for_one_component():
    plan = TensorParallelPlan({"layers.*.mlp.up_proj": "colwise", "lm_head": "colwise_rep"}, "tp_plan=")
    assert plan.style_of("model.layers.3.mlp.up_proj") == "colwise"
    assert plan.style_of("layers.12.mlp.up_proj") == "colwise"
    assert plan.style_of("model.layers.3.extra.mlp.up_proj") == "replicate"  # * is one component
    assert plan.style_of("model.layers.3.mlp.up_proj_2") == "replicate"
    assert plan.style_of("lm_head") == "colwise_gather_output"  # HF's alias
    exact = TensorParallelPlan({"0": "colwise"}, "automatic", exact=True)
    assert exact.style_of("0") == "colwise" and exact.style_of("layers.0") == "replicate"


def test_a_style_pipetrain_does_not_run_is_refused_with_its_fix():
    with pytest.raises(ValueError, match="'packed_colwise' of 'experts.gate_up_proj'.*replicate"):
        TensorParallelPlan({"experts.gate_up_proj": "packed_colwise"}, "tp_plan=")


def test_options_refuse_what_tensor_parallelism_does_not_run():
    with pytest.raises(ValueError, match="tensor_parallel=2 with schedule='async-1f1b'"):
        pipetrain.PipelineOptions(tensor_parallel=2, schedule="async-1f1b", staleness="stash")
    with pytest.raises(ValueError, match="tp_plan.*tensor_parallel=1"):
        pipetrain.PipelineOptions(tp_plan={"fc": "colwise"})
    with pytest.raises(ValueError, match="torchrun"):
        pipetrain.PipelineOptions(tensor_parallel=2, engine="local")
    with pytest.raises(ValueError, match="tensor_parallel=2 with compile"):
        pipetrain.PipelineOptions(tensor_parallel=2, compile=True)


def traced(model: nn.Module, x) -> partitioners.CostGraph:
    """The model as pipetrain captures it (its cost graph)."""
    pipe = wrap_unprofiled(model, x, stages=1, micro_batches=1, engine="local", loss_fn=pipetrain.model_loss)
    return pipe.plan.graph


def mlp_graph(hidden: int = 8) -> tuple[torch.fx.GraphModule, dict]:
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    graph = traced(model, torch.randn(3, 4))
    return graph.module, whole_shapes(graph.module, torch.randn(3, 4))


def test_the_automatic_plan_pairs_consecutive_linear_layers_and_gathers_the_rest():
    module, _ = mlp_graph()
    assert linear_pairs(module, 2).patterns == {"0": "colwise", "2": "rowwise", "4": "colwise_gather_output"}
    # 3 hidden features do not divide over 2 ranks: no pair; the layers whose outputs divide are gathered
    odd, _ = mlp_graph(hidden=3)
    assert linear_pairs(odd, 2).patterns == {"2": "colwise_gather_output", "4": "colwise_gather_output"}


def test_a_split_read_whole_or_a_planned_layer_called_otherwise_is_refused_by_name():
    module, shapes = mlp_graph()
    with pytest.raises(TensorParallelError, match="whole layer '2' reads features split.*split by '0'"):
        split_stage(module, TensorParallelPlan({"0": "colwise"}, "tp_plan=", exact=True), UNRUN, shapes, "stage 0")
    module, shapes = mlp_graph()
    plan = TensorParallelPlan({"0": "colwise", "2": "rowwise", "3": "colwise"}, "tp_plan=", exact=True)  # 3: a norm
    with pytest.raises(TensorParallelError, match="does not use its parameter '3.weight'"):
        split_stage(module, plan, UNRUN, shapes, "stage 0")


def llama(kv_heads: int) -> nn.Module:
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=kv_heads,
                                              max_position_embeddings=32))


IDS = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}


def test_key_value_heads_that_do_not_divide_are_refused():
    model = llama(kv_heads=1)
    graph = traced(model, IDS)
    plan = TensorParallelPlan(model.tp_plan, "the model's tp_plan")
    with pytest.raises(TensorParallelError, match="key/value heads that do not divide"):
        split_stage(graph.module, plan, UNRUN, whole_shapes(graph.module, IDS), "stage 0")


def test_a_batch_of_one_keeps_the_heads_split_through_the_reshapes():
    """With one sequence the attention's output (1, heads, s, d) reshapes into shapes whose leading 1s also match the
    sizes before the heads: the split stays on the heads (the first place that divides), not on a size-1 dimension."""
    one = {"input_ids": IDS["input_ids"][:1]}
    model = llama(kv_heads=2)
    graph = traced(model, one)
    plan = TensorParallelPlan(model.tp_plan, "the model's tp_plan")
    splits = split_stage(graph.module, plan, UNRUN, whole_shapes(graph.module, one), "stage 0")
    assert splits["model.layers.0.self_attn.o_proj.weight"].dim == 1


def test_the_split_values_of_a_plan_start_no_stage():
    """Marked, the values between a colwise layer and its rowwise partner never cross a stage boundary; unmarked,
    an even split by node count (uniform) starts a stage among them."""
    model = llama(kv_heads=2)
    graph = traced(model, IDS)
    plain = partitioners.partition(graph, 6, method="uniform")
    keep_split_values_in_stages(model, IDS, graph, pipetrain.PipelineOptions(tensor_parallel=2))
    split = {n for n in graph.graph.nodes if graph.graph.nodes[n].get(partitioners.STAYS_IN_STAGE)}
    assert {"linear", "view", "transpose", "scaled_dot_product_attention"} <= split  # q_proj .. attention
    assert not split & {"add_4", "embedding"}  # the residual stream and the (summed) embedding are whole
    kept = partitioners.partition(graph, 6, method="uniform")

    def crossing(plan) -> set[str]:
        return {value for k in range(1, plan.num_stages) for value in plan.stage_inputs(k)} & split
    assert crossing(plain), "the unmarked split cuts nowhere inside a split block: pick another stage count"
    assert not crossing(kept)


def test_a_marked_value_blocks_cuts_until_its_last_user():
    g = nx.DiGraph()
    for i, name in enumerate("abcdef"):
        g.add_node(name, op="call_function", order=i, fwd_time=1.0)
    g.add_edges_from([("a", "b"), ("b", "c"), ("b", "e"), ("c", "d"), ("d", "e"), ("e", "f")])
    g.nodes["b"][partitioners.STAYS_IN_STAGE] = True
    chain = partitioners.chain.Chain.from_graph(g)
    # b (position 1) is last used by e (position 4): no stage starts at 2, 3 or 4
    assert chain.cuttable.tolist() == [True, True, False, False, False, True, True]

"""Tensor parallelism (T) in the layout search: T=1 is the search as it was, a stage's memory and step at T=2
by hand, "auto" tries the divisors of the devices per node, and the choice of T > 1 is explained."""
from __future__ import annotations

import math

import networkx as nx
import pytest
import torch
import transformers as hf

import partitioners
from partitioners.planners.layout import _Model, evaluate_layout, explain_choice, format_bytes, search_layouts
from partitioners.planners.tensor_parallel import activation_share
from schedules.cluster import Cluster

LINEAR, ADD = "aten::linear", "aten::add.Tensor"


def transformer_graph(layers: int, width: float = 1e6, act: float = 1e5, seconds: float = 1e-2) -> nx.DiGraph:
    """A plain cost graph shaped like a transformer: an embedding, then per layer a norm, q and o
    matrices (o added to the residual stream), a norm, up and down matrices (down added), then a head.
    Matrices hold `width` parameter bytes, norms 1 kB; every node outputs `act` bytes."""
    g = nx.DiGraph()
    last = "embed"
    g.add_node(last, target="aten::embedding", param_bytes=width, act_bytes=act, fwd_time=seconds, bwd_time=seconds)

    def node(name: str, target: str, params: float, *inputs: str) -> str:
        g.add_node(name, target=target, param_bytes=params, act_bytes=act, fwd_time=seconds, bwd_time=2 * seconds)
        for i in inputs:
            g.add_edge(i, name, bytes=act)
        return name

    for k in range(layers):
        norm = node(f"norm{k}a", "aten::mul.Tensor", 1e3, last)
        q = node(f"q{k}", LINEAR, width, norm)
        o = node(f"o{k}", LINEAR, width, q)
        last = node(f"add{k}a", ADD, 0.0, last, o)
        norm = node(f"norm{k}b", "aten::mul.Tensor", 1e3, last)
        up = node(f"up{k}", LINEAR, width, norm)
        down = node(f"down{k}", LINEAR, width, up)
        last = node(f"add{k}b", ADD, 0.0, last, down)
    node("head", LINEAR, width, last)
    return g


def cluster(per_node: int = 2, nodes: int = 1, memory: float | None = None) -> Cluster:
    return Cluster(nodes=nodes, devices_per_node=per_node, intra_bandwidth=1e9, intra_latency=1e-5,
                   inter_bandwidth=1e8, inter_latency=1e-4, memory=memory)


def test_t1_ranks_exactly_as_before_tensor_parallelism():
    # This search as the planner ranked it before it knew T (commit 899f63a), to the bit: the best four, the
    # sums over all 114 shapes (65 fit), and the T=1 rows of an "auto" search are the same layouts in that order.
    before = [("2x2 zb-h1 m=16 zero=0 recompute=none", 1.1527549999999993, 20508000.0),
              ("2x2 zb-h1 m=8 zero=0 recompute=none", 1.17528, 21008000.0),
              ("2x2 1f1b m=16 zero=0 recompute=none", 1.1952899999999997, 20458000.0),
              ("2x2 gpipe m=16 zero=0 recompute=none", 1.1952900000000002, 24008000.0)]
    options = dict(batch_size=32, profiled_batch=4, zeros=(0, 1), recomputes=("none", "always"))
    limited = cluster(nodes=2, memory=2.5e7)
    layouts = search_layouts(transformer_graph(2), limited, **options)
    assert [(lay.label(), lay.step_time, max(lay.result.memory)) for lay in layouts[:4]] == before
    assert (len(layouts), sum(lay.fits for lay in layouts)) == (114, 65)
    assert math.fsum(lay.step_time for lay in layouts) == 286.661948
    assert math.fsum(max(lay.result.memory) for lay in layouts) == 3058328000.0
    assert {lay.tensor_parallel for lay in layouts} == {1}
    auto = search_layouts(transformer_graph(2), limited, tensor_parallel="auto", **options)
    assert {lay.tensor_parallel for lay in auto} == {1, 2}
    same = [lay for lay in auto if lay.tensor_parallel == 1]
    assert [(lay.label(), lay.step_time, lay.result.memory, lay.needs) for lay in same] == [
        (lay.label(), lay.step_time, lay.result.memory, lay.needs) for lay in layouts]


def test_stage_memory_at_t2_loses_half_the_split_part_by_hand():
    g = transformer_graph(1)
    shape = dict(replicas=1, micro_batches=1, schedule="gpipe", batch_size=4, profiled_batch=4)
    whole = evaluate_layout(g, cluster(), [0, 10], **shape).stage_memory[0]
    split = evaluate_layout(g, cluster(), [0, 10], tensor_parallel=2, **shape).stage_memory[0]
    # embedding, q, o, up, down, head: 6 matrices of 1 MB split; two 1 kB norms whole
    params, matrices = 6e6 + 2e3, 6e6
    assert (whole.weights, whole.gradients, whole.optimizer) == (params, params, 2 * params)  # Adam: 2 copies
    half = params - matrices / 2
    assert (split.weights, split.gradients, split.optimizer) == (half, half, 2 * half)
    # ten nodes of 100 kB kept for the backward; one of two ranks keeps (10 + 24 / 2) / 34 of them
    assert whole.activations == 10 * 1e5
    assert split.activations == pytest.approx(10 * 1e5 * 22 / 34, rel=1e-15)
    assert whole.total - split.total == pytest.approx(4 * matrices / 2 + 10 * 1e5 * 12 / 34, rel=1e-15)



def test_sequence_parallelism_keeps_one_tth_of_the_activations_at_the_same_step_time():
    g = transformer_graph(1)
    shape = dict(replicas=1, micro_batches=1, schedule="gpipe", batch_size=4, profiled_batch=4, tensor_parallel=2)
    split = evaluate_layout(g, cluster(), [0, 10], **shape)
    sequence = evaluate_layout(g, cluster(), [0, 10], sequence_parallel=True, **shape)
    # Korthikanti et al. with sequence parallelism: 34/T of 34 bytes per s*b*h, so one of two ranks keeps half
    assert sequence.stage_memory[0].activations == 10 * 1e5 / 2
    assert split.stage_memory[0].activations == pytest.approx(10 * 1e5 * 22 / 34, rel=1e-15)
    assert sequence.stage_memory[0].weights == split.stage_memory[0].weights
    # its reduce-scatter and all-gather move the all-reduce's bytes: priced as the same time
    assert sequence.step_time == split.step_time
    assert sequence.label().startswith("1x1 T=2 SP ") and " SP " not in split.label()
    tight = cluster(memory=(sequence.result.memory[0] + split.result.memory[0]) / 2)
    # the search prices it too: the one-stage gpipe layout fits a device between the two peaks with it only
    fits = {sp: search_layouts(g, tight, batch_size=4, profiled_batch=4, tensor_parallel=2, sequence_parallel=sp,
                               schedules=("gpipe",), micro_batches=(1,), max_stages=1)[0]
            for sp in (False, True)}
    assert (fits[False].fits, fits[True].fits) == (False, True)
    assert fits[True].sequence_parallel and fits[True].result.memory == sequence.result.memory

def test_allreduce_time_per_rowwise_matrix_by_hand():
    g = transformer_graph(2)
    assert list(_Model(g).rowwise.nonzero()[0]) == [3, 7, 11, 15]  # o and down of each layer, not q, up, head
    shape = dict(replicas=1, micro_batches=2, schedule="gpipe", batch_size=16, profiled_batch=4)
    lay = evaluate_layout(g, cluster(per_node=4), [0, 8, 18], tensor_parallel=2, **shape)
    # micro-batches of 8 samples = 2 x the profiled 4: each all-reduce moves 2 x 100 kB; a ring over 2 ranks
    # takes 2 (T - 1) latency + 2 (T - 1) / T x bytes / bandwidth
    ring = 2 * 1e-5 + 2 * 1 / 2 * 2e5 / 1e9
    # the boundary (add0a and down0, 100 kB each at the profiled batch: 4e5 bytes) crosses as 1/T per rank and
    # the receiving ranks all-gather it: (T - 1) latency + (T - 1) / T x bytes / bandwidth, in stage 1's forward
    # and, for its gradient, in stage 0's backward
    gather = 1e-5 + 1 / 2 * 4e5 / 1e9
    # stage 0 (embed to the first layer's second add): 8 nodes; stage 1: 10; two rowwise matrices each
    costs = lay.result.sim.costs
    assert costs.forward == pytest.approx([8 * 1e-2 * 2 / 2 + 2 * ring, 10 * 1e-2 * 2 / 2 + 2 * ring + gather],
                                          rel=1e-12)
    assert costs.backward == pytest.approx([(1e-2 + 7 * 2e-2) * 2 / 2 + 2 * ring + gather,
                                            10 * 2e-2 * 2 / 2 + 2 * ring], rel=1e-12)
    # two lanes of 2 ranks per node: the stages' lanes are neighbours on the node's link, each sending half
    assert costs.comm == pytest.approx([1e-5 + 4e5 / 2 / 1e9], rel=1e-12)
    # recomputed, a backward runs the forward again, its all-reduces too
    again = evaluate_layout(g, cluster(per_node=4), [0, 8, 18], tensor_parallel=2, recompute="always", **shape)
    with pytest.raises(ValueError, match=r"2 stages x 1 replicas x T=2 need 4 devices but cluster 'custom' has 2"):
        evaluate_layout(g, cluster(), [0, 8, 18], tensor_parallel=2, **shape)
    assert again.result.sim.costs.backward[1] == pytest.approx((10 * 2e-2 + 10 * 1e-2) * 2 / 2 + 4 * ring, rel=1e-12)
    # the layout takes stages x replicas x T devices
    assert lay.devices == 4 and lay.result.devices == 2


def test_auto_tries_the_divisors_of_the_devices_per_node_only():
    six = cluster(per_node=6, nodes=2)
    layouts = search_layouts(transformer_graph(2), six, batch_size=12, profiled_batch=4, tensor_parallel="auto",
                             micro_batches=(1, 2), schedules=("1f1b",))
    assert {lay.tensor_parallel for lay in layouts} == {1, 2, 3, 6}
    assert max(lay.devices for lay in layouts) == 12
    assert all(lay.devices == lay.stages * lay.replicas * lay.tensor_parallel for lay in layouts)
    with pytest.raises(ValueError, match=r"divisor of the 6 devices per node .* fix: use one of 1, 2, 3, 6 or 'auto'"):
        search_layouts(transformer_graph(2), six, batch_size=12, profiled_batch=4, tensor_parallel=4)
    # a graph without matrices has nothing to split: auto searches T=1 only, and T=2 is refused
    plain = nx.DiGraph()
    plain.add_node("a", fwd_time=1.0, bwd_time=1.0, param_bytes=8.0, act_bytes=4.0)
    assert {lay.tensor_parallel for lay in search_layouts(plain, six, batch_size=4, profiled_batch=4,
                                                          tensor_parallel="auto")} == {1}
    with pytest.raises(ValueError, match="no 2-D parameter"):
        search_layouts(plain, six, batch_size=4, profiled_batch=4, tensor_parallel=2)


def test_the_choice_of_t_is_explained_against_the_best_t1_layout():
    g = transformer_graph(1, width=1e7)
    options = dict(batch_size=8, profiled_batch=4, tensor_parallel="auto", schedules=("1f1b",))
    free = search_layouts(g, cluster(per_node=4), **options)
    # memory between the least any T=1 layout needs and what T=4 on one stage needs: only T > 1 fits
    least_t1 = min(max(lay.result.memory) for lay in free if lay.tensor_parallel == 1)
    tight = search_layouts(g, cluster(per_node=4, memory=least_t1 * 0.99), **options)
    best = tight[0]
    assert best.fits and best.tensor_parallel > 1
    assert not any(lay.fits for lay in tight if lay.tensor_parallel == 1)
    closest = min((lay for lay in tight if lay.tensor_parallel == 1), key=lambda lay: max(lay.result.memory))
    sentence = (f"T={best.tensor_parallel} x {best.stages} stage{'s' * (best.stages > 1)} x {best.replicas} "
                f"replica{'s' * (best.replicas > 1)} fits {format_bytes(max(best.result.memory))} per device where the "
                f"best T=1 layout, {closest.label()}, needs {format_bytes(least_t1)} (over "
                f"{format_bytes(least_t1 * 0.99)})")
    assert explain_choice(tight, cluster(per_node=4, memory=least_t1 * 0.99)).endswith(". " + sentence)
    # without a memory limit, T=4 on one stage wins on time (compute / 4, all-reduces of 100 kB on 1 GB/s links)
    best, t1 = free[0], next(lay for lay in free if lay.tensor_parallel == 1)
    assert (best.tensor_parallel, best.stages, best.replicas) == (4, 1, 1) and t1.step_time > best.step_time
    sentence = (f"T=4 x 1 stage x 1 replica takes {1e3 * best.step_time:.3g} ms a step where the best T=1 layout, "
                f"{t1.label()}, takes {1e3 * t1.step_time:.3g} ms ({t1.step_time / best.step_time:.2f}x), with "
                f"{format_bytes(max(best.result.memory))} against {format_bytes(max(t1.result.memory))} per device")
    assert explain_choice(free, cluster(per_node=4)).endswith(". " + sentence)
    # a T=1 choice is explained as before, against the next layout only
    assert "T=1 layout" not in explain_choice(free[free.index(t1):], cluster(per_node=4))


def test_a_traced_llama_splits_its_matrices_and_all_reduces_twice_a_layer():
    config = hf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = hf.LlamaForCausalLM(config)
    graph = partitioners.trace_for_training(model, torch.randint(0, 64, (2, 8)), profile=False)
    m = _Model(graph)
    matrices = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2)
    assert m.split.sum() == matrices and 0 < matrices < m.chain.params.sum()  # norms stay whole
    # o_proj and down_proj of each of the 3 layers, each all-reducing its output: 2 samples x 8 tokens x 16 fp32
    assert sorted(m.rowwise[m.rowwise > 0]) == [2 * 8 * 16 * 4] * 6
    assert activation_share(1) == 1.0 and activation_share(4) == 16 / 34


def test_cli_ranks_every_t_and_refuses_one_that_does_not_divide_a_node(tmp_path, capsys):
    from pipetrain.cli import main

    hf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, max_position_embeddings=32).save_pretrained(tmp_path / "tiny")
    (tmp_path / "four.json").write_text(cluster(per_node=4).to_json())
    plan = ["plan", str(tmp_path / "tiny"), "--cluster", str(tmp_path / "four.json"), "--batch-size", "8",
            "--seq-len", "8"]
    assert main([*plan, "--tensor-parallel", "auto", "--top", "1000"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel auto; best of" in out and "x schedule x T)" in out
    # rows: rank, stages, replicas, T, devices; every T = stages x replicas x T devices of the 4
    rows = [line.split()[:5] for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()
            and line.rstrip().endswith(("yes", "NO"))]
    assert {int(r[3]) for r in rows} == {1, 2, 4}
    assert all(int(r[1]) * int(r[2]) * int(r[3]) == int(r[4]) <= 4 for r in rows)
    with pytest.raises(SystemExit, match=r"divisor of the 4 devices per node .* fix: use one of 1, 2, 4 or 'auto'"):
        main([*plan, "--tensor-parallel", "3"])
    assert main([*plan, "--tensor-parallel", "2", "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 2 with sequence parallelism" in out and "T=2 SP " in out
    assert "of its activations (Korthikanti et al.: 34/T / 34, sequence parallel)" in out
    with pytest.raises(SystemExit, match="--sequence-parallel .* add --tensor-parallel"):
        main([*plan, "--sequence-parallel"])

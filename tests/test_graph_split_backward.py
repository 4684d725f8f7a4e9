"""The zero-bubble split at graph level (pipetrain/runtime/graph_split.py, graph_backward.py): each stage's
forward, input-gradient (B) and weight-gradient (W) graphs compute what autograd's full backward does, W
keeps less than the forward saved where the stage has weightless intermediates, stages that cannot be split
this way say why and fall back, and compiled zero-bubble pipelines train like eager ones.

Tolerances. The graphs run the same ATen kernels autograd runs (AOTAutograd traces autograd's own backward
formulas), so in fp32 they differ at most by the order in which a weight's contributions are summed (a weight
used twice) or by a rematerialised pointwise op: one fp32 rounding of a gradient, 6e-8 relative, which the
1e-6 relative bound covers with room. Compiled (inductor) pipelines fuse and reorder work: 1e-4 relative over
3 steps, what compile= promises elsewhere (tests/test_compile.py).
"""
import warnings

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

import pipetrain
from dist_harness import run_world
from helpers import batches, wrap_unprofiled
from pipetrain.runtime.compiled import compile_arguments, graph_compile_options
from pipetrain.runtime.graph_split import GraphSplitUnsupported, derive
from runtime_models import make, sgd

REL = 1e-6


class Skip(nn.Module):
    """A branch: the input reaches the output through two paths that join again."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.a(x)) * self.b(x)) + x, torch.relu(self.a(x))


class WithBuffer(nn.Module):
    """A constant buffer in the computation (read, never written) and one weight used twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.lin(torch.sigmoid(self.lin(x)) * self.scale)


class WeightlessMiddle(nn.Module):
    """Wide parameter-free work between two linear layers: what it saves only B reads."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 64), nn.Linear(64, 8)

    def forward(self, x):
        h = self.up(x)
        h = torch.softmax(torch.tanh(h) * torch.sigmoid(h), dim=-1) * torch.exp(-h * h)
        return self.down(h)


class Attention(nn.Module):
    """Pre-norm attention: layer norm's backward has several outputs, the attention kernel a dropout_p of 0."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(8), nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).flatten(-2))


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def run_split(module, inputs, target=None, loss_fn=None, tangents=None, autocast=None):
    """Input and weight gradients through the derived F, B and W graphs (uncompiled, traced under ``autocast``
    and run outside it, as the stage runs them)."""
    split = derive(module, tuple(inputs), target, loss_fn, autocast)
    weights = [p for p in module.parameters() if p.requires_grad]
    constants = list(module.buffers())
    with torch.no_grad():
        values = split.forward(*weights, *constants, *inputs, *([] if target is None else [target]))
        outputs, saved = list(values[:split.num_outputs]), list(values[split.num_outputs:])
        b_args = [saved[i] for i in split.saved_for_b] + list(tangents)
        b_out = list(split.input_grads(*b_args))
        if split.weight_grads is None:
            return split, outputs, saved, [], b_out, []
        kept = b_out[split.num_input_grads:]
        for_w = [b_args[i] for i in split.w_from_b] + [saved[i] for i in split.w_saved] + kept
        assert all(isinstance(t, torch.Tensor) for t in saved + for_w)  # what a micro-batch holds: tensors
        weight_grads = list(split.weight_grads(*for_w))
    return split, outputs, saved, b_out[:split.num_input_grads], weight_grads, for_w


def autograd_grads(module, inputs, outputs, tangents):
    """The reference: one full backward of the module by torch.autograd."""
    weights = [p for p in module.parameters() if p.requires_grad]
    differentiable = [x for x in inputs if x.requires_grad]
    grads = torch.autograd.grad(outputs, differentiable + weights, tangents)
    return list(grads[:len(differentiable)]), list(grads[len(differentiable):])


def assert_close(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=REL, atol=REL * w.abs().max().item(), msg=f"{what} {i}")


STAGES = {"mlp": mlp, "skip": Skip, "buffer": WithBuffer, "weightless": WeightlessMiddle, "attention": Attention}


@pytest.mark.parametrize("name", list(STAGES))
def test_b_and_w_graphs_equal_autograds_full_backward(name):
    torch.manual_seed(0)
    module = fx.symbolic_trace(STAGES[name]())
    x = torch.randn(2, 5, 8, requires_grad=True) if name == "attention" else torch.randn(6, 8, requires_grad=True)
    outputs = module(x)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    tangents = [torch.randn_like(o) for o in outputs]
    split, graph_outputs, _, input_grads, weight_grads, _ = run_split(module, [x], tangents=tangents)
    assert_close(graph_outputs, [o.detach() for o in outputs], "output")
    want_inputs, want_weights = autograd_grads(module, [x], outputs, tangents)
    assert_close(input_grads, want_inputs, "input gradient")
    assert_close(weight_grads, want_weights, "weight gradient")


def test_last_stage_with_loss_and_loss_scale():
    """The last stage's graph ends in the loss; its tangent is loss_scale * the micro-batch's weight."""
    torch.manual_seed(0)
    module = fx.symbolic_trace(mlp())
    x, y = torch.randn(6, 8, requires_grad=True), torch.randint(0, 4, (6,))
    scale = 1024.0 * 0.25
    _, (loss,), _, input_grads, weight_grads, _ = run_split(module, [x], y, F.cross_entropy,
                                                            tangents=[torch.tensor(scale)])
    want_loss = F.cross_entropy(module(x), y)
    assert loss.item() == pytest.approx(want_loss.item(), rel=REL)
    want_inputs, want_weights = autograd_grads(module, [x], [want_loss * 0.25 * 1024.0], [torch.tensor(1.0)])
    assert_close(input_grads, want_inputs, "input gradient")
    assert_close(weight_grads, want_weights, "weight gradient")


def test_first_stage_has_no_input_gradient_so_b_is_the_whole_backward():
    torch.manual_seed(0)
    module = fx.symbolic_trace(mlp())
    x = torch.randn(6, 8)  # the first stage: its input takes no gradient
    out = module(x)
    tangent = torch.randn_like(out)
    split, _, _, input_grads, weight_grads, _ = run_split(module, [x], tangents=[tangent])
    assert split.weight_grads is None and input_grads == []
    _, want = autograd_grads(module, [x], [out], [tangent])
    assert_close(weight_grads, want, "weight gradient")


class PassThrough(nn.Module):
    """A stage handing on what later stages read: its input (and a view of it) unchanged, integer ids."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, ids):
        return self.lin(x), x, ids, x[:, :2]


def test_outputs_that_are_inputs_take_their_gradients_and_integers_none():
    torch.manual_seed(0)
    module = fx.symbolic_trace(PassThrough())
    x, ids = torch.randn(4, 8, requires_grad=True), torch.randint(0, 3, (4,))
    outputs = module(x, ids)
    floating = [outputs[0], outputs[1], outputs[3]]
    tangents = [torch.randn_like(o) for o in floating]
    split, graph_outputs, _, input_grads, weight_grads, _ = run_split(module, [x, ids], tangents=tangents)
    assert split.tangent_outputs == [0, 1, 3]
    assert torch.equal(graph_outputs[2], ids)
    want_inputs, want_weights = autograd_grads(module, [x, ids], floating, tangents)
    assert_close(input_grads, want_inputs, "input gradient")
    assert_close(weight_grads, want_weights, "weight gradient")


def tensor_bytes(tensors, module):
    """Distinct storages' bytes, the module's weights left out (saved views of weights cost nothing)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in tensors
            if t.untyped_storage().data_ptr() not in weights}
    return sum(seen.values())


def test_w_keeps_less_than_the_forward_saved_where_b_alone_reads_it():
    """The weightless middle's saved values are B's alone: between B and W the micro-batch keeps the
    first layer's input, the gradients at the two layers' outputs and the second layer's input."""
    torch.manual_seed(0)
    module = fx.symbolic_trace(WeightlessMiddle())
    x = torch.randn(6, 8, requires_grad=True)
    _, _, saved, _, _, for_w = run_split(module, [x], tangents=[torch.randn(6, 8)])
    forward_bytes, w_bytes = tensor_bytes(saved, module), tensor_bytes(for_w, module)
    # x (6x8), the gradient at up's output (6x64), down's input (6x64) and the tangent (6x8), fp32.
    assert w_bytes == 4 * (6 * 8 + 6 * 64 + 6 * 64 + 6 * 8)
    assert w_bytes < forward_bytes


def test_autocast_bf16_graphs_equal_autograd_under_autocast():
    """Traced under autocast, the graphs hold its casts: run without it they compute what autograd does
    under it (the same bf16 kernels, so the same bits up to summation order)."""
    torch.manual_seed(0)
    module = fx.symbolic_trace(Skip())
    x = torch.randn(6, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = list(module(x))
    tangents = [torch.randn_like(o) for o in outputs]
    _, graph_outputs, _, input_grads, weight_grads, _ = run_split(
        module, [x], tangents=tangents, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    want_inputs, want_weights = autograd_grads(module, [x], outputs, tangents)
    assert [o.dtype for o in graph_outputs] == [o.dtype for o in outputs] == [torch.float32, torch.bfloat16]
    # bf16 rounding of the products (2**-8 relative) summed over 16 terms bounds any reordering.
    for got, want in zip(input_grads + weight_grads, want_inputs + want_weights):
        torch.testing.assert_close(got, want, rtol=2 ** -8, atol=2 ** -8 * want.abs().max().item())


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.5, training=True)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.norm(self.lin(x))


def branching_loss(out, target):
    """Control flow on a value: the graph would freeze one branch."""
    loss = F.cross_entropy(out, target)
    return loss * 2 if loss.item() > 100 else loss


@pytest.mark.parametrize("case, reason", [
    ("dropout", "draws random numbers"), ("batchnorm", "writes into a buffer"),
    ("data-dependent", "does not trace into one graph"),
])
def test_unsplittable_stages_say_why(case, reason):
    torch.manual_seed(0)
    x = torch.randn(6, 8, requires_grad=True)
    with pytest.raises(GraphSplitUnsupported, match=reason):
        if case == "data-dependent":
            derive(fx.symbolic_trace(mlp()), (x,), torch.randint(0, 4, (6,)), branching_loss)
        else:
            module = Noisy() if case == "dropout" else Normed().train()
            derive(fx.symbolic_trace(module), (x,))


# -- pipelines ---------------------------------------------------------------------------------------------

def train(model, compile, stages=2, recompute="none", precision="fp32", steps=3, engine="local", schedule="zb-h1"):
    data = batches(model, steps, 8, seed=3)
    pipe = wrap_unprofiled(make(model), data[0][0][:2], stages=stages, micro_batches=4, schedule=schedule,
                           optimizer=sgd, partitioner="uniform", engine=engine, compile=compile,
                           recompute=recompute, precision=precision)
    losses = [pipe.step(x, y) for x, y in data]
    return losses, pipe.state_dict(), pipe


def assert_state_close(got, want, rel):
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=rel, atol=rel * value.abs().max().item(), msg=name)


def test_split_graphs_uncompiled_train_exactly_like_eager_zero_bubble():
    """compile={"backend": "aot_eager"}: the derived graphs run uncompiled, the same ATen kernels as eager."""
    eager_losses, eager_state, _ = train("skip", False)
    losses, state, pipe = train("skip", {"backend": "aot_eager"})
    assert [pipe.held_stages[v].split_fallback for v in range(2)] == [None, None]
    assert losses == eager_losses
    assert_state_close(state, eager_state, REL)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
def test_compiled_zero_bubble_trains_like_eager(stages, one_thread):
    eager_losses, eager_state, _ = train("skip", False, stages)
    losses, state, pipe = train("skip", True, stages)
    assert all(rt.split_fallback is None for rt in pipe.held_stages.values())
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert_state_close(state, eager_state, 1e-4)
    # Recomputation replays the same compiled forward graph: the same numbers exactly.
    recomputed_losses, recomputed_state, _ = train("skip", True, stages, recompute="always")
    assert recomputed_losses == losses
    assert_state_close(recomputed_state, state, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_compiled_split_schedules_train_like_eager(schedule, stages, one_thread):
    """The V and interleaved zero-bubble schedules (two chunks per device) run the same compiled B and W graphs."""
    eager_losses, eager_state, _ = train("skip", False, stages, schedule=schedule)
    losses, state, pipe = train("skip", True, stages, schedule=schedule)
    assert len(pipe.held_stages) == 2 * stages
    assert all(rt.split_fallback is None for rt in pipe.held_stages.values())
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    assert_state_close(state, eager_state, 1e-4)
    recomputed_losses, recomputed_state, _ = train("skip", True, stages, recompute="always", schedule=schedule)
    assert recomputed_losses == losses
    assert_state_close(recomputed_state, state, 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_compiled_zero_bubble_low_precision_trains_like_eager(precision, one_thread):
    """bf16 autocast, and fp16 with loss scaling (the last stage's tangent carries the scale)."""
    eager_losses, eager_state, _ = train("skip", False, precision=precision)
    losses, state, _ = train("skip", True, precision=precision)
    assert losses == pytest.approx(eager_losses, rel=1e-4)
    # bf16/fp16 rounding of the backward's products, reordered by inductor's fusion (measured 7e-5).
    assert_state_close(state, eager_state, 1e-2)


def distributed_training(rank, world, recompute):
    losses, state, pipe = train("skip", True, recompute=recompute, engine="distributed")
    return losses, state, [rt.split_fallback for rt in pipe.held_stages.values()]


@pytest.mark.slow
def test_compiled_zero_bubble_on_two_gloo_ranks_trains_like_local_eager(tmp_path, one_thread):
    eager_losses, eager_state, _ = train("skip", False)
    per_rank = run_world(2, "test_graph_split_backward", "distributed_training", tmp_path, "always")
    state = {}
    for losses, rank_state, fallbacks in per_rank:
        assert fallbacks == [None]
        assert losses == pytest.approx(eager_losses, rel=1e-4)
        state.update(rank_state)
    assert_state_close(state, eager_state, 1e-4)


def hybrid_training(rank, world):
    data = batches("skip", 3, 8, seed=3)
    pipe = wrap_unprofiled(make("skip"), data[0][0][:2], stages=2, micro_batches=2, schedule="zb-h1", optimizer=sgd,
                           partitioner="uniform", engine="distributed", data_parallel=2, zero=1,
                           compile={"backend": "aot_eager"})
    return [pipe.step(x, y) for x, y in data], pipe.state_dict(), [rt.split_fallback for rt in pipe.held_stages.values()]


@pytest.mark.slow
def test_split_graphs_with_data_parallel_and_zero_train_like_one_process(tmp_path, one_thread):
    """2 stages x 2 replicas with ZeRO-1 on 4 gloo ranks, each replica half of every mini-batch in 2
    micro-batches of 2: the same 4 micro-batches the local eager pipeline accumulates. The replicas' mean
    gradient is a reordered sum of the same terms (fp32 rounding, 1e-5 as tests/test_hybrid.py)."""
    eager_losses, eager_state, _ = train("skip", False)
    per_rank = run_world(4, "test_graph_split_backward", "hybrid_training", tmp_path)
    for replica in range(2):
        state = {}
        for losses, rank_state, fallbacks in per_rank[2 * replica:2 * replica + 2]:
            assert fallbacks == [None]
            assert losses == pytest.approx(eager_losses, rel=1e-5)
            state.update(rank_state)
        for name, value in eager_state.items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)


def test_stage_that_cannot_split_warns_and_trains_exactly_like_eager():
    """Batch norm writes its running statistics: every stage falls back to the eager split, says why, and
    trains what eager zero-bubble trains, bit for bit."""
    eager_losses, eager_state, _ = train("convbn", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, state, pipe = train("convbn", True)
    told = [str(w.message) for w in caught if "not split at graph level" in str(w.message)]
    assert len(told) == 2 and all(f"stage {v}:" in t for v, t in zip(range(2), told))
    assert all("writes into a buffer" in pipe.held_stages[v].split_fallback for v in range(2))
    assert losses == eager_losses
    assert_state_close(state, eager_state, 0.0)


def test_compile_options_reach_the_graphs_and_other_schedules_keep_module_compile():
    x = batches("skip", 1, 8, seed=3)[0][0][:2]
    pipe = pipetrain.wrap(make("skip"), x, stages=2, schedule="1f1b", compile={"backend": "aot_eager"}, profile=False)
    assert all(rt.graph_backward is None and rt.split_fallback is None for rt in pipe.held_stages.values())
    pipe = pipetrain.wrap(make("skip"), x, stages=2, schedule="zb-h1", compile={"backend": "aot_eager"}, profile=False)
    assert all(rt.graph_backward is not None for rt in pipe.held_stages.values())


def test_graph_compile_options_follow_compile_and_never_replay_cuda_graphs():
    """Saved values outlive a graph's call (micro-batches in flight), so CUDA graphs, which replay into the
    same output buffers, stay off even where the mode asks for them."""
    assert graph_compile_options(compile_arguments({"backend": "aot_eager"})) is None
    assert graph_compile_options(compile_arguments(True)) == {"emulate_precision_casts": True,
                                                              "triton.cudagraphs": False}
    assert graph_compile_options(compile_arguments({"mode": "reduce-overhead"}))["triton.cudagraphs"] is False

"""trace(): the cost graph's nodes, attributes, fallbacks and errors."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torchvision

import partitioners
from partitioners import TraceError
from partitioners.training_switches import training_switches
from _partitioner_models import DtypeAware, TiedLM, TransformerLM, run_pipeline


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_resnet18_profiled_graph() -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)  # train mode: BatchNorm updates stats
    x = torch.randn(2, 3, 32, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cg = partitioners.trace(model, x, repeats=2)
    g = cg.graph
    fx_nodes = list(cg.module.graph.nodes)
    assert [n.name for n in fx_nodes] == cg.order and len(g) == len(fx_nodes)
    for k, v in model.state_dict().items():  # tracing left the model as it was
        assert torch.equal(v, before[k]), k
    for n in fx_nodes:
        attrs = g.nodes[n.name]
        assert attrs["op"] == n.op
        compute = n.op in ("call_module", "call_function", "call_method")
        assert (attrs["fwd_time"] > 0) == compute
        if n.op == "call_module" and isinstance(cg.module.get_submodule(n.target), nn.Conv2d):
            assert attrs["bwd_time"] > 0
            assert attrs["params"] == [f"{n.target}.weight"]
    assert sum(g.nodes[n]["param_bytes"] for n in g) == sum(_bytes(p) for p in model.parameters())
    assert g.nodes["conv1"]["act_bytes"] == 2 * 64 * 16 * 16 * 4
    for u, v, data in g.edges(data=True):
        assert data["bytes"] == g.nodes[u]["act_bytes"]
    assert g.nodes["x"]["op"] == "placeholder" and g.nodes["output"]["op"] == "output"


def test_estimate_is_deterministic_and_ranks_work() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    x = torch.randn(16, 64)
    a = partitioners.trace(model, x, profile=False)
    b = partitioners.trace(model, x, profile=False)
    times = {n: a.graph.nodes[n]["fwd_time"] for n in a.graph}
    assert times == {n: b.graph.nodes[n]["fwd_time"] for n in b.graph}
    assert times["_0"] > times["_2"] > times["_1"] > 0
    assert a.graph.nodes["_0"]["bwd_time"] == pytest.approx(2 * times["_0"])


def test_lstm_estimate_counts_recurrent_work() -> None:
    model = nn.Sequential(nn.LSTM(8, 32, batch_first=True))
    cg = partitioners.trace(model, torch.randn(2, 5, 8), profile=False)
    lstm = cg.graph.nodes["_0"]
    flops = 2 * (4 * 32 * 8 + 4 * 32 * 32) * 2 * 5
    assert lstm["fwd_time"] >= flops / partitioners.profiling.PEAK_FLOPS["cpu"]
    assert lstm["kind"] == "container"


@pytest.mark.parametrize("functional", [False, True])
def test_tied_parameter_counted_once(functional: bool) -> None:
    model = TiedLM(functional=functional)
    cg = partitioners.trace(model, torch.randint(0, 30, (2, 5)), profile=False)
    g = cg.graph
    total = sum(g.nodes[n]["param_bytes"] for n in g)
    assert total == sum(_bytes(p) for p in model.parameters())  # named_parameters dedups ties
    users = cg.tied_params["embed.weight"]
    assert users[0] == "embed" and len(users) == 2
    assert all(g.nodes[u]["tied"] for u in users)
    assert g.nodes[users[1]]["param_bytes"] == 0
    assert not g.nodes["body_0_0"]["tied"]


def test_transformer_encoder_becomes_its_layers() -> None:
    model = TransformerLM(layers=3)
    cg = partitioners.trace(model, torch.randint(0, 50, (2, 6)), profile=False)
    modules = [cg.graph.nodes[n]["target"] for n in cg.order
               if cg.graph.nodes[n]["op"] == "call_module"]
    assert modules == ["embed", "encoder.layers.0", "encoder.layers.1", "encoder.layers.2", "head"]
    assert cg.graph.nodes["encoder_layers_1"]["scope"] == "encoder.layers.1"


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.b(self.a(x))
        return self.a(x)


def test_untraceable_model_names_code_and_fix() -> None:
    with pytest.raises(TraceError) as info:
        partitioners.trace(_DataDependent(), torch.ones(2, 4), profile=False)
    message = str(info.value)
    assert "test_partitioners_trace.py" in message and "if x.sum() > 0:" in message
    assert "fix:" in message and "chain=True" in message


class _Gate(nn.Module):
    """Data-dependent control flow inside a submodule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.mean() > 0 else x - 1


class _WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.gate, self.b = nn.Linear(4, 4), _Gate(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.gate(self.a(x)))


def test_untraceable_submodule_becomes_leaf() -> None:
    model, x = _WithGate(), torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cg = partitioners.trace(model, x, profile=False)
    assert cg.auto_leaves == ["gate"]
    assert any("gate" in str(w.message) for w in caught)
    assert cg.graph.nodes["gate"]["op"] == "call_module"
    plan = partitioners.partition(cg, 3, method="uniform")
    with torch.no_grad():
        got = run_pipeline(plan, [plan.build_stage(k) for k in range(3)], (x,))
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.act, self.b = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(1 if x.sum() > -1e9 else 2):  # data dependent, yet a plain chain
            x = self.b(self.act(self.a(x)))
        return x


def test_chain_fallback() -> None:
    model, x = _Chain(), torch.randn(3, 4)
    with pytest.raises(TraceError):
        partitioners.trace(model, x, profile=False)
    cg = partitioners.trace(model, x, profile=False, chain=True)
    assert [n for n in cg.order] == ["x", "a", "act", "b", "output"]
    plan = partitioners.partition(cg, 2, method=["act"])
    with torch.no_grad():
        got = run_pipeline(plan, [plan.build_stage(k) for k in range(2)], (x,))
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)
    with pytest.raises(TraceError, match="does not reproduce"):
        partitioners.trace(_DataDependent(), -torch.ones(2, 4), profile=False, chain=True)


def test_leaves_option_keeps_module_whole() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    cg = partitioners.trace(model.eval(), torch.randn(1, 3, 32, 32), profile=False, leaves=["layer1"])
    assert cg.graph.nodes["layer1"]["op"] == "call_module"
    assert not any(n.startswith("layer1_") for n in cg.order)


def test_default_arguments_traced_as_given() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
            if mask is not None:
                x = x * mask
            return self.lin(x)

    model, x = Masked(), torch.randn(2, 4)
    cg = partitioners.trace(model, x, profile=False)
    plan = partitioners.partition(cg, 1)
    torch.testing.assert_close(plan.build_stage(0)(x), model(x), rtol=0, atol=0)


def test_example_inputs_that_do_not_fit() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="example_inputs do not fit Sequential.*fix:"):
        partitioners.trace(model, torch.randn(2, 5), profile=False)
    with pytest.raises(TypeError, match="example_inputs must be a tensor, a tuple .* or a dict"):
        partitioners.trace(model, "not a tensor", profile=False)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        partitioners.trace(lambda t: t, torch.randn(2, 4))


class RoutedExpert(nn.Module):
    """A router picks each row's expert and counts the picks; the expert's weight is read transposed
    (a view of the parameter, as grouped-matmul experts read theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.proj = nn.Linear(4, 3)
        self.expert = nn.Parameter(torch.randn(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        counts = torch.histc(choice.float(), bins=2, min=0, max=1)
        return torch.matmul(self.proj(x), self.expert.t()) * counts[choice].unsqueeze(-1)


def test_values_the_model_does_not_differentiate_and_saved_views_of_parameters() -> None:
    # The capture's run records autograd as training does: the router's logits and what the expert
    # computes take gradients; the input, the integer choices and their float histogram do not.
    g = partitioners.trace(RoutedExpert(), torch.randn(4, 4), profile=False).graph
    wanted = {"x": False, "router": True, "argmax": False, "histc": False, "proj": True, "matmul": True}
    assert {n: g.nodes[n]["requires_grad"] for n in wanted} == wanted
    assert g.nodes["histc"]["bwd_time"] == 0 and g.nodes["matmul"]["bwd_time"] > 0
    # matmul saves both operands for its backward: the projection is an activation, the transposed
    # parameter is the parameter's memory.
    assert g.nodes["matmul"]["saves"] == ["proj"]


def test_export_keeps_example_inputs_that_alias_each_other_apart() -> None:
    """{"input_ids": ids, "labels": ids}: one tensor given for two inputs must still capture two inputs."""
    class OwnLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, 10)

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.head(self.embed(ids)).flatten(0, 1), labels.flatten())

    torch.manual_seed(0)
    model, ids = OwnLoss(), torch.randint(0, 10, (2, 3))
    cg = partitioners.trace(model, {"ids": ids, "labels": ids}, profile=False, capture="export")
    labels = torch.randint(0, 10, (2, 3))
    # The same ATen calls on the same inputs as the model's own forward: bit for bit.
    torch.testing.assert_close(cg.module(ids, labels), model(ids, labels), rtol=0, atol=0)


def test_training_switches_are_the_positive_values_a_branch_on_self_training_reads() -> None:
    class Config:
        layerdrop, hidden_dropout, use_cache = 0.2, 0.1, True

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config, self.drop_prob, self.off = Config(), 0.3, 0.0
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.rand([]) < self.config.layerdrop:
                return x
            if self.training:
                if torch.rand([]) < self.drop_prob or torch.rand([]) < self.off:
                    return x
            if self.config.use_cache and self.training:  # a flag, not a rate: not randomness
                x = x + 0
            # follows train()/eval() in every capture: not a switch
            return nn.functional.dropout(self.lin(x), p=self.config.hidden_dropout, training=self.training)

    model = nn.Sequential(Block())
    assert training_switches(model) == [
        "config.layerdrop = 0.2 (Block.forward)", "0.drop_prob = 0.3 (Block.forward)"]


def test_a_capture_under_autocast_follows_the_model_s_dtype_code() -> None:
    torch.manual_seed(0)
    model, x = DtypeAware(), torch.randn(2, 8)
    cg = partitioners.trace(model, x, capture="export", autocast=torch.bfloat16, profile=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = model(x), cg.module(x)
    # The same calls in the same dtypes as eager (the autocast-disabled branch included): the same bits.
    assert torch.equal(got, expected)
    # Captured without the autocast, ``.to(h.dtype)`` would be a cast to fp32: another computation.
    fp32_capture = partitioners.trace(model, x, capture="export", profile=False)
    to_dtype = torch.ops.aten.to.dtype
    casts = [{n.args[1] for n in g.module.graph.nodes if n.target is to_dtype} for g in (cg, fp32_capture)]
    assert casts == [{torch.float32, torch.bfloat16}, {torch.float32}]
    # export's checks of each cast's input dtype and device are gone (a stage may run elsewhere),
    # also inside the autocast-disabled region's own graph.
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default
                   for gm in cg.module.modules() if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes)
    # Costs count each value in its dtype: the first projection is bf16 under the autocast.
    linear = next(n for n in cg.module.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert cg.graph.nodes[linear.name]["act_bytes"] == 2 * 8 * 2
    assert fp32_capture.graph.nodes[linear.name]["act_bytes"] == 2 * 8 * 4


def test_an_autocast_region_torch_fx_cannot_record_sends_the_capture_to_torch_export() -> None:
    class UpcastGate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):  # torch.fx runs this at trace time and records nothing
                gate = self.b(h.float())
            return h * gate

    torch.manual_seed(0)
    model, x = UpcastGate(), torch.randn(2, 4)
    assert partitioners.trace(model, x, profile=False).module(x).dtype == torch.float32  # fp32: fx is right
    with pytest.raises(TraceError, match="torch.fx keeps no `with torch.autocast"):
        partitioners.trace(model, x, profile=False, autocast=torch.bfloat16)
    cg = partitioners.trace_for_training(model, x, profile=False, autocast=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(cg.module(x), model(x))  # export keeps the region: fp32 as in eager

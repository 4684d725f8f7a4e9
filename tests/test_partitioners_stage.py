"""Chained stage modules reproduce the unsplit model: outputs (eval) and gradients (train)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torchvision

import partitioners
from _partitioner_models import LSTMLM, SkipNet, TiedLM, TransformerLM, run_pipeline


def _vgg11_bn() -> nn.Module:
    """torchvision's VGG-11 with BatchNorm (the same features, avgpool, flatten and classifier with dropout, the
    same initialisation) with its classifier's hidden layers 1024 wide instead of 4096. The 4096-wide layers hold
    120M of its 129M parameters: each copy of the stages was half a gigabyte, and vgg11_bn took 17 s of the
    file's 21 alone (100+ s of ~145 in a full run, under memory pressure). At 1024 the cuts are where they were
    at 4096 for 3 and 4 stages (4: features_15, avgpool, classifier_0: the classifier cut across too); 2 stages
    cut at features_22 rather than avgpool, which the 4-stage split crosses."""
    with torch.device("meta"):
        model = torchvision.models.vgg11_bn(num_classes=10)  # the layout, nothing allocated
    model.features = torchvision.models.vgg.make_layers(torchvision.models.vgg.cfgs["A"], batch_norm=True)
    model.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 1024), nn.ReLU(True), nn.Dropout(p=0.5),
                                     nn.Linear(1024, 1024), nn.ReLU(True), nn.Dropout(p=0.5), nn.Linear(1024, 10))
    for m in model.modules():  # as torchvision.models.VGG initialises
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.constant_(m.bias, 0)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return model


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(1))


MODELS = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10),
                 lambda: torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))),
    "vgg11_bn": (_vgg11_bn,
                 lambda: torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))),
    "transformer": (TransformerLM, lambda: _tokens(50)),
    "lstm": (LSTMLM, lambda: _tokens(40)),
    "skip": (SkipNet, lambda: torch.randn(3, 8, generator=torch.Generator().manual_seed(1))),
    "tied": (TiedLM, lambda: _tokens(30)),
    "tied_functional": (lambda: TiedLM(functional=True), lambda: _tokens(30)),
}

_cache: dict[str, tuple] = {}


def _setup(name: str):
    """model (eval mode), input, cost graph, eval output, gradients of one train step."""
    if name not in _cache:
        torch.manual_seed(0)
        make_model, make_input = MODELS[name]
        model, x = make_model().eval(), make_input()
        cg = partitioners.trace(model, x, profile=False)
        with torch.no_grad():
            expected = model(x)
        trained = copy.deepcopy(model).train()  # keeps the model's BatchNorm statistics intact
        torch.manual_seed(5)
        _loss(trained(x)).backward()
        grads = {n: p.grad for n, p in trained.named_parameters()}
        _cache[name] = (model, x, cg, expected, grads)
    return _cache[name]


def _loss(out: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return (out * weights).sum()


def _canonical(model: nn.Module) -> dict[str, str]:
    """Every parameter name (tied aliases included) -> the name named_parameters() uses."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n)
            for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_chained_stages_match_model(name: str, stages: int) -> None:
    model, x, cg, expected, reference = _setup(name)
    method = "uniform" if stages == 3 else "graph"
    plan = partitioners.partition(cg, stages, method=method)
    assert plan.num_stages == stages
    mods = [plan.build_stage(k).eval() for k in range(stages)]
    for mod in mods:
        assert set(mod.state_dict()) <= set(model.state_dict())

    # eval: outputs equal
    with torch.no_grad():
        got = run_pipeline(plan, mods, (x,))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

    # train: same RNG stream (dropout) and batch statistics, so gradients equal
    for mod in mods:
        mod.train()
    torch.manual_seed(5)
    run_pipeline(plan, mods, (x,), loss_fn=_loss)
    canon = _canonical(model)
    summed: dict[str, torch.Tensor] = {}
    for mod in mods:
        for pname, p in mod.named_parameters():
            assert p.grad is not None, f"{pname} got no gradient"
            key = canon[pname]
            summed[key] = summed[key] + p.grad if key in summed else p.grad.clone()
    assert set(summed) == set(reference)
    for pname, g in reference.items():
        torch.testing.assert_close(summed[pname], g, rtol=0, atol=1e-5, msg=pname)


@pytest.mark.parametrize("name", ["tied", "tied_functional"])
def test_tied_parameter_copies_reported(name: str) -> None:
    model, _, cg, _, _ = _setup(name)
    plan = partitioners.partition(cg, 3, method="uniform")
    groups = plan.tied_groups()
    assert len(groups) == 1
    stages = [k for k, _ in groups[0]]
    assert stages == [0, 2]
    for k, pname in groups[0]:
        param = dict(plan.build_stage(k).named_parameters())[pname]
        assert torch.equal(param, model.embed.weight)
        assert param is not model.embed.weight  # a copy, independent of the original


def test_single_stage_shares_tie() -> None:
    _, _, cg, _, _ = _setup("tied")
    plan = partitioners.partition(cg, 1)
    assert plan.tied_groups() == []
    mod = plan.build_stage(0)
    assert mod.head.weight is mod.embed.weight


def test_skip_connection_sent_directly_across_stages() -> None:
    model, x, cg, _, _ = _setup("skip")
    plan = partitioners.partition(cg, 4, method="uniform")
    skip = [n for k in range(plan.num_stages) for n in plan.stage_outputs(k)
            if max(plan.consumers(n)) >= plan.producer(n) + 3]
    assert skip, "expected a value produced in stage 0 and used in stage 3"
    for n in skip:
        assert n not in plan.stage_outputs(1) and n not in plan.stage_outputs(2)


def test_stage_modules_are_independent_copies() -> None:
    model, x, cg, _, _ = _setup("resnet18")
    plan = partitioners.partition(cg, 2, method="uniform")
    a, b = plan.build_stage(0), plan.build_stage(0)
    with torch.no_grad():
        a.conv1.weight.add_(1.0)
    assert not torch.equal(a.conv1.weight, b.conv1.weight)
    assert not torch.equal(a.conv1.weight, model.conv1.weight)
    assert "bn1.running_mean" in a.state_dict() and "fc.weight" not in a.state_dict()


class _TupleNet(nn.Module):
    """nn.LSTM's (output, (h, c)) tuple is unpacked only after another module runs."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.mid, self.head = nn.LSTM(4, 4, batch_first=True), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = self.lstm(x)
        z = self.mid(x)
        return self.head(pair[0]) + z


def test_tuple_and_int_values_pass_through() -> None:
    model, x = _TupleNet().eval(), torch.randn(2, 3, 4)
    cg = partitioners.trace(model, x, profile=False)
    plan = partitioners.partition(cg, 2, method=["mid"])  # the tuple crosses the boundary
    assert "lstm" in plan.stage_inputs(1)
    with torch.no_grad():
        got = run_pipeline(plan, [plan.build_stage(k) for k in range(2)], (x,))
        torch.testing.assert_close(got, model(x), rtol=0, atol=0)
    # the optimal and balanced methods never cut through the tuple
    for method in ("uniform", "params", "time", "graph"):
        for stages in (2, 3):
            plan = partitioners.partition(cg, stages, method=method)
            assert all("lstm" not in plan.stage_inputs(k) for k in range(stages)), method

    skip_model, sx, scg, _, _ = _setup("skip")
    plan = partitioners.partition(scg, 2, method=["head"])
    assert "size" in plan.stage_inputs(1)  # the int from x.size(0)
    with torch.no_grad():
        got = run_pipeline(plan, [plan.build_stage(k) for k in range(2)], (sx,))
        torch.testing.assert_close(got, skip_model(sx), rtol=0, atol=0)


def test_later_stage_uses_model_input() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * scale + x

    model = Residual()
    x, scale = torch.randn(2, 4), torch.tensor(3.0)
    cg = partitioners.trace(model, (x, scale), profile=False)
    plan = partitioners.partition(cg, 2, method=["b"])
    assert plan.stage_inputs(0) == ["x", "scale"]
    assert {"x", "scale"} <= set(plan.stage_outputs(0))
    assert plan.producer("x") == 0 and plan.consumers("x") == [1]
    with torch.no_grad():
        got = run_pipeline(plan, [plan.build_stage(k) for k in range(2)], (x, scale))
    torch.testing.assert_close(got, model(x, scale), rtol=0, atol=0)

"""Tests for pipetrain.apps.models: shapes on real batches, fx tracing, learning, determinism, errors."""

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from pipetrain.apps.datasets import dataset_info, load_dataset
from pipetrain.apps.models import DEFAULT_DATASET, DEFAULT_HPARAMS, DEFAULT_SIZE, MODELS, build_model

FAMILIES = list(DEFAULT_SIZE)


def _batch(name, n=16):
    ds = load_dataset(DEFAULT_DATASET[name], split="train", seed=0)
    x, y = ds.tensors
    return x[:n], y[:n]


def _model(name, seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(name, num_classes=dataset_info(DEFAULT_DATASET[name]).num_classes, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_class_dim_second(name):
    x, y = _batch(name, 4)
    classes = dataset_info(DEFAULT_DATASET[name]).num_classes
    out = _model(name).eval()(x)
    assert out.shape == (4, classes, *y.shape[1:])  # so F.cross_entropy(out, y) applies to every model


@pytest.mark.parametrize("name", FAMILIES)
def test_symbolic_trace_matches_model_with_one_node_per_layer(name):
    model = _model(name).eval()
    x, _ = _batch(name, 4)
    gm = torch.fx.symbolic_trace(model)  # torch.nn modules (LSTM, encoder layer) stay leaves
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    called = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    depth = DEFAULT_SIZE[name][1]
    if name in ("cnn1d", "transformer", "lstm", "transformer-lm", "lstm-lm"):
        assert sum(t.startswith("layers.") for t in called) == depth  # partitioner can split between layers
    else:
        assert sum(isinstance(gm.get_submodule(t), torch.nn.Conv2d) for t in called) >= depth - 3


def test_lm_output_tied_to_embedding_and_causal():
    for name in ("transformer-lm", "lstm-lm"):
        model = _model(name).eval()
        x, _ = _batch(name, 2)
        changed = x.clone()
        changed[:, 40:] = (changed[:, 40:] + 1) % 96
        a, b = model(x), model(changed)
        torch.testing.assert_close(a[..., :40], b[..., :40])  # future tokens do not affect the past
        assert not torch.allclose(a[..., 40:], b[..., 40:])
        # the output projection is the embedding: a zero embedding table gives zero logits
        with torch.no_grad():
            model.embed.weight.zero_()
        assert model(x).abs().max() == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_sgd_steps_reduce_loss_on_fixed_batch(name):
    model = _model(name)
    x, y = _batch(name, 16)
    if name.endswith("-lm"):  # 16 tokens per sequence keep the test fast; the models take any length
        x, y = x[:, :16], y[:, :16]
    opt = torch.optim.SGD(model.parameters(), lr=DEFAULT_HPARAMS[name]["lr"], momentum=0.9)
    with torch.no_grad():
        before = F.cross_entropy(model(x), y).item()
    for _ in range(10):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        after = F.cross_entropy(model(x), y).item()
    assert after < 0.85 * before


@pytest.mark.parametrize("name", FAMILIES)
def test_init_follows_manual_seed(name):
    a, b, c = _model(name, 1), _model(name, 1), _model(name, 2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_width_depth_and_errors():
    small, wide = _model("vgg", width=4), _model("vgg", width=8)
    assert sum(p.numel() for p in wide.parameters()) > 3 * sum(p.numel() for p in small.parameters())
    resnet32 = _model("resnet", depth=32)
    assert len([m for m in resnet32.modules() if isinstance(m, torch.nn.Conv2d)]) == 31 + 2  # + 2 projections
    assert len(_model("lstm", depth=3).layers) == 3
    with pytest.raises(ValueError, match="6n\\+2"):
        _model("resnet", depth=21)
    with pytest.raises(ValueError, match="11"):
        _model("vgg", depth=12)
    with pytest.raises(ValueError, match="divisible"):
        _model("transformer", width=30)
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt", num_classes=2)
    with pytest.raises(ValueError, match="fixed"):
        build_model("resnet18", num_classes=10, width=8)
    assert set(DEFAULT_DATASET) == set(MODELS)

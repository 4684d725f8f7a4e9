"""Mixture-of-experts models (tests/moe_models.py) passed to pipetrain.wrap as they are.

Their routing moves integer expert indices, boolean masks and a float histogram of expert choices (which
the model never differentiates) through the graph and across stage boundaries; with
``output_router_logits=True`` and ``labels`` the model adds the router's load-balancing loss to
``out.loss``, which ``pipetrain.model_loss`` trains. Each trains like the unsplit model with gradient
accumulation over the same micro-batches, router included, and predicts its eval-mode output.

Tolerance, as in tests/test_third_party_models.py: torch.export captures these models, so the stages run
the ATen calls the Python code dispatches to, which may group a sum differently from the eager model;
parameters may then differ in their last bits: 1e-5 relative, with an absolute floor of 1e-7 for values
that are rounding noise around zero. The distributed engine runs the very same calls as the local one
and must match it bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as hf

import pipetrain
from dist_harness import run_world
from moe_models import MOE, build, token_batch
from pipetrain.runtime.batching import batch_size, split_micro_batches
from helpers import wrap_unprofiled

MICRO = 2
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.1)  # the load-balancing term: ~4% of the loss
hf.logging.set_verbosity_error()  # tiny vocabularies make the configs warn about token ids


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def own_loss_batch(samples: int, seed: int) -> dict:
    """Labels among the inputs: the model computes its loss, router term included."""
    ids = token_batch(samples, seed)
    return {"input_ids": ids, "labels": ids}


def lm_loss(out, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def reference_training(model: nn.Module, batches: list, loss_fn) -> tuple[nn.Module, list[float], float]:
    """The unsplit model trained with gradient accumulation over the same micro-batches: the model, the
    mean loss per mini-batch and the largest share the router's term had in a micro-batch's loss."""
    opt = sgd(model.parameters())
    losses, router_share = [], 0.0
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        ys = split_micro_batches(y, MICRO) if y is not None else [None] * MICRO
        for xi, yi in zip(split_micro_batches(x, MICRO), ys):
            out = model(**xi)
            loss = loss_fn(out, yi)
            if out.aux_loss is not None:
                router_term = ROUTER_LOSS["router_aux_loss_coef"] * out.aux_loss.item()
                router_share = max(router_share, router_term / loss.item())
            weighted = loss * batch_size(xi) / batch_size(x)
            weighted.backward()
            total += weighted.item()
        opt.step()
        losses.append(total)
    return model, losses, router_share


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", list(MOE))
def test_trains_with_the_router_loss_and_predicts_like_the_unsplit_model(name: str, stages: int) -> None:
    batches = [(own_loss_batch(8, seed), None) for seed in (1, 2)]
    initial = build(name, **ROUTER_LOSS).state_dict()
    pipe = wrap_unprofiled(build(name, **ROUTER_LOSS), own_loss_batch(2, 0), stages=stages, micro_batches=MICRO,
                           loss_fn=pipetrain.model_loss, optimizer=sgd, engine="local")
    assert pipe.plan.num_stages == stages
    losses = [pipe.step(x) for x, _ in batches]
    reference, expected, router_share = reference_training(build(name, **ROUTER_LOSS), batches, pipetrain.model_loss)
    assert router_share > 0.01  # the router's term is a visible part of the loss the pipeline matches
    # The same float32 losses, combined over two micro-batches in another order: a few ulps.
    assert losses == pytest.approx(expected, rel=1e-6)
    ours, theirs = pipe.state_dict(), reference.state_dict()
    assert_same_state(ours, theirs)
    # The router's gradient (cross entropy through the top-k weights, plus the load-balancing term, most
    # of it) is exact: its updates agree, not just the weights they were added to. Weights that agree to
    # their last bits give updates that agree to within a few ulps of the weight.
    routers = [k for k in theirs if k.endswith("mlp.gate.weight")]
    assert routers
    for key in routers:
        update, ulps = theirs[key] - initial[key], 4 * torch.finfo(torch.float32).eps * initial[key].abs().max()
        assert update.abs().max() > 1000 * ulps
        torch.testing.assert_close(ours[key] - initial[key], update, rtol=1e-5, atol=ulps.item(), msg=key)

    x = own_loss_batch(5, 7)  # 5 samples in 2 micro-batches: uneven, and a batch size never seen
    got, wanted = pipe.predict(x), reference.eval()(**x)
    torch.testing.assert_close(got.logits, wanted.logits, rtol=1e-5, atol=1e-6)
    # Each micro-batch routes its own tokens: the router logits of the two pieces, concatenated.
    for ours_layer, theirs_layer in zip(got.router_logits, wanted.router_logits, strict=True):
        torch.testing.assert_close(ours_layer, theirs_layer, rtol=1e-5, atol=1e-6)


def test_trains_on_the_logits_without_router_outputs() -> None:
    # The case of the original failure report: a 2-layer Mixtral with an external loss on its logits.
    ids = [token_batch(8, seed) for seed in (1, 2)]
    batches = [({"input_ids": i}, i) for i in ids]
    pipe = wrap_unprofiled(build("mixtral", layers=2), {"input_ids": ids[0][:2]}, stages=2, micro_batches=MICRO,
                           loss_fn=lm_loss, optimizer=sgd, engine="local")
    losses = [pipe.step(x, y) for x, y in batches]
    reference, expected, _ = reference_training(build("mixtral", layers=2), batches, lm_loss)
    assert losses == pytest.approx(expected, rel=1e-6)
    assert_same_state(pipe.state_dict(), reference.state_dict())


class CountingRouter(nn.Module):
    """Routing as Hugging Face's grouped-matmul experts do it on the CPU: a float histogram of each row's
    expert, which the model never differentiates, turned into int32 offsets by ``cumsum`` (which refuses
    an input that requires grad). Split before ``body``, the histogram and the integer choices cross the
    stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        counts = torch.histc(choice.float(), bins=4, min=0, max=3)
        h = torch.relu(self.body(x))
        offsets = counts.cumsum(0, dtype=torch.int32)
        return self.head(h) * offsets[choice].unsqueeze(-1)


def _counting_setup() -> tuple[CountingRouter, torch.Tensor, torch.Tensor]:
    """The model and one mini-batch (inputs, targets), from seed 0."""
    torch.manual_seed(0)
    return CountingRouter(), torch.randn(8, 8), torch.randn(8, 3)


def _counting_router(engine: str) -> tuple[list[float], dict, torch.Tensor]:
    model, x, y = _counting_setup()
    pipe = wrap_unprofiled(model, x[:2], stages=2, micro_batches=MICRO, partitioner=["body"],
                           loss_fn=F.mse_loss, optimizer=sgd, engine=engine)
    assert {"argmax", "histc"} <= set(pipe.plan.stage_outputs(0))
    losses = [pipe.step(x, y) for _ in range(2)]
    return losses, pipe.state_dict(), pipe.predict(x)


def test_a_float_histogram_the_model_does_not_differentiate_crosses_a_stage_boundary() -> None:
    losses, state, prediction = _counting_router("local")
    model, x, y = _counting_setup()
    opt = sgd(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        for xi, yi in zip(x.chunk(MICRO), y.chunk(MICRO)):
            (F.mse_loss(model(xi), yi) / MICRO).backward()
        opt.step()
    # torch.fx captures the model: the stages run its very calls, bit for bit.
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
    # The counts are per call, so the prediction is that of each micro-batch.
    assert torch.equal(prediction, torch.cat([model(xi) for xi in x.chunk(MICRO)]))


def _mixtral(engine: str) -> tuple[list[float], dict, torch.Tensor]:
    batches = [own_loss_batch(8, seed) for seed in (1, 2)]
    pipe = wrap_unprofiled(build("mixtral", layers=2, **ROUTER_LOSS), own_loss_batch(2, 0), stages=2,
                           micro_batches=MICRO, loss_fn=pipetrain.model_loss, optimizer=sgd,
                           engine=engine)
    nodes = pipe.plan.graph.graph.nodes
    assert any(nodes[n]["kind"] == "tensor" and not nodes[n]["requires_grad"] for n in pipe.plan.stage_outputs(0))
    losses = [pipe.step(x) for x in batches]
    return losses, pipe.state_dict(), pipe.predict(own_loss_batch(5, 7)).logits


def distributed_ranks(rank: int, world: int) -> dict[str, tuple]:
    hf.logging.set_verbosity_error()
    return {"mixtral": _mixtral("distributed"), "counting": _counting_router("distributed")}


@pytest.mark.slow
def test_the_distributed_engine_sends_routing_values_and_trains_like_the_local_one(tmp_path, one_thread) -> None:
    # Integer positions and labels, a boolean mask and rotary tables the model does not differentiate
    # cross Mixtral's boundary; the histogram and the expert choices cross CountingRouter's.
    # one_thread: the ranks' thread count, for bitwise equality.
    per_rank = run_world(2, "test_mixture_of_experts", "distributed_ranks", tmp_path)
    for name, local in (("mixtral", _mixtral("local")), ("counting", _counting_router("local"))):
        losses, expected, prediction = local
        merged = {}
        for results in per_rank:
            rank_losses, state, rank_prediction = results[name]
            assert rank_losses == losses, name
            assert torch.equal(rank_prediction, prediction), name
            merged.update(state)
        assert set(merged) == set(expected)
        for key, value in expected.items():
            assert torch.equal(merged[key], value), (name, key)

"""Batches as data loaders and collators make them: any Mapping of keyword inputs (a collator's BatchEncoding, a
UserDict), loaders of (inputs, targets) pairs or of Mappings alone (labels inside), and the per-step callback.
The reference is the same pipeline fed plain dicts and pairs: the bits must be the same."""
from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import BatchEncoding

import pipetrain
from dist_harness import run_world
from helpers import wrap_unprofiled


class OwnLoss(nn.Module):
    """Keyword inputs; computes its own loss from ``labels``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 10)

    def forward(self, input_ids, attention_mask, labels):
        h = self.body(self.embed(input_ids)) * attention_mask.unsqueeze(-1)
        logits = self.head(h)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 10, (8, 5), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(8, 5), "labels": ids.roll(1, dims=1)}


def pipe(example=None, **options) -> pipetrain.Pipeline:
    example = example if example is not None else {k: v[:2] for k, v in batch(0).items()}
    return wrap_unprofiled(OwnLoss(), example, stages=2, partitioner="uniform", loss_fn=pipetrain.model_loss,
                           **{"engine": "local", "micro_batches": 2, **options})


def assert_same(a: pipetrain.Pipeline, b: pipetrain.Pipeline) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("mapping", [BatchEncoding, UserDict])
def test_any_mapping_counts_as_keyword_inputs(mapping):
    plain, collated = pipe(), pipe(example=mapping({k: v[:2] for k, v in batch(0).items()}))
    for seed in (1, 2):
        assert plain.step(batch(seed)) == collated.step(mapping(batch(seed)))
    assert_same(plain, collated)
    torch.testing.assert_close(collated.predict(mapping(batch(3)))["logits"], plain.predict(batch(3))["logits"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("schedule", [{}, {"schedule": "async-1f1b", "staleness": "stash"}])
def test_train_takes_a_loader_of_mappings_with_the_labels_inside(schedule):
    pairs, mappings = pipe(**schedule), pipe(**schedule)
    loader = torch.utils.data.DataLoader([batch(s) for s in range(1, 4)], batch_size=None)  # yields dicts
    losses = [r.loss for r in mappings.train(BatchEncoding(b) for b in loader)]
    expected = [r.loss for r in pairs.train((batch(s), None) for s in range(1, 4))]
    assert losses == expected
    assert_same(pairs, mappings)


def test_a_batch_of_another_form_is_refused_with_the_forms_train_takes():
    with pytest.raises(TypeError, match=r"\(inputs, targets\) pairs, or as a Mapping.*got a tuple of 3"):
        list(pipe().train([(batch(1), None, None)]))


def test_on_step_is_called_with_each_result_in_order():
    p = pipe()
    seen = []
    p.on_step(lambda result: seen.append((result.step, result.loss)))
    returned = [(r.step, r.loss) for r in p.train((batch(s), None) for s in range(1, 4))]
    p.step(batch(4))
    assert seen[:3] == returned and [s for s, _ in seen] == [1, 2, 3, 4]


# One micro-batch per update: a replica's micro-batch j is another set of samples than the whole batch's
# micro-batch j, so at m > 1 an async stream pairs other samples with each weight version than one process does.
ONE_MICRO_BATCH_STASH = dict(schedule="async-1f1b", staleness="stash", micro_batches=1)


def hybrid_own_loss(rank, world):
    """2 stages x 2 replicas, the labels inside the inputs: step, an async stream and predict; zero 1, 2, 3."""
    sync = pipe(engine="distributed", data_parallel=2)
    losses = [sync.step(batch(s)) for s in (1, 2)]
    stream = pipe(engine="distributed", data_parallel=2, **ONE_MICRO_BATCH_STASH)
    stream_losses = [r.loss for r in stream.train(batch(s) for s in (1, 2, 3))]
    sharded = {}
    for zero in (1, 2, 3):
        p = pipe(engine="distributed", data_parallel=2, zero=zero)
        sharded[zero] = [p.step(batch(s)) for s in (1, 2)], p.state_dict(), p.predict(batch(4))["logits"]
    return losses, sync.state_dict(), stream_losses, stream.state_dict(), sync.predict(batch(4))["logits"], sharded


@pytest.mark.slow
def test_hybrid_mode_takes_the_labels_inside_the_inputs(tmp_path, one_thread):
    # Each replica trains on half of every mini-batch (its labels with it); the mean of the replicas' own
    # losses is the whole batch's, so the pipeline equals one process on the whole batch up to float32
    # rounding of the two halves' sums.
    per_rank = run_world(4, "test_batch_forms", "hybrid_own_loss", tmp_path)
    sync, stream = pipe(), pipe(**ONE_MICRO_BATCH_STASH)
    losses = [sync.step(batch(s)) for s in (1, 2)]
    stream_losses = [r.loss for r in stream.train(batch(s) for s in (1, 2, 3))]
    for index, reference in ((1, sync), (3, stream)):
        merged = {k: v for rank in per_rank[:2] for k, v in rank[index].items()}
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-7, msg=name)
    for got, want in ((per_rank[0][0], losses), (per_rank[0][2], stream_losses)):
        assert got == pytest.approx(want, rel=1e-6)
    for rank in per_rank:
        torch.testing.assert_close(rank[4], sync.predict(batch(4))["logits"], rtol=1e-6, atol=1e-6)
    for zero in (1, 2, 3):  # ZeRO's reductions and, at 3, FSDP2's sharded parameters take them alike
        merged = {k: v for rank in per_rank[:2] for k, v in rank[5][zero][1].items()}
        for name, value in sync.state_dict().items():
            torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-7, msg=f"zero={zero} {name}")
        assert per_rank[0][5][zero][0] == pytest.approx(losses, rel=1e-6)
        for rank in per_rank:
            torch.testing.assert_close(rank[5][zero][2], sync.predict(batch(4))["logits"], rtol=1e-6, atol=1e-6)

"""Batches of any sequence length and micro-batches of any size, as padding loaders make them.

A capture fixes no size the model does not need: the pipeline trains on batches padded to lengths
shorter and longer than the example's (up to the model's maximum) like the unsplit model trained with
gradient accumulation over the same micro-batches, predicts its eval output at a new length, and a
model that builds tensors from its batch size (CLIP's contrastive loss) runs micro-batches of any size.
Under torchrun a new input shape costs one shape header per link, nothing more.

Tolerances as in test_third_party_models: where torch.export captures the model, the stages run
the ATen calls its Python code dispatches to, and a few group a sum differently (a weight gradient
summed in one addmm rather than per call), so parameters agree to 1e-5 relative (1e-7 absolute for
rounding noise around zero) and outputs to 1e-5 / 1e-6; torch.fx runs the very same module calls
(bit for bit in practice, compared with the same tolerance).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers as hf

import partitioners
import pipetrain
from dist_harness import run_world
from partitioners import input_sizes
from pipetrain.comm.recording import recording
from pipetrain.comm.agreed_shapes import AgreedShapes
from pipetrain.runtime import host_sync
from pipetrain.runtime.batching import batch_size, split_micro_batches
from schedules.nccl_order import Group
from third_party_models import VOCAB, build
from helpers import wrap_unprofiled

MICRO = 2
MAX_LEN = 32  # the position tables of the models below
LENGTHS = (5, 12, MAX_LEN)  # the example has 8
hf.logging.set_verbosity_error()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class TinyEncoder(nn.Module):
    """A token classifier torch.fx captures: positions sliced to the input's length, padding masked."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.pos = nn.Parameter(torch.randn(1, MAX_LEN, 16) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
                                    for _ in range(4))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos[:, : input_ids.shape[1]]
        padding = attention_mask == 0
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=padding)
        return self.head(h)


def make(name: str) -> nn.Module:
    if name == "clip":
        return clip()
    if name == "fx-encoder":
        torch.manual_seed(0)
        return TinyEncoder()
    return build(name)


def logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def token_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens that are not padding (labels -100)."""
    return F.cross_entropy(logits(out).flatten(0, 1), labels.flatten(), ignore_index=-100)


def padded_batch(samples: int, length: int, seed: int) -> tuple[dict, torch.Tensor]:
    """Token ids padded to ``length`` (the longest sample has it), the attention mask and labels that skip padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, length), generator=g)
    lengths = torch.randint(max(1, length // 2), length + 1, (samples,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = ids * mask  # pad token 0
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def reference_training(name: str, batches: list, loss_fn=token_loss) -> nn.Module:
    """The unsplit model trained with gradient accumulation over the same micro-batches."""
    model = make(name)
    opt = sgd(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        ys = split_micro_batches(y, MICRO) if y is not None else [None] * MICRO
        for xi, yi in zip(split_micro_batches(x, MICRO), ys):
            (loss_fn(model(**xi), yi) * batch_size(xi) / batch_size(x)).backward()
        opt.step()
    return model


def assert_same_state(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if value.is_floating_point():
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7, msg=key)
        else:
            assert torch.equal(ours[key], value), key


@pytest.mark.parametrize("example", [(2, 8), (8, 8), (2, 2)])
def test_export_keeps_batch_and_length_dynamic_whatever_the_example(example: tuple[int, int]) -> None:
    # (8, 8): batch = length = Llama's head_dim, where duck sizing would tie the two and a reshape by
    # head_dim could fix them; (2, 2): the smallest sizes export keeps dynamic (it fixes a size of 1).
    # torch.export gives each input dimension its own symbol and fixes none of them here.
    ids = torch.randint(0, VOCAB, example)
    graph = partitioners.trace(make("llama").train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                               profile=False, capture="export")
    assert graph.input_limits == {}


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", ["llama", "gpt2", "fx-encoder"])
def test_trains_and_predicts_at_any_length_like_the_unsplit_model(name: str, stages: int) -> None:
    batches = [padded_batch(5, length, seed) for seed, length in enumerate(LENGTHS, start=1)]
    pipe = wrap_unprofiled(make(name), padded_batch(2, 8, 0)[0], stages=stages, micro_batches=MICRO,
                           loss_fn=token_loss, optimizer=sgd, engine="local")
    assert pipe.plan.num_stages == stages
    if name == "fx-encoder":  # captured by torch.fx: its layers are module calls
        called = {str(n.target) for n in pipe.plan.graph.module.graph.nodes if n.op == "call_module"}
        assert {f"layers.{i}" for i in range(4)} <= called
    for x, y in batches:
        pipe.step(x, y)
    reference = reference_training(name, batches)
    assert_same_state(pipe.state_dict(), reference.state_dict())

    x, _ = padded_batch(3, 20, 9)  # a length never seen, 3 samples in 2 micro-batches
    with torch.no_grad():
        expected = logits(reference.eval()(**x))
    torch.testing.assert_close(logits(pipe.predict(x)), expected, rtol=1e-5, atol=1e-6)


def test_a_size_the_capture_fixed_is_named_before_the_step_runs() -> None:
    class FixedLength(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            steps = int(x.shape[1])  # a Python number: torch.export fixes the length (torch.fx cannot trace it)
            return self.head(self.proj(x).sum(1) / steps)

    pipe = wrap_unprofiled(FixedLength(), torch.randn(2, 6, 4), stages=2, micro_batches=MICRO,
                           optimizer=sgd, engine="local")
    # the length, and the features the first Linear's weight pins
    assert pipe.plan.graph.input_limits == {"x": {1: input_sizes.SizeLimit(fixed=6), 2: input_sizes.SizeLimit(fixed=4)}}
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(ValueError, match=r"input 'x' has size 7 in dimension 1, .* runs only with 6 .* fix:"):
        pipe.step(torch.randn(4, 7, 4), torch.randint(0, 3, (4,)))
    assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
    pipe.step(torch.randn(5, 6, 4), torch.randint(0, 3, (5,)))  # any batch size, the example's length


def test_agreed_shapes_keep_the_most_recently_used_keys_per_link() -> None:
    agreed = AgreedShapes(kept=2)
    for key in ("a", "b"):
        agreed.add(0, key, (key,))
    agreed.add(1, "c", ("c",))  # another link: its own keys
    assert agreed.get(0, "a") == ("a",)  # now more recent than "b"
    agreed.add(0, "d", ("d",))
    assert agreed.get(0, "b") is None and agreed.get(0, "a") == ("a",) and agreed.get(1, "c") == ("c",)


def clip() -> nn.Module:
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=8)
    return hf.CLIPModel(hf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


def clip_batch(samples: int, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(1, VOCAB, (samples, length), generator=g),
            "pixel_values": torch.randn(samples, 3, 16, 16, generator=g), "return_loss": True}


def test_clip_trains_micro_batches_of_any_size_like_the_unsplit_model() -> None:
    # CLIP's loss contrasts the samples of a micro-batch with labels arange(len(logits)): the batch size
    # must stay symbolic. 5 and 7 samples split unevenly (3 + 2, 4 + 3); the example has 4.
    batches = [(clip_batch(5, 6, 1), None), (clip_batch(7, 12, 2), None)]
    pipe = wrap_unprofiled(clip(), clip_batch(4, 8, 0), stages=2, micro_batches=MICRO, loss_fn=pipetrain.model_loss,
                           optimizer=sgd, engine="local")
    for x, _ in batches:
        pipe.step(x)
    reference = reference_training("clip", batches, loss_fn=pipetrain.model_loss)
    assert_same_state(pipe.state_dict(), reference.state_dict())

    x = clip_batch(5, 10, 3)  # a new length; the output holds a loss, so predict runs the whole batch at once
    got = pipe.predict(x)
    with torch.no_grad():
        expected = reference.eval()(**x)
    for field in ("text_embeds", "image_embeds", "logits_per_text", "loss"):
        torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="input 'input_ids' has size 17 in dimension 1, .* at most 16"):
        pipe.step(clip_batch(4, 17, 4))


def test_an_output_that_couples_the_samples_is_predicted_on_the_whole_batch() -> None:
    # Without return_loss CLIP returns no loss, but logits_per_image has a row and a column per sample:
    # micro-batches' outputs would concatenate into (6, 3) blocks, not the batch's (6, 6).
    x = clip_batch(4, 8, 0)
    del x["return_loss"]
    pipe = wrap_unprofiled(clip(), x, stages=2, micro_batches=MICRO, loss_fn=pipetrain.model_loss, optimizer=sgd,
                           engine="local")
    batch = clip_batch(6, 8, 1)
    del batch["return_loss"]
    got = pipe.predict(batch)
    with torch.no_grad():
        expected = clip().eval()(**batch)
    assert got.logits_per_image.shape == (6, 6)
    torch.testing.assert_close(got.logits_per_image, expected.logits_per_image, rtol=1e-5, atol=1e-6)


# ----- torchrun: one shape header per link and new input shape ---------------------------------------------
DIST_LENGTHS = (8, 12, 12, 5, 12)  # mini-batches of 4: micro-batches (2, length); the example is (2, 8)


def _distributed_run(engine: str) -> tuple[dict, torch.Tensor, list, Counter]:
    batches = [padded_batch(4, length, seed) for seed, length in enumerate(DIST_LENGTHS, start=1)]
    with recording() as recorder:
        pipe = wrap_unprofiled(make("llama"), padded_batch(2, 8, 0)[0], stages=2, micro_batches=MICRO,
                               loss_fn=token_loss, optimizer=sgd, partitioner="uniform", engine=engine)
        with host_sync.counting() as syncs:
            for x, y in batches:
                pipe.step(x, y)
            prediction = logits(pipe.predict(padded_batch(3, 12, 9)[0]))  # micro-batches (2, 12), (1, 12)
    return pipe.state_dict(), prediction, recorder.program, Counter(syncs)


def distributed_ranks(rank: int, world: int) -> tuple[dict, torch.Tensor, list, Counter]:
    hf.logging.set_verbosity_error()
    return _distributed_run("distributed")


@pytest.mark.slow
def test_torchrun_sends_one_header_per_link_and_new_input_shape(tmp_path, one_thread) -> None:
    per_rank = run_world(2, "test_sequence_lengths", "distributed_ranks", tmp_path)
    expected_state, expected_prediction, _, _ = _distributed_run("local")
    merged = {}
    for state, prediction, _, _ in per_rank:
        assert torch.equal(prediction, expected_prediction)
        merged.update(state)
    assert merged.keys() == expected_state.keys()
    assert all(torch.equal(merged[k], v) for k, v in expected_state.items())  # the same calls: the same bits

    # Input shapes of the micro-batches: (2, 8), (2, 12), (2, 5) training, (1, 12) predicting: 4 headers.
    headers = Counter(g.comm for g in per_rank[0][2] if isinstance(g, Group)
                      for op in g.ops if op.send and op.message[0] == "header")
    assert list(headers.values()) == [4]  # one link
    assert per_rank[1][3]["shape header"] == 4 and "shape header" not in per_rank[0][3]

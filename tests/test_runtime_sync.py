"""Synchronous schedules on the local engine equal the unsplit model with gradient accumulation."""
import pytest
import torch

from runtime_models import data, loss_fn, make, reference_training, sgd
from helpers import batches, wrap_unprofiled

SCHEDULES = [("gpipe", 4), ("1f1b", 4), ("interleaved-1f1b", 4), ("zb-h1", 4)]


def train_pipeline(name, stages, schedule, micro_batches, steps=3, **kw):
    bs = batches(name, steps, 12)
    pipe = wrap_unprofiled(make(name), bs[0][0][:2], stages=stages, micro_batches=micro_batches,
                           schedule=schedule, loss_fn=loss_fn(name), optimizer=sgd,
                           engine="local", **kw)
    losses = [pipe.step(x, y) for x, y in bs]
    return pipe, losses, bs


@pytest.mark.parametrize("name", ["mlp", "convbn", "skip", "tied"])
@pytest.mark.parametrize("schedule,micro_batches", SCHEDULES)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_sync_equals_gradient_accumulation(name, schedule, micro_batches, stages):
    if schedule == "interleaved-1f1b" and micro_batches % stages:
        micro_batches = stages * 2
    pipe, losses, bs = train_pipeline(name, stages, schedule, micro_batches, partitioner="uniform")
    ref = reference_training(name, bs, micro_batches)
    ours = pipe.state_dict()
    theirs = ref.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        # fp32 with the same operations in the same order: only summation grouping may differ.
        torch.testing.assert_close(ours[key], value, atol=1e-5, rtol=0, msg=key)


def test_loss_is_sample_weighted_mean_with_uneven_micro_batches():
    pipe, losses, bs = train_pipeline("mlp", 2, "1f1b", micro_batches=5, steps=1)
    # 12 samples in 5 micro-batches: sizes 3,3,2,2,2; the mean over samples is the reference.
    model = make("mlp")
    x, y = bs[0]
    expected = torch.nn.functional.cross_entropy(model(x), y).item()
    assert losses[0] == pytest.approx(expected, abs=1e-6)
    ref = reference_training("mlp", bs, 5)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=1e-5, rtol=0)


def test_shorter_last_batch_trains_like_the_reference():
    x, y = data("mlp", 30)
    bs = [(x[:12], y[:12]), (x[12:24], y[12:24]), (x[24:], y[24:])]
    pipe = wrap_unprofiled(make("mlp"), x[:2], stages=3, micro_batches=4, optimizer=sgd,
                           partitioner="uniform", engine="local")
    for xb, yb in bs:
        pipe.step(xb, yb)
    ref = reference_training("mlp", bs, 4)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=1e-5, rtol=0)


def test_predict_equals_unsplit_model_in_eval_mode():
    pipe, _, bs = train_pipeline("convbn", 3, "1f1b", 4, partitioner="uniform")
    ref = reference_training("convbn", bs, 4).eval()
    x = data("convbn", 10, seed=7)[0]
    torch.testing.assert_close(pipe.predict(x), ref(x), atol=1e-6, rtol=0)
    # predict() leaves the stages in training mode.
    assert all(rt.module.training for rt in pipe.held_stages.values())


@pytest.mark.parametrize("batch", [7, 3])
def test_interleaved_predict_takes_a_batch_whose_micro_batches_do_not_divide_over_the_stages(batch):
    # A validation tail (359 samples at batch 32 leave 7) at 4 stages x 2 chunks, 8 micro-batches:
    # min(8, 7) = 7 micro-batches are not a multiple of 4, which interleaved-1f1b cannot schedule.
    pipe, _, bs = train_pipeline("mlp", 4, "interleaved-1f1b", 8, partitioner="uniform")
    ref = reference_training("mlp", bs, 8).eval()
    x = data("mlp", batch, seed=7)[0]
    torch.testing.assert_close(pipe.predict(x), ref(x), atol=1e-6, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "async-1f1b"])
def test_predict_takes_any_batch_size_with_every_schedule(schedule):
    # 4 stages x 8 micro-batches (interleaved: x 2 chunks); batches below, between and above m.
    pipe = wrap_unprofiled(make("mlp"), data("mlp", 2)[0], stages=4, micro_batches=8, schedule=schedule,
                           staleness="stash" if schedule == "async-1f1b" else "none", optimizer=sgd,
                           partitioner="uniform", engine="local")
    model = make("mlp").eval()
    for batch in (1, 3, 7, 9, 13):
        x = data("mlp", batch, seed=7)[0]
        torch.testing.assert_close(pipe.predict(x), model(x), atol=1e-6, rtol=0, msg=f"batch {batch}")


def test_state_dict_keys_and_load_round_trip():
    pipe, _, _ = train_pipeline("tied", 3, "gpipe", 3, partitioner="uniform")
    original = make("tied").state_dict()
    assert set(pipe.state_dict()) == set(original)
    fresh = wrap_unprofiled(make("tied", seed=5), data("tied", 2)[0], stages=3, micro_batches=3, schedule="gpipe",
                            loss_fn=loss_fn("tied"), partitioner="uniform", engine="local")
    fresh.load_state_dict(pipe.state_dict())
    for key, value in pipe.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_tied_copies_stay_equal_across_stages():
    pipe, _, _ = train_pipeline("tied", 4, "1f1b", 4, partitioner="uniform")
    sd = pipe.state_dict()
    assert pipe.plan.tied_groups(), "the split should put embed and head on different stages"
    assert torch.equal(sd["embed.weight"], sd["head.weight"])


def test_step_result_reports_per_stage_numbers(tmp_path):
    pipe, _, bs = train_pipeline("mlp", 2, "1f1b", 4, partitioner="uniform", logdir=str(tmp_path))
    r = pipe.last_result
    assert r.step == 3 and r.samples == 12 and r.samples_per_second > 0
    assert len(r.busy_fraction) == 2 and all(0 < b <= 1 for b in r.busy_fraction)
    assert r.bytes_sent[0] > 0 and r.bytes_sent[1] > 0  # activations forward, gradients back
    assert all(a > 0 for a in r.activation_bytes)
    pipe.close()
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    pipe.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        pipe.step(*bs[0])


@pytest.mark.parametrize("schedule,expected", [("gpipe", [4, 4, 4]), ("1f1b", [3, 2, 1])])
def test_runtime_holds_the_in_flight_micro_batches_the_schedule_documents(schedule, expected):
    # gpipe keeps all m micro-batches in flight at every stage; 1f1b at most p-k at stage k.
    pipe, _, _ = train_pipeline("mlp", 3, schedule, 4, steps=1, partitioner="uniform")
    assert [pipe.held_stages[k].peak_in_flight for k in range(3)] == expected


class TwoInputsDictOut(torch.nn.Module):
    """Takes (features, mask) and returns a dict: several inputs and a structured output pass through."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x, mask):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h)) * mask  # the mask is needed two stages later
        return {"logits": self.c(h), "norm": h.pow(2).mean(dim=1)}


def dict_loss(out, y):
    return torch.nn.functional.cross_entropy(out["logits"], y) + 0.1 * out["norm"].mean()


def test_tuple_inputs_and_dict_outputs_pass_through():
    g = torch.Generator().manual_seed(3)
    x, mask = torch.randn(12, 8, generator=g), (torch.rand(12, 16, generator=g) > 0.3).float()
    y = torch.randint(0, 4, (12,), generator=g)
    torch.manual_seed(0)
    model = TwoInputsDictOut()
    reference = TwoInputsDictOut()
    reference.load_state_dict(model.state_dict())
    pipe = wrap_unprofiled(model, (x[:2], mask[:2]), stages=3, micro_batches=3, loss_fn=dict_loss, optimizer=sgd,
                           partitioner="uniform", engine="local")
    opt = sgd(reference.parameters())
    for _ in range(2):
        loss = pipe.step((x, mask), y)
        opt.zero_grad()
        expected = 0.0
        for xb, mb, yb in zip(x.tensor_split(3), mask.tensor_split(3), y.tensor_split(3)):
            part = dict_loss(reference(xb, mb), yb) * len(xb) / len(x)
            part.backward()
            expected += part.item()
        opt.step()
        assert loss == pytest.approx(expected, abs=1e-6)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, atol=1e-5, rtol=0)
    out = pipe.predict((x, mask))
    assert set(out) == {"logits", "norm"} and out["logits"].shape == (12, 4)

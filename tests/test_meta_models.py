"""Models built on the meta device: captured without data, each stage made on its own device only.

The reference is always the model built with data: with ``weights=`` pointing at a checkpoint saved from it,
a meta-built pipeline trains like the unsplit model loaded from that checkpoint (gradient accumulation over
the same micro-batches, 1e-5 relative: the capture on the meta device may order a few ATen calls
differently, e.g. a ``contiguous`` copy, which changes float sums in the last bits). Without ``weights`` every
stage count and both engines give bit-identical initial weights. A rank creates the tensors of its own
stage and nothing more (counted by a dispatch mode over every allocation ``wrap`` makes).
"""
from __future__ import annotations

import functools
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pipetrain
from dist_harness import run_world
from test_third_party_models import MICRO, assert_same_state, reference_training, sgd
from third_party_models import CASES, build
from helpers import capture_once, wrap_unprofiled

pytestmark = pytest.mark.slow  # spawns gloo ranks in its module fixture (see pyproject: slow)

hf.logging.set_verbosity_error()
HF_MODELS = ("gpt2", "t5", "llama")


# For capture_once: ("meta", name) is the capture of on_meta(name) on CASES[name].batch(2, 0)[0], which every
# test here that wraps a meta model captures; what it is loaded from or initialised with comes after the capture.
_CAPTURES: dict = {}


def on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return CASES[name].build()


def save_checkpoint(name: str, form: str, root: Path) -> Path:
    """``build(name)`` (the reference's weights) saved as ``form``; returns what ``weights=`` gets."""
    model = build(name)
    if form == "sharded":
        model.save_pretrained(root, max_shard_size="20KB")
        assert (root / "model.safetensors.index.json").exists()
        return root
    if form == "hf-single":
        model.save_pretrained(root)
        return root
    if form == "safetensors-file":
        save_file({k: v.contiguous() for k, v in model.state_dict().items()
                   if not k.endswith("lm_head.weight") or name != "gpt2"}, str(root / "w.safetensors"))
        return root / "w.safetensors"
    if form == "state-dict":
        torch.save(model.state_dict(), root / "w.pt")
        return root / "w.pt"
    assert form == "pipetrain"
    case = CASES[name]
    pipe = wrap_unprofiled(model, case.batch(2, 0)[0], stages=3, micro_batches=MICRO, loss_fn=case.loss_fn,
                           optimizer=sgd, engine="local")
    pipe.save(root / "ckpt")
    return root / "ckpt"


def train_from(name: str, weights: Path, stages: int, engine: str = "local") -> tuple[pipetrain.Pipeline, list]:
    case = CASES[name]
    batches = [case.batch(8, seed) for seed in (1, 2)]
    pipe = pipetrain.wrap(on_meta(name), case.batch(2, 0)[0], stages=stages, micro_batches=MICRO,
                          loss_fn=case.loss_fn, optimizer=sgd, engine=engine, weights=str(weights))
    for x, y in batches:
        pipe.step(x, y)
    return pipe, batches


@functools.cache
def trained_reference(name: str) -> dict[str, torch.Tensor]:
    """The unsplit model's state after the two batches train_from trains on (computed once per model; the tests
    only read it)."""
    case = CASES[name]
    return reference_training(name, [case.batch(8, seed) for seed in (1, 2)]).state_dict()


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", [*HF_MODELS, "torchvision-resnet18"])
def test_meta_model_with_weights_trains_like_the_unsplit_model(name: str, stages: int, tmp_path: Path,
                                                               monkeypatch) -> None:
    form = "state-dict" if name.startswith("torchvision") else "sharded"
    with capture_once(monkeypatch, _CAPTURES, ("meta", name)):
        pipe, batches = train_from(name, save_checkpoint(name, form, tmp_path), stages)
    assert pipe.plan.num_stages == stages
    assert_same_state(pipe.state_dict(), trained_reference(name), exact=False)


@pytest.mark.parametrize("form", ["hf-single", "safetensors-file", "state-dict", "pipetrain"])
def test_every_checkpoint_form_gives_the_same_training(form: str, tmp_path: Path, monkeypatch) -> None:
    weights = save_checkpoint("gpt2", form, tmp_path)
    with capture_once(monkeypatch, _CAPTURES, ("meta", "gpt2")):
        pipe, _ = train_from("gpt2", weights, 2)
    assert_same_state(pipe.state_dict(), trained_reference("gpt2"), exact=False)


def ranks_on_meta(rank: int, world: int, gpt2_weights: str) -> dict:
    """Everything the tests ask of 2 gloo ranks, in one world (starting one takes seconds): the bytes wrap
    allocates, initial weights without a checkpoint, training from GPT-2's checkpoint, and a Llama given it."""
    allocated = count_bytes(world)  # first: no other pipeline of this process runs meanwhile
    pipe, batches = train_from("gpt2", Path(gpt2_weights), world, "distributed")
    # The reference on the rank itself: the same thread settings, so the same float sums as the pipeline's.
    reference = reference_training("gpt2", batches).state_dict() if rank == 0 else None
    # Both Llama pipelines capture on_meta("llama") on its example: the second partitions a copy of the first's.
    with capture_once(pytest.MonkeyPatch(), {}, ("meta", "llama")):
        initial = initial_state("llama", world, "distributed")
        wrong_checkpoint = wrap_a_checkpoint_of_another_model(world, gpt2_weights)
    return {"bytes": allocated, "initial": initial, "trained": pipe.state_dict(), "reference": reference,
            "wrong checkpoint": wrong_checkpoint}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("ranks")
    weights = save_checkpoint("gpt2", "sharded", root / "hf")
    return run_world(2, "test_meta_models", "ranks_on_meta", root, str(weights))


def test_every_rank_reads_its_own_stage_from_the_checkpoint(two_ranks: list[dict]) -> None:
    state = {k: v for r in two_ranks for k, v in r["trained"].items()}
    assert_same_state(state, two_ranks[0]["reference"], exact=False)


def initial_state(name: str, stages: int, engine: str = "local") -> dict[str, torch.Tensor]:
    case = CASES[name]
    pipe = pipetrain.wrap(on_meta(name), case.batch(2, 0)[0], stages=stages, micro_batches=MICRO,
                          loss_fn=case.loss_fn, engine=engine, seed=7)
    return pipe.state_dict()


@functools.cache
def initial_state_on_one_stage(name: str) -> dict[str, torch.Tensor]:
    """initial_state(name, 1), made once: two tests compare with it and only read it."""
    return initial_state(name, 1)


@pytest.mark.parametrize("name", ["llama", "gpt2", "torchvision-resnet18"])
def test_initial_weights_without_a_checkpoint_are_the_same_at_every_stage_count(name: str, monkeypatch) -> None:
    with capture_once(monkeypatch, _CAPTURES, ("meta", name)):  # each stage count partitions and initialises
        one = initial_state_on_one_stage(name)
        for stages in (2, 4):
            assert_same_state(initial_state(name, stages), one, exact=True)
    reference = build(name).state_dict()
    assert set(one) == set(reference)
    assert all(one[k].shape == reference[k].shape and one[k].dtype == reference[k].dtype for k in one)


def test_initial_weights_are_the_same_under_torchrun(two_ranks: list[dict]) -> None:
    state = {k: v for r in two_ranks for k, v in r["initial"].items()}
    assert_same_state(state, initial_state_on_one_stage("llama"), exact=True)


class AllocatedBytes(TorchDispatchMode):
    """Bytes of every new storage of floating tensors on a real device that the calls under this mode create
    (meta costs none; the byte tensors collectives pickle objects into are not a model's). It keeps every
    storage it counted alive: a freed temporary's address may be reused by a later storage, which would then
    look seen and go uncounted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, torch.UntypedStorage] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta:
                storage = t.untyped_storage()
                if storage._cdata not in self.seen:
                    self.seen[storage._cdata] = storage
                    self.bytes += storage.nbytes()
        return out


def _bigger_llama() -> torch.nn.Module:
    """Big enough that each weight matrix (8 KiB and more) stands out of the few small temporaries that
    initialisation allocates (rotary frequencies). Two layers, one a rank (it had 4: its capture runs under the
    counting dispatch mode, slowly); measured with 2: a rank's own tensors 54% of the whole, temporaries 900 bytes."""
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=32))


def count_bytes(world: int) -> dict:
    with torch.device("meta"):
        model = _bigger_llama()
    ids = torch.randint(0, 256, (2, 8))
    with AllocatedBytes() as counter:
        pipe = pipetrain.wrap(model, {"input_ids": ids, "labels": ids}, stages=world, micro_batches=2,
                              loss_fn=pipetrain.model_loss, engine="distributed")
    (stage,) = pipe.held_stages.values()
    own = {id(t): t.numel() * t.element_size() for t in (*stage.module.parameters(), *stage.module.buffers())}
    return {"allocated": counter.bytes, "own": sum(own.values()),
            "whole": sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))}


def test_a_rank_creates_only_its_own_stage(two_ranks: list[dict]) -> None:
    per_rank = [r["bytes"] for r in two_ranks]
    smallest_matrix = 64 * 32 * 4  # k_proj: hidden x (2 key/value heads x 16) in fp32
    for r in per_rank:
        # The stage's tensors plus a few small temporaries: no weight matrix of the other stage fits in between.
        assert r["own"] <= r["allocated"] < r["own"] + smallest_matrix, r
        assert r["own"] < r["whole"] * 0.75


class Unknown(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_module_nobody_initialises_is_named_with_the_fix() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Unknown(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"(?s)1\.scale.*weights="):
        pipetrain.wrap(model, torch.randn(2, 4), stages=2, micro_batches=1, engine="local")


def test_wrap_keeps_no_copy_of_the_model_alive() -> None:
    model = build("llama")
    alive = weakref.ref(model.lm_head.weight)
    case = CASES["llama"]
    pipe = wrap_unprofiled(model, case.batch(2, 0)[0], stages=2, micro_batches=MICRO, loss_fn=case.loss_fn,
                           engine="local")
    del model
    gc.collect()
    assert alive() is None
    assert pipe.step(*case.batch(4, 1)) > 0


def test_a_pipetrain_checkpoint_resumes_into_a_meta_model_at_another_stage_count(tmp_path: Path) -> None:
    case = CASES["llama"]
    batches = [case.batch(8, seed) for seed in (1, 2, 3)]
    saved = wrap_unprofiled(build("llama"), case.batch(2, 0)[0], stages=2, micro_batches=MICRO, loss_fn=case.loss_fn,
                            optimizer=sgd, engine="local")
    saved.step(*batches[0])
    saved.save(tmp_path / "ckpt")
    saved.step(*batches[1])
    resumed = pipetrain.wrap(on_meta("llama"), case.batch(2, 0)[0], stages=4, micro_batches=MICRO,
                             loss_fn=case.loss_fn, optimizer=sgd, engine="local")
    resumed.load(tmp_path / "ckpt")
    resumed.step(*batches[1])
    assert_same_state(resumed.state_dict(), saved.state_dict(), exact=False)


def test_a_meta_capture_predicts_the_memory_of_the_materialised_one() -> None:
    # Attention on the meta device has only the unfused math path, which would save the attention weights:
    # the count runs the CPU's fused kernel instead, so both captures save the same bytes per micro-batch.
    import partitioners

    x = CASES["llama"].batch(2, 0)[0]
    real = partitioners.trace_for_training(build("llama"), x, profile=False)
    meta = partitioners.trace_for_training(on_meta("llama"), x, profile=False)

    def total(graph: partitioners.CostGraph, key: str) -> int:
        return sum(graph.graph.nodes[n][key] for n in graph.graph)

    assert total(meta, "saved_bytes") == total(real, "saved_bytes") > 0
    # the meta kernels' strides make export add two contiguous copies: their outputs, nothing else
    assert 0 <= total(meta, "act_bytes") - total(real, "act_bytes") <= 0.02 * total(real, "act_bytes")


def wrap_a_checkpoint_of_another_model(world: int, weights: str) -> str:
    case = CASES["llama"]
    try:
        pipetrain.wrap(on_meta("llama"), case.batch(2, 0)[0], stages=world, micro_batches=MICRO,
                       loss_fn=case.loss_fn, engine="distributed", weights=weights)
    except pipetrain.WeightsError as error:
        return str(error)
    return "no error"


def test_a_checkpoint_that_does_not_fit_is_the_same_error_on_every_rank(two_ranks: list[dict]) -> None:
    # GPT-2's checkpoint for a Llama: every Llama tensor missing, every GPT-2 key unexpected; each rank checks
    # the whole model's names, so each raises before building anything, with the same message.
    messages = [r["wrong checkpoint"] for r in two_ranks]
    assert messages[0] == messages[1] != "no error"
    assert "21 tensors of the model missing: model.embed_tokens.weight" in messages[0]
    assert "unexpected keys, no name of the model: transformer." in messages[0]
    assert "save it from the model you pass to wrap" in messages[0]
